"""dsv41/relay.py: bytes both ways, the peer's identity for the server, connection limits and which
connection gives way, against a real gRPC server on a unix socket."""

from __future__ import annotations

import os
import socket
import time
from concurrent import futures

import grpc
import pytest

from dsv41.relay import Limits, Peer, Relay, parse_peer, peer_name
from dsv41.v1 import agent_pb2 as pb
from dsv41.v1 import agent_pb2_grpc

pytestmark = pytest.mark.unit


class Agent(agent_pb2_grpc.AgentServicer):
    def __init__(self):
        self.peers = []

    def GetStatus(self, request, context):
        self.peers.append(parse_peer(context.peer()))
        return pb.NodeStatus(node="n" * 200_000)  # more than one read's worth each way

    def WatchEvents(self, request, context):
        i = 0
        while context.is_active():
            i += 1
            yield pb.Event(message=str(i) * 500)


@pytest.fixture
def served(tmp_path):
    agent = Agent()
    server = grpc.server(futures.ThreadPoolExecutor(8))
    agent_pb2_grpc.add_AgentServicer_to_server(agent, server)
    upstream = str(tmp_path / "g.sock")
    server.add_insecure_port(f"unix:{upstream}")
    server.start()
    refused: list[str] = []
    relay = Relay(upstream, Limits(8, 3), refused=lambda peer, why: refused.append(why))
    port = relay.listen_tcp("127.0.0.1", 0, "agent")
    relay.listen_unix(str(tmp_path / "pub.sock"), "control", mode=0o660)
    relay.start()
    try:
        yield agent, relay, port, str(tmp_path / "pub.sock"), refused
    finally:
        relay.stop()
        server.stop(0)


def stub(target: str):
    channel = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
    return channel, agent_pb2_grpc.AgentStub(channel)


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_calls_and_streams_pass_and_the_server_learns_who_called(served):
    agent, relay, port, unix, _ = served
    channel, s = stub(f"127.0.0.1:{port}")
    assert len(s.GetStatus(pb.GetStatusRequest(), timeout=10).node) == 200_000
    events = s.WatchEvents(pb.WatchEventsRequest(), timeout=10)
    assert [next(events).message[:1] for _ in range(3)] == ["1", "2", "3"]
    events.cancel()
    peer = agent.peers[-1]
    assert peer.tag == "agent" and peer.source.startswith("127.0.0.1:") and peer.uid == -1
    channel.close()
    wait_for(lambda: relay.connections == 0)  # the client went away: so did its relayed connection
    channel, s = stub(f"unix:{unix}")
    s.GetStatus(pb.GetStatusRequest(), timeout=10)
    channel.close()
    assert agent.peers[-1] == Peer("control", "", os.getuid(), os.getpid())
    assert oct(os.stat(unix).st_mode & 0o777) == "0o660"


def test_names_round_trip_and_others_are_not_relayed_peers():
    for peer in (Peer("agent", "10.0.0.1:51234"), Peer("agent", "[fd00::1]:7"), Peer("status", "", 1000, 42)):
        assert parse_peer("unix-abstract:" + peer_name(peer, 7)) == peer
    assert parse_peer("ipv4:10.0.0.1:5") is None and parse_peer("unix:") is None
    assert parse_peer("unix-abstract:dsv41-peer/x/uid=a/pid=1/2") is None


def test_a_silent_connection_gives_way_and_those_that_spoke_are_kept(served):
    _, relay, port, _, refused = served
    channel, s = stub(f"127.0.0.1:{port}")
    s.GetStatus(pb.GetStatusRequest(), timeout=10)  # it spoke: kept
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(10)]  # never speak
    try:
        wait_for(lambda: relay.connections == 3)  # the limit per source
        assert s.GetStatus(pb.GetStatusRequest(), timeout=10).node  # the one that spoke still works
        other, t = stub(f"127.0.0.1:{port}")
        assert t.GetStatus(pb.GetStatusRequest(), timeout=10).node  # a new caller takes a silent one's place
        wait_for(lambda: any("that had not spoken, for a new one" in why for why in refused))
        other.close()
    finally:
        for sock in idle:
            sock.close()
        channel.close()


