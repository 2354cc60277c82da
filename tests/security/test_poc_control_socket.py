"""Finding 6, the control socket: 16 `events --follow` streams took every thread of the control
server, so status and stop went unanswered; a cancelled `logs` call left its threads blocked on a
queue nobody read, with the agents' journal streams open; every member of the dsv41 group could
stop, restart and force-unexport, and the journal did not say who.

Against the real control server (coordinator.control.serve: the relay on control.sock and
status.sock, gRPC behind it) over unix sockets, with stand-ins for the agents only."""

from __future__ import annotations

import io
import os
import threading
import time

import grpc
import pytest

from coordinator import config, control
from coordinator.runtime import Snapshot
from coordinator.sockets import status_socket
from dsv41.journal import EventLog
from dsv41.v1 import agent_pb2 as apb
from dsv41.v1 import control_pb2 as pb
from dsv41.v1 import control_pb2_grpc
from tests.configtext import HOME, SEED_TEXT
from tests.rpcfailure import RpcFailure

pytestmark = pytest.mark.unit


class JournalStream:
    """An agent's ReadJournal stream: lines as fast as they are read, until cancelled."""

    def __init__(self, node: str):
        self.node = node
        self.cancelled = threading.Event()

    def __iter__(self):
        return self

    def __next__(self):
        if self.cancelled.is_set():
            raise RpcFailure(grpc.StatusCode.CANCELLED, "cancelled")
        return apb.JournalLine(node=self.node, unit="dsv41-rank.service", message="x" * 100)

    def cancel(self):
        self.cancelled.set()


class Agent:
    def __init__(self, node: str):
        self.node = node
        self.streams: list[JournalStream] = []

    def status(self, timeout=None, wait_for_ready=False):
        return apb.NodeStatus(node=self.node)

    def read_journal(self, lines, follow):
        stream = JournalStream(self.node)
        self.streams.append(stream)
        return stream


class Runtime:
    def __init__(self, cfg):
        self.clients = {n.name: Agent(n.name) for n in cfg.nodes}
        self.requested: list[str] = []

    def snapshot(self):
        return Snapshot(phase="stopped")

    def liveness_views(self):
        return {}  # no heartbeat heard yet

    def incidents(self):
        return []

    def earlier_incidents(self):
        return 0

    def on_incident(self, listener):
        pass

    def request(self, action, reason=None):
        self.requested.append(action)

    def unexport(self, force, unmount):
        return True, "unexported"


@pytest.fixture
def control_server(tmp_path):
    cfg = config.parse(SEED_TEXT, "cluster.env", HOME)
    runtime = Runtime(cfg)
    journal = io.StringIO()
    log = EventLog("dsv41-coordinator", {"DSV41_NODE": "spark1"}, stream=journal, use_journal=False)
    path = str(tmp_path / "control.sock")
    server = control.serve(cfg, runtime, path, log)
    try:
        yield path, runtime, journal
    finally:
        server.stop(0).wait(5)


def stub(path: str):
    # One connection per channel, as separate dsv41ctl processes have (a process otherwise shares one).
    channel = grpc.insecure_channel(f"unix:{path}", options=[("grpc.use_local_subchannel_pool", 1)])
    return channel, control_pb2_grpc.ControlStub(channel)


def test_followers_cannot_starve_the_control_socket(control_server):
    path, _, _ = control_server
    followers = []
    try:
        for _ in range(16):  # as many `dsv41ctl events -f` as once took every thread
            channel, s = stub(path)
            call = s.Events(pb.EventsRequest(follow=True))
            followers.append((channel, call))
        time.sleep(1.0)  # every stream is being served, each holding a thread
        channel, s = stub(path)
        start = time.monotonic()
        assert s.GetStatus(pb.ClusterStatusRequest(), timeout=10).phase == "stopped"
        assert s.Stop(pb.StopRequest(), timeout=10).ok
        assert time.monotonic() - start < 5.0
        # one more stream than allowed is refused at once, saying why
        extra = s.Events(pb.EventsRequest(follow=True))
        with pytest.raises(grpc.RpcError) as info:
            next(extra)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "streams are open" in info.value.details()
        channel.close()
    finally:
        for channel, call in followers:
            call.cancel()
            channel.close()
    # the followers' slots come back once they went away: a new follower is served (until its deadline)
    deadline = time.monotonic() + 10
    while True:
        channel, s = stub(path)
        with pytest.raises(grpc.RpcError) as info:
            next(s.Events(pb.EventsRequest(follow=True), timeout=1.5))
        channel.close()
        if info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            break
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert time.monotonic() < deadline, "the stream slots of cancelled followers were not released"
        time.sleep(0.2)


def test_a_cancelled_logs_call_leaves_no_thread_and_no_agent_stream(control_server):
    path, runtime, _ = control_server
    before = {t.name for t in threading.enumerate()}
    channel, s = stub(path)
    call = s.Logs(pb.LogsRequest(follow=True, lines=10))
    for _ in range(50):
        next(call)
    time.sleep(0.5)  # the pumps have filled the queue: they block on it, as they did for good
    call.cancel()
    channel.close()
    streams = [st for agent in runtime.clients.values() for st in agent.streams]
    assert len(streams) == 3
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        pumps = [t for t in threading.enumerate() if t.name.startswith("logs-") and t.name not in before]
        if not pumps and all(st.cancelled.is_set() for st in streams):
            break
        time.sleep(0.1)
    assert all(st.cancelled.is_set() for st in streams), "the agents' journal streams were left open"
    assert not pumps, f"threads left behind: {[t.name for t in pumps]}"


def test_the_read_only_socket_reads_and_every_action_names_its_caller(control_server):
    path, runtime, journal = control_server
    assert os.path.exists(status_socket(path))
    channel, reader = stub(status_socket(path))
    assert reader.GetStatus(pb.ClusterStatusRequest(), timeout=10).phase == "stopped"
    for call, request in ((reader.Stop, pb.StopRequest()), (reader.Restart, pb.RestartRequest()),
                          (reader.UnexportShare, pb.UnexportRequest(force=True)),
                          (reader.AutotuneReset, pb.AutotuneResetRequest())):
        with pytest.raises(grpc.RpcError) as info:
            call(request, timeout=10)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "it needs the control socket (group dsv41)" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        next(reader.Pack(pb.PackRequest(start=True), timeout=10))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    channel.close()
    assert runtime.requested == []
    channel, operator = stub(path)
    reply = operator.Stop(pb.StopRequest(), timeout=10)
    assert reply.ok and runtime.requested == ["stop"]
    assert operator.UnexportShare(pb.UnexportRequest(force=True), timeout=10).ok
    channel.close()
    lines = journal.getvalue().splitlines()
    uid = os.getuid()
    stops = [line for line in lines if "DSV41_EVENT=control_call" in line and "DSV41_METHOD=Stop " in line]
    assert len(stops) == 1 and f"DSV41_CALLER_UID={uid}" in stops[0] and "DSV41_SOCKET=control" in stops[0]
    assert stops[0].startswith(f"<5>Stop requested by uid {uid} (")
    forced = [line for line in lines if "DSV41_EVENT=control_call" in line and "DSV41_METHOD=UnexportShare(force)" in line]
    assert len(forced) == 1 and f"DSV41_CALLER_UID={uid}" in forced[0]
    refused = [line for line in lines if "DSV41_EVENT=control_refused" in line]
    assert len(refused) == 5 and all(f"DSV41_CALLER_UID={uid}" in line and "DSV41_SOCKET=status" in line
                                     for line in refused)
