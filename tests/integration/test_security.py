"""Mutual TLS against a real agent in a booted node, set up from `dsv41ctl pki` output the documented
way (the node's bundle unpacked with tar): callers without the coordinator's certificate are refused and
start nothing, a rotated certificate is served without an agent restart, hostile requests over the
authenticated channel start nothing. A second node runs `pki init` with a dsv41 group, the real
coordinator (TLS files checked by load_tls) and the control socket's permissions."""

from __future__ import annotations

import datetime as dt
import json
import socket
import ssl
import time
from types import SimpleNamespace

import grpc
import pytest
from cryptography import x509
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator import pki
from coordinator.agents import AgentClient, AgentUnavailable, Tls
from dsv41.v1 import agent_pb2 as pb
from dsv41.v1 import agent_pb2_grpc
from testbed.nspawn import Node
from tests.integration.agentnode import REPO, SRC, free_port, install_agent, spec, wait
from tests.integration.simcluster import cluster_env
from tests.integration.test_agent_fuzz import ALLOWED_CODES, specs

pytestmark = pytest.mark.integration

NODES = [("spark2", "127.0.0.1"), ("spark3", "127.0.0.1")]


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def agent_env_lines(bundle: bytes) -> str:
    import io
    import tarfile
    with tarfile.open(fileobj=io.BytesIO(bundle)) as tar:
        text = tar.extractfile("etc/dsv41/tls/agent.env").read().decode()
    return "".join(line + "\n" for line in text.splitlines() if line and not line.startswith("#"))


def install_bundle(node: Node, store: pki.PkiStore, name: str) -> bytes:
    """What an operator does: copy the bundle over, unpack it at / as root."""
    bundle = store.bundle_tar(name)
    node.write_file(f"/var/tmp/{name}.tar", bundle, mode=0o600)
    node.run(["tar", "-xpf", f"/var/tmp/{name}.tar", "-C", "/"])
    return bundle


def booted_tls_agent(rootfs, tmp_path_factory, machine: str):
    """A booted node `machine` running the agent as spark2 with its bundle from a new PKI:
    yields (node, port, store) and stops the node afterwards."""
    store = pki.PkiStore(str(tmp_path_factory.mktemp(machine) / "pki"), group=None)
    store.init(NODES)
    node = Node(machine, rootfs)
    node.boot()
    port = free_port()
    try:
        bundle = install_bundle(node, store, "spark2")
        install_agent(node, port, extra=agent_env_lines(bundle))
        yield node, port, store
    finally:
        node.stop()


@pytest.fixture(scope="module")
def tls_agent(rootfs, tmp_path_factory):
    yield from booted_tls_agent(rootfs, tmp_path_factory, "sec-agent")


def secure_stub(port: int, store: pki.PkiStore, key: bytes | None, cert: bytes | None, name: str = "spark2"):
    creds = grpc.ssl_channel_credentials(read(store.path("ca", "crt")), key, cert)
    channel = grpc.secure_channel(f"127.0.0.1:{port}", creds, options=[("grpc.ssl_target_name_override", name)])
    return channel, agent_pb2_grpc.AgentStub(channel)


def coordinator_stub(port: int, store: pki.PkiStore):
    channel, stub = secure_stub(port, store, read(store.path("coordinator", "key")),
                                read(store.path("coordinator", "crt")))
    grpc.channel_ready_future(channel).result(timeout=20)
    return channel, stub


def ca_signed_client(store: pki.PkiStore, name: str) -> tuple[bytes, bytes]:
    ca, ca_key = store.load_ca()
    key = pki.new_key()
    now = dt.datetime.now(dt.timezone.utc)
    cert = pki.make_leaf(pki.LeafSpec(name, (), True), key, ca, ca_key, now - dt.timedelta(minutes=1),
                         now + dt.timedelta(days=1))
    return pki.key_pem(key), pki.cert_pem(cert)


