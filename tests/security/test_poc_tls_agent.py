"""Findings 2 and 3 against the real agent with mutual TLS, set up from `dsv41ctl pki` output the
documented way: 1100 idle TCP connections to the agent's port locked the coordinator out (no TLS
handshake timeout, LimitNOFILE 1024, no connection limit; gRPC dropped a silent connection only
after ~2 minutes); and `pki rotate` revoked nothing: the old coordinator certificate stayed good
for the rest of its 730 days."""

from __future__ import annotations

import resource
import socket
import time

import grpc
import pytest
from cryptography import x509

from coordinator import pki
from coordinator.agents import AgentClient, Tls
from dsv41.v1 import agent_pb2 as pb
from tests.integration.agentnode import wait
from tests.integration.test_security import NODES, booted_tls_agent, install_bundle, read, secure_stub

pytestmark = pytest.mark.integration

IDLE = 1100


@pytest.fixture(scope="module")
def tls_agent(rootfs, tmp_path_factory):
    yield from booted_tls_agent(rootfs, tmp_path_factory, "sec-poc3")


def coordinator(store: pki.PkiStore, port: int, cert: bytes | None = None, key: bytes | None = None) -> AgentClient:
    tls = Tls(read(store.path("ca", "crt")), cert or read(store.path("coordinator", "crt")),
              key or read(store.path("coordinator", "key")))
    return AgentClient("spark2", f"127.0.0.1:{port}", tls)


def idle(port: int, count: int, source: str) -> list[socket.socket]:
    held = []
    for _ in range(count):
        s = socket.socket()
        s.bind((source, 0))
        try:
            s.connect(("127.0.0.1", port))
        except OSError:
            s.close()
            continue
        held.append(s)
    return held


@pytest.fixture
def many_descriptors():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def coordinator_gets_through(store: pki.PkiStore, port: int, node=None) -> None:
    """The coordinator's status call is answered, within 10 s: made as `dsv41ctl status` makes it
    (coordinator/control.py: wait_for_ready, so a connection the flood cost is made again within
    the deadline). When it is not, the agent's journal of its connections is in the failure."""
    client = coordinator(store, port)
    start = time.monotonic()
    try:
        assert client.status(timeout=10, wait_for_ready=True).node == "spark2"
    except Exception as exc:
        entries = node.journal(unit="dsv41-agent.service") if node is not None else []
        lines = [e.get("MESSAGE", "") for e in entries]
        lines = [m for m in lines if "connection" in m or "cannot" in m or "andshake" in m]
        raise AssertionError(f"{exc}; the agent's last connection events: {lines[-20:]}") from exc
    finally:
        client.close()
    assert time.monotonic() - start < 10


def test_idle_connections_do_not_lock_the_coordinator_out(tls_agent, many_descriptors):
    node, port, store = tls_agent
    held = idle(port, IDLE, "127.0.0.2")  # another host on the network
    try:
        coordinator_gets_through(store, port, node)
        assert wait(lambda: node.journal(matches=["DSV41_EVENT=connection_refused"]), timeout=10)
        # From the coordinator's own address too (a local user on its host): a connection that never
        # spoke gives way to the coordinator's, which speaks at once.
        held += idle(port, IDLE, "127.0.0.1")
        coordinator_gets_through(store, port, node)
    finally:
        for s in held:
            s.close()
    assert node.show("dsv41-agent.service", "NRestarts")["NRestarts"] == "0"


def test_a_connection_that_never_speaks_is_dropped_after_the_handshake_timeout(tls_agent):
    _, port, _ = tls_agent
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        start = time.monotonic()
        assert s.recv(1) == b""  # closed by the agent
        elapsed = time.monotonic() - start
    # dropped by the handshake timeout (5 s), not refused at once, and not kept for gRPC's 120 s
    assert 3 <= elapsed < 15, f"an idle connection was kept {elapsed:.1f} s (TLS_HANDSHAKE_TIMEOUT_S is 5)"


def test_a_rotated_coordinator_certificate_is_refused(tls_agent):
    node, port, store = tls_agent
    before = node.show("dsv41-agent.service", "MainPID", "NRestarts")
    old_cert, old_key = read(store.path("coordinator", "crt")), read(store.path("coordinator", "key"))
    store.rotate(NODES, only=pki.COORDINATOR_NAME)
    # until the node has the new bundle, the old certificate is the pinned one
    old = coordinator(store, port, old_cert, old_key)
    try:
        assert old.status(timeout=10).node == "spark2"
    finally:
        old.close()
    install_bundle(node, store, "spark2")  # pins the new coordinator certificate
    channel, stub = secure_stub(port, store, old_key, old_cert)
    try:
        with pytest.raises(grpc.RpcError) as info:
            stub.GetStatus(pb.GetStatusRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "is not the one this node's bundle pins: it was rotated away" in info.value.details()
        with pytest.raises(grpc.RpcError):
            stub.StartRank(pb.StartRankRequest(spec=pb.RankSpec()), timeout=10)
    finally:
        channel.close()
    new = coordinator(store, port)
    try:
        assert new.status(timeout=10).node == "spark2"
    finally:
        new.close()
    assert node.show("dsv41-agent.service", "MainPID", "NRestarts") == before  # no restart needed
    serial = x509.load_pem_x509_certificate(old_cert).serial_number
    assert serial != x509.load_pem_x509_certificate(read(store.path("coordinator", "crt"))).serial_number
    refused = node.journal(matches=["DSV41_EVENT=caller_refused"])
    assert any("rotated away" in e["MESSAGE"] for e in refused)
