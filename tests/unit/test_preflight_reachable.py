"""Preflight waits, up to its deadline, for an agent that cannot be reached yet (a node still booting,
an agent restarting), and fails at once on an answer that waiting cannot change."""

import io

import grpc
import pytest

from coordinator import config
from coordinator.agents import AgentUnavailable
from coordinator.bringup import BringUp, StepContext, StepFailed
from coordinator.bringup.preflight import statuses_once_reachable
from dsv41.journal import EventLog
from dsv41.v1 import agent_pb2 as pb
from tests.configtext import HOME, SEED_TEXT
from tests.rpcfailure import RpcFailure

pytestmark = pytest.mark.unit


class Clock:
    """Monotonic time that only the step's waits move."""

    def __init__(self):
        self.now = 100.0
        self.sleeps = []

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


class LateAgent:
    """Answers GetStatus after failing `failures` times with `error`."""

    def __init__(self, node, failures, error, explanation=None):
        self.node, self.target = node, f"{node}:7441"
        self.failures, self.error, self.explanation = failures, error, explanation
        self.calls = 0

    def status(self, timeout=None):
        self.calls += 1
        assert timeout is not None and timeout >= 1.0
        if self.calls <= self.failures:
            raise AgentUnavailable(self.node, "GetStatus", self.error, self.explanation)
        return pb.NodeStatus(node=self.node, agent_version="1")


def context(*agents):
    cfg = config.parse(SEED_TEXT, "cluster.env", HOME)
    clock = Clock()
    stream = io.StringIO()
    details = []
    log = EventLog("test", {}, stream=stream, use_journal=False)
    ctx = StepContext("preflight", cfg, {a.node: a for a in agents}, log, BringUp(), wait=clock.sleep,
                      call=lambda fn, to_end=False: fn(), monotonic=clock.monotonic, set_detail=details.append)
    return ctx, clock, stream, details


REFUSED = RpcFailure(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; connection refused")


def test_an_agent_that_comes_up_within_the_deadline_is_waited_for():
    agent = LateAgent("spark3", failures=3, error=REFUSED)
    ctx, clock, stream, details = context(agent)
    statuses = statuses_once_reachable(ctx, 30.0)
    assert statuses["spark3"].node == "spark3" and agent.calls == 4
    assert clock.sleeps == [1.0, 1.0, 1.0]
    assert details == ["waiting for the agent on spark3: failed to connect to all addresses; connection refused"]
    assert stream.getvalue().count("not reachable yet, waiting up to 30 s") == 1  # one line, not one per try


def test_only_the_agents_not_reachable_yet_are_asked_again():
    late, ready = LateAgent("spark3", failures=2, error=REFUSED), LateAgent("spark2", failures=0, error=REFUSED)
    ctx, clock, _, _ = context(ready, late)
    statuses = statuses_once_reachable(ctx, 30.0)
    assert list(statuses) == ["spark2", "spark3"]
    assert (ready.calls, late.calls) == (1, 3) and clock.sleeps == [1.0, 1.0]


def test_an_agent_still_unreachable_at_the_deadline_fails_saying_how_long_it_waited():
    agent = LateAgent("spark3", failures=10**6, error=REFUSED)
    ctx, clock, _, _ = context(agent)
    with pytest.raises(StepFailed) as info:
        statuses_once_reachable(ctx, 5.0)
    assert info.value.step == "preflight" and info.value.node == "spark3" and not info.value.transient
    assert info.value.reason == ("agent at spark3:7441: UNAVAILABLE: failed to connect to all addresses; "
                                 "connection refused (still unreachable after 5 s)")
    assert 4 <= agent.calls <= 6 and clock.now - 100.0 <= 5.0


@pytest.mark.parametrize("error, explanation", [
    (RpcFailure(grpc.StatusCode.UNAVAILABLE, "Peer name spark3 is not in peer certificate"),
     "the agent at spark3:7441 presents a certificate for spark2"),
    (RpcFailure(grpc.StatusCode.UNAUTHENTICATED, "the caller is not the cluster's coordinator"), None),
    (RpcFailure(grpc.StatusCode.INTERNAL, "boom"), None),
])
def test_an_answer_that_waiting_cannot_change_fails_at_once(error, explanation):
    agent = LateAgent("spark3", failures=10**6, error=error, explanation=explanation)
    ctx, clock, stream, _ = context(agent)
    with pytest.raises(StepFailed) as info:
        statuses_once_reachable(ctx, 30.0)
    assert agent.calls == 1 and clock.sleeps == []
    assert "still unreachable" not in info.value.reason and "waiting" not in stream.getvalue()
    assert info.value.reason.startswith("agent at spark3:7441: ")