def self_signed_coordinator() -> tuple[bytes, bytes]:
    key = pki.new_key()
    now = dt.datetime.now(dt.timezone.utc)
    own_ca = pki.make_ca(key, now)
    cert = pki.make_leaf(pki.LeafSpec(pki.COORDINATOR_NAME, (), True), key, own_ca, key, now,
                         now + dt.timedelta(days=1))
    return pki.key_pem(key), pki.cert_pem(cert)


def rank_starts(node: Node) -> int:
    return len(node.journal(matches=["DSV41_EVENT=rank_started"]))


def nothing_started(node: Node, stub, starts_before: int = 0) -> None:
    assert stub.GetStatus(pb.GetStatusRequest(), timeout=10).rank.active_state in ("absent", "inactive")
    assert node.show("dsv41-rank.service", "ActiveState")["ActiveState"] == "inactive"
    assert rank_starts(node) == starts_before


def test_the_bundle_unpacks_with_its_modes(tls_agent):
    node, _, _ = tls_agent
    out = node.run(["stat", "-c", "%a %U %G %n", "/etc/dsv41/tls", "/etc/dsv41/tls/ca.crt", "/etc/dsv41/tls/node.crt",
                    "/etc/dsv41/tls/node.key", "/etc/dsv41/tls/agent.env"]).stdout.splitlines()
    assert out == ["750 root root /etc/dsv41/tls", "640 root root /etc/dsv41/tls/ca.crt",
                   "640 root root /etc/dsv41/tls/node.crt", "600 root root /etc/dsv41/tls/node.key",
                   "640 root root /etc/dsv41/tls/agent.env"]


def test_callers_without_the_coordinators_certificate_start_nothing(tls_agent):
    node, port, store = tls_agent
    request = pb.StartRankRequest(spec=spec(), start_timeout_s=20)
    spark3_node = (read(store.path("nodes/spark3", "key")), read(store.path("nodes/spark3", "crt")))
    callers = {
        "plain text": (None, grpc.StatusCode.UNAVAILABLE),
        "TLS without a client certificate": ((None, None), grpc.StatusCode.UNAVAILABLE),
        "a self-signed dsv41-coordinator": (self_signed_coordinator(), grpc.StatusCode.UNAVAILABLE),
        "spark3's own certificate and key": (spark3_node, grpc.StatusCode.UNAVAILABLE),
        "a CA-signed client certificate for spark3": (ca_signed_client(store, "spark3"),
                                                     grpc.StatusCode.UNAUTHENTICATED),
    }
    for who, (creds, code) in callers.items():
        if creds is None:
            channel = grpc.insecure_channel(f"127.0.0.1:{port}")
            stub = agent_pb2_grpc.AgentStub(channel)
        else:
            channel, stub = secure_stub(port, store, *creds)
        with pytest.raises(grpc.RpcError) as info:
            stub.StartRank(request, timeout=20)
        channel.close()
        assert info.value.code() == code, (who, info.value.details())
    channel, stub = coordinator_stub(port, store)
    try:
        nothing_started(node, stub)
        refused = wait(lambda: node.journal(matches=["DSV41_EVENT=caller_refused"]))
        assert [e["MESSAGE"] for e in refused] == [
            "refused /dsv41.v1.Agent/StartRank: the client certificate is for spark3, and only dsv41-coordinator "
            "may call this agent"]
        # and the coordinator's certificate does start a rank
        reply = stub.StartRank(request, timeout=30)
        assert reply.outcome == pb.StartRankResponse.STARTED and reply.rank.main_pid > 0
        stopped = stub.StopRank(pb.StopRankRequest(deadline_s=10), timeout=30)
        assert stopped.outcome == pb.StopRankResponse.CLEAN
    finally:
        channel.close()


def test_the_coordinator_names_a_wrong_nodes_agent(tls_agent):
    _, port, store = tls_agent
    tls = Tls(read(store.path("ca", "crt")), read(store.path("coordinator", "crt")),
              read(store.path("coordinator", "key")))
    right = AgentClient("spark2", f"127.0.0.1:{port}", tls)
    wrong = AgentClient("spark3", f"127.0.0.1:{port}", tls)
    try:
        assert right.status(timeout=20).node == "spark2"
        with pytest.raises(AgentUnavailable) as info:
            wrong.status(timeout=20)
    finally:
        right.close()
        wrong.close()
    assert str(info.value).startswith(f"spark3: GetStatus: UNAVAILABLE: the agent at 127.0.0.1:{port} presents a "
                                      "certificate for spark2, 127.0.0.1, not for spark3")


