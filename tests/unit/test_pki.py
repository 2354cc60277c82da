"""The cluster CA and certificates (coordinator/pki.py): what is issued, the files and their modes,
init/rotate/bundle, and the agent.env lines a bundle carries."""

from __future__ import annotations

import datetime as dt
import io
import os
import stat
import tarfile

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from agent import auth as agent_auth
from agent import settings as agent_settings
from coordinator import pki

pytestmark = pytest.mark.unit

NODES = [("spark1", "10.0.0.1"), ("spark2", "10.0.0.2"), ("spark3", "10.0.0.3")]
NOW = dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc)


@pytest.fixture
def store(tmp_path):
    return pki.PkiStore(str(tmp_path / "pki"), group=None, now=lambda: NOW)


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def cert(store, stem) -> x509.Certificate:
    return x509.load_pem_x509_certificate(read(store.path(stem, "crt")))


def usage(c: x509.Certificate) -> list:
    return list(c.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def test_init_writes_every_file_with_its_mode_and_nothing_else(store):
    written = store.init(NODES)
    expected = {"ca.key": 0o600, "ca.crt": 0o640, "coordinator.key": 0o600, "coordinator.crt": 0o640}
    for name, _ in NODES:
        expected[f"nodes/{name}.key"] = 0o600
        expected[f"nodes/{name}.crt"] = 0o640
    assert sorted(os.path.relpath(p, store.root) for p in written) == sorted(expected)
    found = {}
    for directory, dirs, files in os.walk(store.root):
        for d in dirs:
            assert stat.S_IMODE(os.stat(os.path.join(directory, d)).st_mode) == 0o750, d
        for f in files:
            path = os.path.join(directory, f)
            found[os.path.relpath(path, store.root)] = stat.S_IMODE(os.stat(path).st_mode)
            assert os.stat(path).st_uid == os.geteuid()
    assert found == expected
    assert stat.S_IMODE(os.stat(store.root).st_mode) == 0o750


def test_modes_do_not_depend_on_the_umask(store):
    old = os.umask(0o000)
    try:
        store.init(NODES)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(store.path("ca", "key")).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(store.path("nodes/spark2", "crt")).st_mode) == 0o640


def test_certificates_name_their_node_and_are_signed_by_the_ca(store):
    store.init(NODES, days=30)
    ca = cert(store, "ca")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for name, address in NODES:
        c = cert(store, f"nodes/{name}")
        assert c.issuer == ca.subject
        assert c.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == name
        assert pki.names_of(c) == [name, address]
        assert usage(c) == [ExtendedKeyUsageOID.SERVER_AUTH]  # cannot act as a client
        assert not c.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        assert pki.not_after_of(c) == NOW + dt.timedelta(days=30)
        pki.check_leaf(read(store.path("ca", "crt")), read(store.path(f"nodes/{name}", "crt")),
                       read(store.path(f"nodes/{name}", "key")), name, now=NOW)
    coordinator = cert(store, "coordinator")
    assert pki.names_of(coordinator) == ["dsv41-coordinator"]
    assert usage(coordinator) == [ExtendedKeyUsageOID.CLIENT_AUTH]


def test_check_leaf_refuses_a_wrong_name_a_foreign_key_and_an_expired_certificate(store):
    store.init(NODES)
    ca, crt2, key2, key3 = (read(store.path(*p)) for p in
                            (("ca", "crt"), ("nodes/spark2", "crt"), ("nodes/spark2", "key"), ("nodes/spark3", "key")))
    with pytest.raises(pki.PkiError, match="names spark2, 10.0.0.2, not spark3"):
        pki.check_leaf(ca, crt2, key2, "spark3", now=NOW)
    with pytest.raises(pki.PkiError, match="does not belong"):
        pki.check_leaf(ca, crt2, key3, "spark2", now=NOW)
    with pytest.raises(pki.PkiError, match="expired on"):
        pki.check_leaf(ca, crt2, key2, "spark2", now=NOW + dt.timedelta(days=800))


def test_init_never_replaces_a_ca_without_force(store):
    store.init(NODES)
    before = read(store.path("ca", "crt"))
    with pytest.raises(pki.PkiError, match="already exists.*pki rotate.*--force"):
        store.init(NODES)
    assert read(store.path("ca", "crt")) == before
    store.init(NODES, force=True)
    assert read(store.path("ca", "crt")) != before


def test_a_certificate_from_a_replaced_ca_no_longer_verifies(store):
    store.init(NODES)
    old = read(store.path("nodes/spark2", "crt")), read(store.path("nodes/spark2", "key"))
    store.init(NODES, force=True)
    with pytest.raises(pki.PkiError, match="not signed by the cluster CA"):
        pki.check_leaf(read(store.path("ca", "crt")), *old, "spark2", now=NOW)


def test_rotate_one_node_keeps_the_ca_and_the_others(store):
    store.init(NODES)
    ca, spark3 = read(store.path("ca", "crt")), read(store.path("nodes/spark3", "crt"))
    old = cert(store, "nodes/spark2")
    written = store.rotate(NODES, only="spark2", days=10)
    assert sorted(os.path.basename(p) for p in written) == ["spark2.crt", "spark2.key"]
    new = cert(store, "nodes/spark2")
    assert new.serial_number != old.serial_number and new.public_key() != old.public_key()
    assert pki.not_after_of(new) == NOW + dt.timedelta(days=10)
    assert read(store.path("ca", "crt")) == ca and read(store.path("nodes/spark3", "crt")) == spark3
    pki.check_leaf(ca, read(store.path("nodes/spark2", "crt")), read(store.path("nodes/spark2", "key")), "spark2",
                   now=NOW)


