"""The coordinator's side of mutual TLS: an agent must present a certificate for the node it is asked
as, a wrong node's agent is refused with a clear message, and the coordinator's own files are checked
when it loads them."""

from __future__ import annotations

import os
import socket

import pytest

from coordinator import config, pki
from coordinator.agents import AgentClient, AgentUnavailable, Tls
from coordinator.session import load_tls
from tests.configtext import HOME, SEED_TEXT, edited
from tests.unit.test_auth import NODES, read, serve_agent

pytestmark = pytest.mark.unit


@pytest.fixture
def store(tmp_path):
    s = pki.PkiStore(str(tmp_path / "pki"), group=None)
    s.init(NODES)
    return s


def coordinator_tls(store) -> Tls:
    return Tls(read(store.path("ca", "crt")), read(store.path("coordinator", "crt")),
               read(store.path("coordinator", "key")))


def test_the_expected_node_answers(store):
    with serve_agent(store.root, node="spark2") as (port, recorder, _, _):
        client = AgentClient("spark2", f"127.0.0.1:{port}", coordinator_tls(store))
        try:
            assert client.status(timeout=10).node == "spark2"
        finally:
            client.close()
    assert recorder.calls == ["GetStatus"]


def test_another_nodes_agent_is_refused_with_a_message_naming_both(store):
    # The address the config gives spark3 is answered by spark2's agent (a swapped bundle or address).
    with serve_agent(store.root, node="spark2") as (port, recorder, _, _):
        client = AgentClient("spark3", f"127.0.0.1:{port}", coordinator_tls(store))
        try:
            with pytest.raises(AgentUnavailable) as info:
                client.status(timeout=10)
        finally:
            client.close()
    assert recorder.calls == []
    assert info.value.code == "UNAVAILABLE"
    assert info.value.details.startswith(f"the agent at 127.0.0.1:{port} presents a certificate for spark2, "
                                         "127.0.0.1, not for spark3")
    assert "dsv41ctl pki bundle spark3" in str(info.value) and str(info.value).startswith("spark3: GetStatus: ")


def test_an_agent_with_another_clusters_certificate_is_refused_naming_the_ca(store, tmp_path):
    other = pki.PkiStore(str(tmp_path / "other"), group=None)
    other.init(NODES)
    with serve_agent(other.root, node="spark2") as (port, recorder, _, _):
        client = AgentClient("spark2", f"127.0.0.1:{port}", coordinator_tls(store))
        try:
            with pytest.raises(AgentUnavailable) as info:
                client.status(timeout=10)
        finally:
            client.close()
    assert recorder.calls == []
    assert "presents a certificate not signed by this cluster's CA" in info.value.details


def test_an_agent_that_is_down_keeps_the_connection_error(store):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tls = coordinator_tls(store)
    assert pki.peer_certificate_problem("127.0.0.1", port, tls.ca, tls.cert, tls.key, "spark2", timeout_s=1) is None
    client = AgentClient("spark2", f"127.0.0.1:{port}", tls)
    try:
        with pytest.raises(AgentUnavailable) as info:
            client.status(timeout=3)
    finally:
        client.close()
    assert info.value.code == "UNAVAILABLE" and "Connection refused" in info.value.details


def test_peer_certificate_problem_is_none_for_the_right_node(store):
    tls = coordinator_tls(store)
    with serve_agent(store.root, node="spark2") as (port, _, _, _):
        assert pki.peer_certificate_problem("127.0.0.1", port, tls.ca, tls.cert, tls.key, "spark2") is None
        assert "not for spark3" in pki.peer_certificate_problem("127.0.0.1", port, tls.ca, tls.cert, tls.key,
                                                                "spark3")


def cfg_for(tmp_path, **changes):
    return config.parse(edited(SEED_TEXT, PKI_DIR=str(tmp_path / "pki"), **changes), "cluster.env", HOME)


def test_load_tls_reads_a_valid_set(tmp_path):
    store = pki.PkiStore(str(tmp_path / "pki"), group=None)
    store.init([("spark1", "10.0.0.1")])
    tls = load_tls(cfg_for(tmp_path))
    assert tls.cert == read(store.path("coordinator", "crt"))
    assert load_tls(cfg_for(tmp_path, INSECURE_NO_TLS="1")) is None


def test_load_tls_refuses_a_key_others_can_read(tmp_path):
    store = pki.PkiStore(str(tmp_path / "pki"), group=None)
    store.init([("spark1", "10.0.0.1")])
    os.chmod(store.path("coordinator", "key"), 0o640)
    with pytest.raises(PermissionError, match="mode 0640 lets group or other read the coordinator's key; run "
                                              "`chmod 600"):
        load_tls(cfg_for(tmp_path))


def test_load_tls_refuses_a_node_certificate_in_the_coordinators_place(tmp_path):
    store = pki.PkiStore(str(tmp_path / "pki"), group=None)
    store.init([("spark1", "10.0.0.1")])
    for suffix in ("crt", "key"):
        os.replace(store.path("nodes/spark1", suffix), store.path("coordinator", suffix))
    with pytest.raises(OSError, match="unusable coordinator certificate: the certificate names spark1, 10.0.0.1, "
                                      "not dsv41-coordinator"):
        load_tls(cfg_for(tmp_path))


def test_load_tls_says_to_run_pki_init_when_files_are_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="dsv41ctl pki init"):
        load_tls(cfg_for(tmp_path))