def served_serial(port: int, store: pki.PkiStore) -> int:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.set_alpn_protocols(["h2"])
    context.load_verify_locations(cafile=store.path("ca", "crt"))
    context.load_cert_chain(store.path("coordinator", "crt"), store.path("coordinator", "key"))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, context.wrap_socket(raw) as tls:
        return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number


def test_a_rotated_bundle_is_served_without_restarting_the_agent(tls_agent):
    node, port, store = tls_agent
    before = node.show("dsv41-agent.service", "MainPID", "NRestarts")
    assert served_serial(port, store) == x509.load_pem_x509_certificate(
        read(store.path("nodes/spark2", "crt"))).serial_number
    store.rotate(NODES, only="spark2")
    install_bundle(node, store, "spark2")
    new = x509.load_pem_x509_certificate(read(store.path("nodes/spark2", "crt"))).serial_number
    assert served_serial(port, store) == new
    channel, stub = coordinator_stub(port, store)
    try:
        assert stub.GetStatus(pb.GetStatusRequest(), timeout=10).node == "spark2"
    finally:
        channel.close()
    assert node.show("dsv41-agent.service", "MainPID", "NRestarts") == before


def test_hostile_requests_over_the_authenticated_channel_start_nothing(tls_agent):
    node, port, store = tls_agent
    # as in test_agent_fuzz: the only executable this node allows does not exist
    node.run(["sed", "-i", "s|^ALLOWED_EXECUTABLES=.*|ALLOWED_EXECUTABLES=/usr/local/bin/missing-rank|",
              "/etc/dsv41/agent.env"])
    node.run(["systemctl", "restart", "dsv41-agent.service"], timeout=60)
    starts = rank_starts(node)  # the rank an earlier test started on purpose
    channel, stub = coordinator_stub(port, store)
    intruder_channel, intruder = secure_stub(port, store, *ca_signed_client(store, "intruder"))
    seen = set()

    @settings(max_examples=60, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(spec=specs, replace=st.booleans(), timeout=st.integers(0, 2**32 - 1))
    def throw(spec, replace, timeout):
        request = pb.StartRankRequest(spec=spec, replace=replace, start_timeout_s=timeout)
        with pytest.raises(grpc.RpcError) as info:
            stub.StartRank(request, timeout=30)
        assert info.value.code() in ALLOWED_CODES and info.value.details(), info.value.details()
        seen.add(info.value.code())
        with pytest.raises(grpc.RpcError) as info:
            intruder.StartRank(request, timeout=30)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

    try:
        throw()
        assert {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED} <= seen
        assert stub.GetStatus(pb.GetStatusRequest(), timeout=10).node == "spark2"
        nothing_started(node, stub, starts)
        assert node.show("dsv41-agent.service", "NRestarts")["NRestarts"] == "0"
    finally:
        channel.close()
        intruder_channel.close()


# ------------------------------------------------------------------ pki init on the head, control socket

def ctl(node: Node, *args: str, user: str | None = None):
    command = ["env", f"PYTHONPATH={SRC}", "PYTHONDONTWRITEBYTECODE=1", "/usr/bin/python3", "-m", "coordinator.ctl",
               *args]
    if user:
        command = ["runuser", "-u", user, "--", *command]
    return node.run(command, check=False, timeout=60)


def test_pki_init_on_the_head_the_coordinator_over_tls_and_the_control_socket(rootfs):
    node = Node("sec-head", rootfs)
    node.boot()
    try:
        port = free_port()
        node.run(["groupadd", "--system", "dsv41"])
        node.run(["useradd", "--no-create-home", "outsider"])
        node.run(["useradd", "--no-create-home", "--groups", "dsv41", "insider"])
        node.copy_in(REPO / "coordinator", f"{SRC}/coordinator")
        nodes = {"spark1": SimpleNamespace(address="127.0.0.1"), "spark2": SimpleNamespace(address="127.0.0.2")}
        node.write_file("/etc/dsv41/cluster.env", cluster_env(nodes, AGENT_PORT=str(port), INSECURE_NO_TLS="0",
                                                              PKI_DIR="/etc/dsv41/pki"))
        node.copy_in(REPO / "dsv41", f"{SRC}/dsv41")
        node.copy_in(REPO / "adapter", f"{SRC}/adapter")  # dsv41-coordinator depends on dsv41-adapter
        r = ctl(node, "pki", "init")
        assert r.returncode == 0, r.stderr
        listing = node.run(["find", "/etc/dsv41/pki", "-printf", "%m %u %g %P\n"]).stdout.splitlines()
        assert sorted(listing) == sorted([
            "750 root dsv41 ", "600 root root ca.key", "640 root dsv41 ca.crt", "600 root root coordinator.key",
            "640 root dsv41 coordinator.crt", "750 root dsv41 nodes", "600 root root nodes/spark1.key",
            "640 root dsv41 nodes/spark1.crt", "600 root root nodes/spark2.key", "640 root dsv41 nodes/spark2.crt"])
        # a member of dsv41 can read certificates, nobody but root a key
        assert node.run(["runuser", "-u", "insider", "--", "cat", "/etc/dsv41/pki/ca.crt"], check=False).returncode == 0
        for user in ("insider", "outsider"):
            denied = node.run(["runuser", "-u", user, "--", "cat", "/etc/dsv41/pki/nodes/spark1.key"], check=False)
            assert denied.returncode != 0 and "Permission denied" in denied.stderr
        r = ctl(node, "pki", "bundle", "spark1", "-o", "/var/tmp/spark1.tar")
        assert r.returncode == 0, r.stderr
        assert node.run(["stat", "-c", "%a %U", "/var/tmp/spark1.tar"]).stdout.strip() == "600 root"
        node.run(["tar", "-xpf", "/var/tmp/spark1.tar", "-C", "/"])
        snippet = node.run(["grep", "-v", "^#", "/etc/dsv41/tls/agent.env"]).stdout
        install_agent(node, port, extra=snippet)

        node.run(["systemd-run", "--unit=dsv41-coordinator", f"--setenv=PYTHONPATH={SRC}",
                  f"--property=WorkingDirectory={SRC}", "/usr/bin/python3", "-m", "coordinator.daemon",
                  "--config", "/etc/dsv41/cluster.env", "--no-autostart"])
        sock = "/run/dsv41/control.sock"
        assert wait(lambda: node.run(["test", "-S", sock], check=False).returncode == 0, timeout=30), \
            node.journal(unit="dsv41-coordinator")
        assert node.run(["stat", "-c", "%a %U %G", sock]).stdout.strip() == "660 root dsv41"

        refused = ctl(node, "status", user="outsider")
        assert refused.returncode == 4
        assert refused.stderr.strip() == (f"permission denied on {sock}: add yourself to the dsv41-read group "
                                          "(read only) or the dsv41 group (also start and stop): sudo usermod "
                                          "-aG dsv41-read $USER, then log in again")
        # a member gets the status, which the coordinator read from spark1's agent over mutual TLS
        deadline = time.monotonic() + 30
        while True:
            allowed = ctl(node, "status", "--json", user="insider")
            body = json.loads(allowed.stdout) if allowed.stdout.strip() else {}
            views = {v["name"]: v for v in body.get("nodes", [])}
            if views.get("spark1", {}).get("agent_reachable") or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert allowed.returncode == 1 and body["coordinator_running"], allowed.stderr
        assert views["spark1"]["agent_reachable"] and views["spark1"]["status"]["node"] == "spark1"
        assert not views["spark2"]["agent_reachable"]
    finally:
        node.stop()
