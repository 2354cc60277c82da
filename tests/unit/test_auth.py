"""The agent's side of mutual TLS (agent/auth.py) over real gRPC on loopback: only the coordinator's
certificate may call, a node's certificate may not, and a rotated certificate is served without a restart."""

from __future__ import annotations

import datetime as dt
import os
import shutil
import socket
import ssl
import threading
from concurrent import futures
from contextlib import contextmanager

import grpc
import pytest
from cryptography import x509

from agent import auth
from coordinator import pki
from dsv41.v1 import agent_pb2 as pb
from dsv41.v1 import agent_pb2_grpc

pytestmark = pytest.mark.unit

NODES = [("spark2", "127.0.0.1"), ("spark3", "127.0.0.1")]


class Recorder(agent_pb2_grpc.AgentServicer):
    """Stands in for AgentService: records which handlers ran."""

    def __init__(self):
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def _seen(self, name):
        with self.lock:
            self.calls.append(name)

    def GetStatus(self, request, context):
        self._seen("GetStatus")
        return pb.NodeStatus(node="spark2")

    def StartRank(self, request, context):
        self._seen("StartRank")
        return pb.StartRankResponse(outcome=pb.StartRankResponse.STARTED)

    def WatchEvents(self, request, context):
        self._seen("WatchEvents")
        yield pb.Event(kind="hello")


@contextmanager
def serve_agent(directory: str, node: str = "spark2", allowed: str = pki.COORDINATOR_NAME):
    """An agent-like gRPC server with this node's files from `directory` (a PkiStore root)."""
    store = pki.PkiStore(directory, group=None)
    refused: list[tuple[str, str]] = []
    problems: list[str] = []
    files = auth.CredentialFiles(store.path("ca", "crt"), store.path(f"nodes/{node}", "crt"),
                                 store.path(f"nodes/{node}", "key"), problems.append)
    recorder = Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                         interceptors=[auth.CallerCheck(allowed, lambda m, w: refused.append((m, w)))])
    agent_pb2_grpc.add_AgentServicer_to_server(recorder, server)
    port = server.add_secure_port("127.0.0.1:0", files.server_credentials())
    server.start()
    try:
        yield port, recorder, refused, problems
    finally:
        server.stop(0).wait()


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def stub(port: int, ca: bytes, key: bytes | None, cert: bytes | None, name: str = "spark2"):
    creds = grpc.ssl_channel_credentials(ca, key, cert)
    channel = grpc.secure_channel(f"127.0.0.1:{port}", creds, options=[("grpc.ssl_target_name_override", name)])
    return channel, agent_pb2_grpc.AgentStub(channel)


@pytest.fixture
def store(tmp_path):
    s = pki.PkiStore(str(tmp_path / "pki"), group=None)
    s.init(NODES)
    return s


def client_cert(store, name: str, client: bool = True):
    """A certificate signed by the cluster CA for another name (what `pki init` never issues)."""
    ca, ca_key = store.load_ca()
    key = pki.new_key()
    now = dt.datetime.now(dt.timezone.utc)
    cert = pki.make_leaf(pki.LeafSpec(name, (), client), key, ca, ca_key, now - dt.timedelta(minutes=1),
                         now + dt.timedelta(days=1))
    return pki.key_pem(key), pki.cert_pem(cert)


def test_the_coordinator_may_call_unary_and_streaming(store):
    ca = read(store.path("ca", "crt"))
    with serve_agent(store.root) as (port, recorder, refused, _):
        channel, s = stub(port, ca, read(store.path("coordinator", "key")), read(store.path("coordinator", "crt")))
        assert s.GetStatus(pb.GetStatusRequest(), timeout=10).node == "spark2"
        assert [e.kind for e in s.WatchEvents(pb.WatchEventsRequest(), timeout=10)] == ["hello"]
        channel.close()
    assert recorder.calls == ["GetStatus", "WatchEvents"] and refused == []


