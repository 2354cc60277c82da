"""Preflight asks every agent once: one that cannot be reached (a node booting, powered off or cut
off, an agent restarting) makes the step stop for the supervisor to wait for it (phase `waiting`);
an answer that waiting cannot change fails the step at once."""

import io

import grpc
import pytest

from coordinator import config
from coordinator.agents import AgentUnavailable
from coordinator.bringup import BringUp, StepContext, StepFailed
from coordinator.bringup.preflight import statuses
from dsv41.journal import EventLog
from dsv41.v1 import agent_pb2 as pb
from tests.configtext import HOME, SEED_TEXT
from tests.rpcfailure import RpcFailure

pytestmark = pytest.mark.unit


class Agent:
    """Answers GetStatus, or fails with `error`."""

    def __init__(self, node, error=None, explanation=None):
        self.node, self.target = node, f"{node}:7441"
        self.error, self.explanation = error, explanation
        self.calls, self.timeouts = 0, []

    def status(self, timeout=None):
        self.calls += 1
        self.timeouts.append(timeout)
        if self.error is not None:
            raise AgentUnavailable(self.node, "GetStatus", self.error, self.explanation)
        return pb.NodeStatus(node=self.node, agent_version="1")


def context(*agents):
    cfg = config.parse(SEED_TEXT, "cluster.env", HOME)
    log = EventLog("test", {}, stream=io.StringIO(), use_journal=False)
    return StepContext("preflight", cfg, {a.node: a for a in agents}, log, BringUp(), wait=pytest.fail,
                       call=lambda fn, to_end=False: fn(), monotonic=lambda: 0.0, set_detail=lambda d: None)


REFUSED = RpcFailure(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; connection refused")
SILENT = RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")


def test_every_agent_is_asked_once_with_a_deadline_within_the_lease():
    agents = [Agent("spark1"), Agent("spark2"), Agent("spark3")]
    got = statuses(context(*agents))
    assert list(got) == ["spark1", "spark2", "spark3"] and got["spark2"].node == "spark2"
    assert [a.calls for a in agents] == [1, 1, 1]
    assert agents[0].timeouts == [6.0]  # NODE_LEASE_S (6) is below the 10 s cap


def test_agents_that_cannot_be_reached_are_named_for_the_supervisor_to_wait_for():
    ctx = context(Agent("spark1"), Agent("spark2", SILENT), Agent("spark3", REFUSED))
    with pytest.raises(StepFailed) as info:
        statuses(ctx)
    failed = info.value
    assert failed.unreachable == ("spark2", "spark3") and failed.transient and failed.node == "spark2"
    # the call waited NODE_LEASE_S (6 s): the node has been silent at least that long
    assert failed.reason == "agent at spark2:7441 not answering for 6.0 s (frozen, powered off or cut off?)"
    assert str(failed) == ("preflight: spark2: agent at spark2:7441 not answering for 6.0 s (frozen, powered off or "
                           "cut off?)")


@pytest.mark.parametrize("error, explanation", [
    (RpcFailure(grpc.StatusCode.UNAVAILABLE, "Peer name spark3 is not in peer certificate"),
     "the agent at spark3:7441 presents a certificate for spark2"),
    (RpcFailure(grpc.StatusCode.UNAUTHENTICATED, "the caller is not the cluster's coordinator"), None),
    (RpcFailure(grpc.StatusCode.INTERNAL, "boom"), None),
])
def test_an_answer_that_waiting_cannot_change_fails_at_once(error, explanation):
    ctx = context(Agent("spark1", REFUSED), Agent("spark3", error, explanation))
    with pytest.raises(StepFailed) as info:
        statuses(ctx)
    assert info.value.unreachable == () and not info.value.transient and info.value.node == "spark3"
    assert info.value.reason.startswith("agent at spark3:7441: ")
