"""Preflight waits, up to its deadline, for an agent that cannot be reached yet (a node still booting,
an agent restarting), and fails at once on an answer that waiting cannot change."""

import io

import grpc
import pytest

from coordinator import config
from coordinator.agents import AgentUnavailable
from coordinator.runtime import ClusterRuntime
from dsv41.journal import EventLog
from dsv41.v1 import agent_pb2 as pb
from tests.configtext import HOME, SEED_TEXT
from tests.rpcfailure import RpcFailure

pytestmark = pytest.mark.unit


class Clock:
    """Monotonic time that only the runtime's sleeps move."""

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


def runtime(agent):
    cfg = config.parse(SEED_TEXT, "cluster.env", HOME)
    clock = Clock()
    stream = io.StringIO()
    log = EventLog("test", {}, stream=stream, use_journal=False)
    rt = ClusterRuntime(cfg, {agent.node: agent}, log, sleep=clock.sleep, monotonic=clock.monotonic)
    return rt, clock, stream


REFUSED = RpcFailure(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; connection refused")


def test_an_agent_that_comes_up_within_the_deadline_is_waited_for():
    agent = LateAgent("spark3", failures=3, error=REFUSED)
    rt, clock, stream = runtime(agent)
    status = rt._status_once_reachable(agent, 30.0)
    assert status.node == "spark3" and agent.calls == 4
    assert clock.sleeps == [1.0, 1.0, 1.0]
    assert rt.snapshot().detail.startswith("waiting for the agent on spark3: failed to connect")
    assert stream.getvalue().count("not reachable yet, waiting up to 30 s") == 1  # one line, not one per try


def test_an_agent_still_unreachable_at_the_deadline_fails_saying_how_long_it_waited():
    agent = LateAgent("spark3", failures=10**6, error=REFUSED)
    rt, clock, _ = runtime(agent)
    with pytest.raises(AgentUnavailable) as info:
        rt._status_once_reachable(agent, 5.0)
    assert info.value.code == "UNAVAILABLE" and info.value.node == "spark3"
    assert info.value.details == ("failed to connect to all addresses; connection refused "
                                  "(still unreachable after 5 s)")
    assert str(info.value).startswith("spark3: GetStatus: UNAVAILABLE: failed to connect")
    assert 4 <= agent.calls <= 6 and clock.now - 100.0 <= 5.0


@pytest.mark.parametrize("error, explanation", [
    (RpcFailure(grpc.StatusCode.UNAVAILABLE, "Peer name spark3 is not in peer certificate"),
     "the agent at spark3:7441 presents a certificate for spark2"),
    (RpcFailure(grpc.StatusCode.UNAUTHENTICATED, "the caller is not the cluster's coordinator"), None),
    (RpcFailure(grpc.StatusCode.INTERNAL, "boom"), None),
])
def test_an_answer_that_waiting_cannot_change_fails_at_once(error, explanation):
    agent = LateAgent("spark3", failures=10**6, error=error, explanation=explanation)
    rt, clock, stream = runtime(agent)
    with pytest.raises(AgentUnavailable) as info:
        rt._status_once_reachable(agent, 30.0)
    assert agent.calls == 1 and clock.sleeps == []
    assert "still unreachable" not in info.value.details and "waiting" not in stream.getvalue()