def test_a_ca_signed_certificate_for_another_name_is_unauthenticated_before_any_handler(store):
    ca = read(store.path("ca", "crt"))
    key, cert = client_cert(store, "intruder")
    with serve_agent(store.root) as (port, recorder, refused, _):
        channel, s = stub(port, ca, key, cert)
        for call in (lambda: s.StartRank(pb.StartRankRequest(), timeout=10),
                     lambda: list(s.WatchEvents(pb.WatchEventsRequest(), timeout=10))):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert info.value.details() == ("the client certificate is for intruder, and only dsv41-coordinator "
                                            "may call this agent")
        channel.close()
    assert recorder.calls == []
    assert [m for m, _ in refused] == ["/dsv41.v1.Agent/StartRank", "/dsv41.v1.Agent/WatchEvents"]


def test_a_client_certificate_named_like_a_node_is_unauthenticated(store):
    # Issued with clientAuth so that it passes the handshake: the name check alone must refuse it.
    key, cert = client_cert(store, "spark3")
    with serve_agent(store.root) as (port, recorder, _, _):
        channel, s = stub(port, read(store.path("ca", "crt")), key, cert)
        with pytest.raises(grpc.RpcError) as info:
            s.StartRank(pb.StartRankRequest(), timeout=10)
        channel.close()
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and recorder.calls == []


@pytest.mark.parametrize("who", ["no certificate", "self-signed coordinator", "node spark3", "other CA"])
def test_callers_without_a_coordinator_certificate_of_this_ca_fail_the_handshake(store, tmp_path, who):
    ca = read(store.path("ca", "crt"))
    if who == "no certificate":
        key, cert = None, None
    elif who == "node spark3":  # serverAuth only: it cannot be used as a client at all
        key, cert = read(store.path("nodes/spark3", "key")), read(store.path("nodes/spark3", "crt"))
    else:
        other = pki.PkiStore(str(tmp_path / "other"), group=None)
        other.init(NODES)
        if who == "other CA":
            key, cert = read(other.path("coordinator", "key")), read(other.path("coordinator", "crt"))
        else:  # a certificate that signs itself, with the coordinator's name
            k = pki.new_key()
            spec = pki.LeafSpec(pki.COORDINATOR_NAME, (), True)
            now = dt.datetime.now(dt.timezone.utc)
            self_ca = pki.make_ca(k, now)
            cert = pki.cert_pem(pki.make_leaf(spec, k, self_ca, k, now, now + dt.timedelta(days=1)))
            key = pki.key_pem(k)
    with serve_agent(store.root) as (port, recorder, refused, _):
        channel, s = stub(port, ca, key, cert)
        with pytest.raises(grpc.RpcError) as info:
            s.StartRank(pb.StartRankRequest(), timeout=10)
        channel.close()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert recorder.calls == [] and refused == []


def served_serial(port: int, ca: bytes, coordinator_cert: str, coordinator_key: str) -> int:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.set_alpn_protocols(["h2"])
    context.load_verify_locations(cadata=ca.decode())
    context.load_cert_chain(coordinator_cert, coordinator_key)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, context.wrap_socket(raw) as tls:
        return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number


def test_a_rotated_certificate_is_served_from_the_next_connection_without_a_restart(store):
    ca = read(store.path("ca", "crt"))
    coord = (store.path("coordinator", "crt"), store.path("coordinator", "key"))
    old = x509.load_pem_x509_certificate(read(store.path("nodes/spark2", "crt"))).serial_number
    with serve_agent(store.root) as (port, _, _, problems):
        assert served_serial(port, ca, *coord) == old
        store.rotate(NODES, only="spark2")
        new = x509.load_pem_x509_certificate(read(store.path("nodes/spark2", "crt"))).serial_number
        assert served_serial(port, ca, *coord) == new != old
        channel, s = stub(port, ca, read(coord[1]), read(coord[0]))
        assert s.GetStatus(pb.GetStatusRequest(), timeout=10).node == "spark2"
        channel.close()
    assert problems == []


def test_a_half_copied_bundle_keeps_the_previous_certificate_and_is_reported_once(store, tmp_path):
    ca = read(store.path("ca", "crt"))
    coord = (store.path("coordinator", "crt"), store.path("coordinator", "key"))
    old = x509.load_pem_x509_certificate(read(store.path("nodes/spark2", "crt"))).serial_number
    with serve_agent(store.root) as (port, _, _, problems):
        saved_key = read(store.path("nodes/spark2", "key"))
        store.rotate(NODES, only="spark2")
        with open(store.path("nodes/spark2", "key"), "wb") as f:  # new certificate, old key
            f.write(saved_key)
        for _ in range(3):
            assert served_serial(port, ca, *coord) == old
        assert problems == [f"{store.path('nodes/spark2', 'crt')}: the key does not belong to the certificate; "
                            "still serving the previous certificate"]