def test_when_every_connection_has_spoken_a_new_one_is_refused(served):
    _, relay, port, _, refused = served
    channels = [stub(f"127.0.0.1:{port}") for _ in range(3)]
    for _, s in channels:
        s.GetStatus(pb.GetStatusRequest(), timeout=10)
    wait_for(lambda: relay.connections == 3)
    extra = socket.create_connection(("127.0.0.1", port))
    try:
        extra.settimeout(5)
        assert extra.recv(1) == b""  # closed at once
        wait_for(lambda: any("it has 3 open, the limit per source" in why for why in refused))
    finally:
        extra.close()
        for channel, _ in channels:
            channel.close()


def test_a_caller_whose_bytes_wait_unread_is_not_taken_for_silent(served, tmp_path):
    # The kernel queues connections and their first bytes before the relay accepts them; idle
    # connections queued behind a real caller's reach the relay in the same burst of accepts, before
    # it has read the caller's preface. The caller has spoken: an idle one gives way, not it.
    _, relay, _, _, refused = served
    relay.stop()
    late = Relay(str(tmp_path / "g.sock"), Limits(8, 3), refused=lambda peer, why: refused.append(why))
    port = late.listen_tcp("127.0.0.1", 0, "agent")
    channel, s = stub(f"127.0.0.1:{port}")
    call = s.GetStatus.future(pb.GetStatusRequest(), timeout=10)
    time.sleep(0.5)  # connected (the kernel's backlog) and its preface sent, unaccepted
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]  # queued behind it
    late.start()
    try:
        assert len(call.result(timeout=10).node) == 200_000
        wait_for(lambda: any("that had not spoken, for a new one" in why for why in refused))
    finally:
        late.stop()
        for sock in idle:
            sock.close()
        channel.close()


class SlowServer:
    """A unix server with a backlog of one that accepts nothing until told: the kernel answers
    connects beyond its backlog with EAGAIN, as a gRPC server's socket does while its accept thread
    is behind a burst."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(1)

    def echo_all(self, count: int) -> None:
        for _ in range(count):
            conn, _ = self.sock.accept()
            conn.settimeout(5)
            conn.sendall(b"echo " + conn.recv(64))
            conn.close()


def test_callers_beyond_a_full_server_backlog_wait_for_room_and_are_not_reset(tmp_path):
    import threading

    upstream = SlowServer(str(tmp_path / "slow.sock"))
    refused: list[str] = []
    relay = Relay(str(tmp_path / "slow.sock"), Limits(16, 16), refused=lambda peer, why: refused.append(why))
    port = relay.listen_tcp("127.0.0.1", 0, "agent")
    relay.start()
    callers = []
    try:
        for i in range(5):  # the first one or two fill the backlog, the rest get EAGAIN
            caller = socket.create_connection(("127.0.0.1", port))
            caller.sendall(b"hello %d" % i)  # like a TLS hello: sent before any answer
            callers.append(caller)
        wait_for(lambda: relay.connections == 5)
        time.sleep(0.3)  # the server's accept thread is behind
        server = threading.Thread(target=upstream.echo_all, args=(5,), daemon=True)
        server.start()
        for i, caller in enumerate(callers):
            caller.settimeout(5)
            assert caller.recv(64) == b"echo hello %d" % i
        server.join(5)
        assert refused == []
    finally:
        for caller in callers:
            caller.close()
        relay.stop()
        upstream.sock.close()


def test_a_caller_whose_server_stays_full_is_closed_with_a_fin_and_reported(tmp_path):
    upstream = SlowServer(str(tmp_path / "slow.sock"))
    refused: list[str] = []
    relay = Relay(str(tmp_path / "slow.sock"), Limits(16, 16, connect_wait_s=0.3),
                  refused=lambda peer, why: refused.append(why))
    port = relay.listen_tcp("127.0.0.1", 0, "agent")
    relay.start()
    callers = []
    try:
        for i in range(4):
            caller = socket.create_connection(("127.0.0.1", port))
            caller.sendall(b"hello")
            callers.append(caller)
        wait_for(lambda: any("backlog stayed full for 0.3 s" in why for why in refused))
        wait_for(lambda: relay.connections < 4)
        closed = 0
        for caller in callers[1:]:  # the backlog holds at most the first two
            caller.settimeout(0.05)
            try:
                data = caller.recv(64)  # a reset would raise ConnectionResetError here
            except socket.timeout:
                continue  # still relayed (in the backlog)
            assert data == b""
            closed += 1
        assert closed >= 2
        assert relay.connections == 4 - closed
    finally:
        for caller in callers:
            caller.close()
        relay.stop()
        upstream.sock.close()
