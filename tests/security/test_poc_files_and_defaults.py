"""Findings 3 and 6, what needs no node: `pki bundle -o PATH` followed a symbolic link planted at
PATH and kept an existing file's owner; leaf certificates lived 730 days and `pki rotate` re-pinned
nothing; ALLOWED_IMAGES accepted mutable tags; the export defaults were the recipe's
no_root_squash,insecure; INSECURE_NO_TLS=1 listened on every address; the coordinator unit had an
exposure of 5.5 in `systemd-analyze security`."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes

from agent import auth, settings
from coordinator import config, ctl, pki, plan
from tests.configtext import HOME, REPO, SEED_TEXT, edited

pytestmark = pytest.mark.unit


def run(*argv):
    out, err = io.StringIO(), io.StringIO()
    return ctl.main(list(argv), out, err), out.getvalue(), err.getvalue()


@pytest.fixture
def pki_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", "/home/op")
    cfg = tmp_path / "cluster.env"
    cfg.write_text(edited(SEED_TEXT, PKI_DIR=str(tmp_path / "pki")))
    assert run("pki", "init", "--config", str(cfg))[0] == 0
    return str(cfg), tmp_path


def test_bundle_output_replaces_a_planted_link_and_never_writes_through_it(pki_dir):
    cfg, tmp = pki_dir
    victim = tmp / "victim"
    victim.write_text("keep me\n")
    out = tmp / "spark2.tar"
    out.symlink_to(victim)
    code, _, err = run("pki", "bundle", "spark2", "--config", cfg, "-o", str(out))
    assert code == 0, err
    assert victim.read_text() == "keep me\n"  # the link's target is untouched
    assert not out.is_symlink() and tarfile.is_tarfile(out)
    assert os.stat(out).st_mode & 0o777 == 0o600 and os.stat(out).st_uid == os.geteuid()


def test_bundle_output_over_an_existing_file_is_a_new_file_of_ours(pki_dir):
    cfg, tmp = pki_dir
    out = tmp / "spark2.tar"
    out.write_text("someone else's\n")
    out.chmod(0o644)
    if os.geteuid() == 0:
        os.chown(out, 65534, 65534)  # a file another user made for us to fill
    inode = os.stat(out).st_ino
    assert run("pki", "bundle", "spark2", "--config", cfg, "-o", str(out))[0] == 0
    st = os.stat(out)
    assert st.st_ino != inode and st.st_mode & 0o777 == 0o600 and st.st_uid == os.geteuid()


def test_leaves_are_short_lived_and_rotation_re_pins_the_coordinator(pki_dir):
    cfg, tmp = pki_dir
    store = pki.PkiStore(str(tmp / "pki"), group=None)
    cert = store.load_cert("coordinator")
    lifetime = pki.not_after_of(cert) - cert.not_valid_before.replace(tzinfo=pki.not_after_of(cert).tzinfo)
    assert lifetime.days <= 181
    with pytest.raises(pki.PkiError, match="--days 730: must be 1..397"):
        pki.leaf_validity(pki.not_after_of(cert), 730, pki.not_after_of(cert))

    def pinned() -> frozenset[str]:
        with tarfile.open(fileobj=io.BytesIO(store.bundle_tar("spark2"))) as tar:
            return auth.parse_pins(tar.extractfile("etc/dsv41/tls/coordinator.pin").read().decode())

    before = pinned()
    assert before == {cert.fingerprint(hashes.SHA256()).hex()}
    code, out, _ = run("pki", "rotate", "--config", cfg, "--node", "dsv41-coordinator")
    assert code == 0 and "an agent with a new bundle refuses the old one" in out
    after = pinned()
    assert after != before and after == {store.load_cert("coordinator").fingerprint(hashes.SHA256()).hex()}
    # the old certificate, presented to an agent with the new pin, is refused by name
    pem = x509.load_pem_x509_certificate(pki.cert_pem(cert)).public_bytes(pki.serialization.Encoding.PEM)
    context = {"transport_security_type": [b"ssl"], "x509_subject_alternative_name": [b"dsv41-coordinator"],
               "x509_pem_cert": [pem]}
    assert auth.caller_problem(context, "dsv41-coordinator", before) is None
    assert "is not the one this node's bundle pins" in auth.caller_problem(context, "dsv41-coordinator", after)


def test_images_are_allowed_by_digest_only():
    base = "NODE_NAME=a\nINSECURE_NO_TLS=1\n"
    for tag in ("lmsysorg/sglang:dev-dsv41", "dsv41-3x-spark:local", "sglang"):
        with pytest.raises(settings.SettingsError, match="is not an image pinned by digest"):
            settings.parse(base + f"ALLOWED_IMAGES={tag}\n", "agent.env", {})
    digest = "lmsysorg/sglang:dev-dsv41@sha256:" + "3d" * 32
    local = "sha256:" + "ab" * 32
    s = settings.parse(base + f"ALLOWED_IMAGES={digest},{local}\n", "agent.env", {})
    assert s.allowed_images == (digest, local)
    cfg = config.parse(SEED_TEXT, "cluster.env", HOME)  # IMAGE=dsv41-3x-spark:local loads, with the fix
    assert any(w.startswith("IMAGE=dsv41-3x-spark:local is a tag: agents run images by digest only")
               for w in cfg.warnings)


def test_the_export_squashes_root_and_wants_reserved_ports_unless_asked_otherwise():
    cfg = config.parse(edited(SEED_TEXT), "cluster.env", HOME)
    export = plan.render_node(cfg, "spark1").export
    assert export.options == "ro,sync,no_subtree_check,root_squash,secure,fsid=0"
    recipe = "ro,sync,no_subtree_check,no_root_squash,insecure,fsid=0"
    cfg = config.parse(edited(SEED_TEXT, NFS_EXPORT_OPTIONS=recipe), "cluster.env", HOME)
    assert plan.render_node(cfg, "spark1").export.options == recipe
    with pytest.raises(config.ConfigInvalid, match="must include ro and not rw"):
        config.parse(edited(SEED_TEXT, NFS_EXPORT_OPTIONS="rw,sync"), "cluster.env", HOME)
    for worker in plan.render_cluster(config.parse(SEED_TEXT, "cluster.env", HOME))[1:]:
        assert {"nosuid", "nodev", "ro"} <= set(worker.mount.options.split(","))


def test_insecure_mode_listens_on_loopback_unless_listen_is_set():
    assert settings.parse("NODE_NAME=a\nINSECURE_NO_TLS=1\n", "agent.env", {}).listen == "127.0.0.1:7441"
    given = settings.parse("NODE_NAME=a\nINSECURE_NO_TLS=1\nLISTEN=10.0.0.2:7441\n", "agent.env", {})
    assert given.listen == "10.0.0.2:7441"
    tls = "NODE_NAME=a\nTLS_CA=/etc/dsv41/tls/ca.crt\nTLS_CERT=/etc/dsv41/tls/node.crt\nTLS_KEY=/etc/dsv41/tls/node.key\n"
    with_tls = settings.parse(tls, "agent.env", {})
    assert with_tls.listen == "0.0.0.0:7441" and with_tls.tls_pin == "/etc/dsv41/tls/coordinator.pin"


def test_the_coordinator_unit_is_sandboxed_to_an_exposure_of_at_most_4(tmp_path):
    unit = tmp_path / "dsv41-coordinator.service"
    unit.write_text((REPO / "units" / "dsv41-coordinator.service").read_text())
    done = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(unit)], capture_output=True,
                          text=True, timeout=60)
    line = [ln for ln in done.stdout.splitlines() if "Overall exposure level" in ln]
    assert line, done.stdout + done.stderr
    exposure = float(line[0].split(":")[1].split()[0])
    assert exposure <= 4.0, line[0]


CAPABILITIES = {14: "CAP_IPC_LOCK", 23: "CAP_SYS_NICE"}


def unit_text(props) -> str:
    """A unit file with the sandboxing properties the agent sends systemd over D-Bus."""
    lines = ["[Service]", "ExecStart=/bin/true"]
    for name, signature, value in props:
        if signature == "b":
            text = "yes" if value else "no"
        elif name == "CapabilityBoundingSet":
            text = " ".join(CAPABILITIES[b] for b in sorted(CAPABILITIES) if value & (1 << b))
            assert value == sum(1 << b for b in CAPABILITIES if value & (1 << b)), "a capability without a name"
        elif name == "RestrictNamespaces":
            assert value == 0
            text = "yes"
        elif signature == "(bas)":
            allow, items = value
            text = ("" if allow else "~") + " ".join(items)
        elif name == "SystemCallErrorNumber":
            assert value == 1
            text = "EPERM"
        elif name == "UMask":
            text = f"{value:04o}"
        elif signature == "as":
            text = " ".join(value)
        else:
            text = str(value)
        lines.append(f"{name}={text}")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("name, at_most", [("rank", 4.0), ("pack", 2.5)])
def test_the_rank_and_pack_units_are_sandboxed(tmp_path, name, at_most):
    from agent import rankspec, rpc_pack
    props = rankspec.SANDBOX if name == "rank" else rpc_pack.PACK_SANDBOX
    unit = tmp_path / f"dsv41-{name}.service"
    unit.write_text(unit_text(props))
    done = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(unit)], capture_output=True,
                          text=True, timeout=60)
    line = [ln for ln in done.stdout.splitlines() if "Overall exposure level" in ln]
    assert line, done.stdout + done.stderr
    assert float(line[0].split(":")[1].split()[0]) <= at_most, line[0]