def test_unusable_files_at_start_are_an_error_that_says_why(store):
    with pytest.raises(ValueError, match="the key does not belong to the certificate"):
        auth.CredentialFiles(store.path("ca", "crt"), store.path("nodes/spark2", "crt"),
                             store.path("nodes/spark3", "key"))
    with pytest.raises(ValueError, match="cannot read the TLS files"):
        auth.CredentialFiles(store.path("ca", "crt"), store.path("nodes/spark2", "crt"), "/nonexistent/node.key")


def test_a_certificate_of_another_ca_is_refused_at_start(store, tmp_path):
    other = pki.PkiStore(str(tmp_path / "other"), group=None)
    other.init(NODES)
    with pytest.raises(ValueError, match="not signed by the CA in the TLS_CA file"):
        auth.CredentialFiles(store.path("ca", "crt"), other.path("nodes/spark2", "crt"),
                             other.path("nodes/spark2", "key"))


@pytest.mark.parametrize("context, names, problem", [
    ({}, (), "no verified client certificate"),
    ({"transport_security_type": [b"insecure"], "x509_common_name": [b"dsv41-coordinator"]}, (),
     "no verified client certificate"),
    ({"transport_security_type": [b"ssl"], "x509_common_name": [b"dsv41-coordinator"],
      "x509_subject_alternative_name": [b"dsv41-coordinator"]}, ("dsv41-coordinator",), None),
    # the SAN decides when there is one: a CN alone does not add a name
    ({"transport_security_type": [b"ssl"], "x509_common_name": [b"dsv41-coordinator"],
      "x509_subject_alternative_name": [b"spark3", b"127.0.0.1"]}, ("spark3", "127.0.0.1"),
     "the client certificate is for spark3, 127.0.0.1"),
    ({"transport_security_type": [b"ssl"], "x509_common_name": [b"dsv41-coordinator"]}, ("dsv41-coordinator",), None),
])
def test_caller_names_and_problem(context, names, problem):
    assert auth.caller_names(context) == names
    got = auth.caller_problem(context, "dsv41-coordinator")
    assert (got is None) if problem is None else got.startswith(problem)


def test_cert_not_after(store, tmp_path):
    path = store.path("nodes/spark2", "crt")
    cert = x509.load_pem_x509_certificate(read(path))
    assert auth.cert_not_after(path) == int(pki.not_after_of(cert).timestamp())
    assert auth.cert_not_after(None) == 0 and auth.cert_not_after(str(tmp_path / "absent")) == 0
    garbage = tmp_path / "garbage.crt"
    garbage.write_text("not a certificate")
    assert auth.cert_not_after(str(garbage)) == 0


def test_copying_a_whole_new_bundle_directory_is_picked_up(store, tmp_path):
    """The documented install (tar over the old files) replaces ca.crt, node.crt and node.key in place."""
    node_dir = tmp_path / "tls"
    node_dir.mkdir()
    for src, dst in (("ca.crt", "ca.crt"), ("nodes/spark2.crt", "node.crt"), ("nodes/spark2.key", "node.key")):
        shutil.copy(os.path.join(store.root, src), node_dir / dst)
    problems: list[str] = []
    files = auth.CredentialFiles(str(node_dir / "ca.crt"), str(node_dir / "node.crt"), str(node_dir / "node.key"),
                                 problems.append)
    assert files._fetch() is None  # unchanged: nothing reloaded
    store.rotate(NODES, only="spark2")
    shutil.copy(store.path("nodes/spark2", "crt"), node_dir / "node.crt")
    shutil.copy(store.path("nodes/spark2", "key"), node_dir / "node.key")
    assert files._fetch() is not None
    assert files.cert_pem() == read(store.path("nodes/spark2", "crt")) and problems == []