def test_rotate_everything_and_a_node_added_to_the_config(store):
    store.init(NODES[:2])
    serials = {s: cert(store, s).serial_number for s in ("coordinator", "nodes/spark1", "nodes/spark2")}
    store.rotate(NODES)
    assert all(cert(store, s).serial_number != serial for s, serial in serials.items())
    assert pki.names_of(cert(store, "nodes/spark3")) == ["spark3", "10.0.0.3"]
    store.rotate(NODES, only="dsv41-coordinator")


def test_rotate_names_what_is_known_for_an_unknown_node_and_needs_a_ca(store, tmp_path):
    with pytest.raises(pki.PkiError, match="ca.key does not exist: run `dsv41ctl pki init`"):
        store.rotate(NODES)
    store.init(NODES)
    with pytest.raises(pki.PkiError, match="--node spark9: not in the cluster config; known: dsv41-coordinator, "
                                           "spark1, spark2, spark3"):
        store.rotate(NODES, only="spark9")


@pytest.mark.parametrize("nodes, message", [
    ([("dsv41-coordinator", "10.0.0.1")], "is the coordinator's identity"),
    ([("spark1", "10.0.0.1"), ("spark1", "10.0.0.2")], "appears twice"),
    ([("spark_1", "10.0.0.1")], "must be a host name"),
    ([("spark1", "10.0.0")], "is not an IP address"),
])
def test_refused_node_lists(nodes, message):
    with pytest.raises(pki.PkiError, match=message):
        pki.leaf_specs(nodes)


@pytest.mark.parametrize("days", [0, -1, 3651])
def test_days_out_of_range_write_nothing(store, days):
    with pytest.raises(pki.PkiError, match="--days"):
        store.init(NODES, days=days)
    assert not os.path.exists(store.root)


def test_leaf_validity_never_outlasts_the_ca():
    ca_end = NOW + dt.timedelta(days=5)
    start, end = pki.leaf_validity(NOW, 30, ca_end)
    assert end == ca_end and start < NOW


def test_bundle_holds_exactly_what_the_node_needs(store, tmp_path):
    store.init(NODES)
    with tarfile.open(fileobj=io.BytesIO(store.bundle_tar("spark2"))) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert sorted(members) == ["etc/dsv41/tls", "etc/dsv41/tls/agent.env", "etc/dsv41/tls/ca.crt",
                                   "etc/dsv41/tls/coordinator.pin", "etc/dsv41/tls/node.crt", "etc/dsv41/tls/node.key"]
        modes = {n: m.mode for n, m in members.items()}
        assert modes == {"etc/dsv41/tls": 0o750, "etc/dsv41/tls/agent.env": 0o640, "etc/dsv41/tls/ca.crt": 0o640,
                         "etc/dsv41/tls/coordinator.pin": 0o640, "etc/dsv41/tls/node.crt": 0o640,
                         "etc/dsv41/tls/node.key": 0o600}
        assert all(m.uid == 0 and m.gid == 0 for m in members.values())
        content = {n: tar.extractfile(m).read() for n, m in members.items() if m.isfile()}
    assert content["etc/dsv41/tls/node.key"] == read(store.path("nodes/spark2", "key"))
    assert content["etc/dsv41/tls/node.crt"] == read(store.path("nodes/spark2", "crt"))
    assert content["etc/dsv41/tls/ca.crt"] == read(store.path("ca", "crt"))
    assert b"BEGIN PRIVATE KEY" not in content["etc/dsv41/tls/ca.crt"]  # the CA key stays on the head
    # the agent.env lines are what the agent's own settings parser accepts
    s = agent_settings.parse(content["etc/dsv41/tls/agent.env"].decode(), "agent.env", {})
    assert (s.node, s.tls_ca, s.tls_cert, s.tls_key) == ("spark2", "/etc/dsv41/tls/ca.crt", "/etc/dsv41/tls/node.crt",
                                                        "/etc/dsv41/tls/node.key")
    assert s.coordinator_name == pki.COORDINATOR_NAME and not s.insecure_no_tls
    # the pin is the coordinator certificate's fingerprint, in the file the settings name
    assert s.tls_pin == "/etc/dsv41/tls/coordinator.pin"
    coordinator = x509.load_pem_x509_certificate(read(store.path("coordinator", "crt")))
    assert agent_auth.parse_pins(content["etc/dsv41/tls/coordinator.pin"].decode()) == \
        {coordinator.fingerprint(hashes.SHA256()).hex()}


def test_bundle_refuses_the_coordinator_and_unknown_nodes(store):
    store.init(NODES)
    with pytest.raises(pki.PkiError, match="coordinator's identity"):
        store.bundle_tar("dsv41-coordinator")
    with pytest.raises(pki.PkiError, match="spark9.crt does not exist: run `dsv41ctl pki rotate --node spark9`"):
        store.bundle_tar("spark9")


def test_certificates_lists_every_certificate_with_its_expiry(store):
    store.init(NODES, days=20)
    infos = {i.name: i for i in store.certificates()}
    assert sorted(infos) == ["ca", "dsv41-coordinator", "spark1", "spark2", "spark3"]
    assert infos["spark2"].names == ("spark2", "10.0.0.2")
    assert infos["spark2"].not_after_unix_s == (NOW + dt.timedelta(days=20)).timestamp()


def test_group_that_does_not_exist_falls_back_to_ours(tmp_path):
    s = pki.PkiStore(str(tmp_path / "p"), group="no-such-group-dsv41-test", now=lambda: NOW)
    s.init(NODES[:1])
    assert os.stat(s.path("ca", "crt")).st_gid == os.getegid()
