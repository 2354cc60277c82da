"""dsv41ctl pki init/rotate/bundle/list, and the expiry warning `dsv41ctl status` shows."""

from __future__ import annotations

import io
import os
import stat
import tarfile
import time

import pytest

from coordinator import ctl, ctl_pki
from tests.configtext import SEED_TEXT, edited

pytestmark = pytest.mark.unit


def run(*argv, out=None):
    out = out or io.StringIO()
    err = io.StringIO()
    code = ctl.main(list(argv), out, err)
    return code, out.getvalue() if isinstance(out, io.StringIO) else "", err.getvalue()


class BinaryOut(io.TextIOWrapper):
    """Standard output redirected to a file: a text stream with a binary buffer."""

    def isatty(self) -> bool:
        return False


@pytest.fixture
def setup(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", "/home/op")
    config = tmp_path / "cluster.env"
    config.write_text(edited(SEED_TEXT, PKI_DIR=str(tmp_path / "pki")))
    return str(config), tmp_path / "pki"


def test_init_reports_every_file_with_its_mode_and_how_to_install(setup):
    config, directory = setup
    code, out, err = run("pki", "init", "--config", config)
    assert code == 0, err
    assert f"  0600  {directory}/ca.key" in out and f"  0640  {directory}/nodes/spark3.crt" in out
    assert "dsv41ctl pki bundle spark2 -o spark2.tar" in out and "tar -xpf spark2.tar -C /" in out
    code, out, err = run("pki", "init", "--config", config)
    assert code == 1 and "already exists" in err and out == ""


def test_dir_overrides_the_configs_pki_dir(setup, tmp_path):
    config, directory = setup
    code, _, err = run("pki", "init", "--config", config, "--dir", str(tmp_path / "elsewhere"), "--days", "5")
    assert code == 0, err
    assert (tmp_path / "elsewhere" / "ca.crt").exists() and not directory.exists()


def test_an_invalid_config_is_exit_3_with_its_errors(setup, tmp_path):
    bad = tmp_path / "bad.env"
    bad.write_text(edited(SEED_TEXT, TP_SIZE="4"))
    code, _, err = run("pki", "init", "--config", str(bad))
    assert code == 3 and "TP_SIZE=4" in err


def test_bundle_to_a_file_is_0600_and_holds_the_nodes_key(setup, tmp_path):
    config, directory = setup
    run("pki", "init", "--config", config)
    target = tmp_path / "spark2.tar"
    old = os.umask(0o022)
    try:
        code, out, err = run("pki", "bundle", "spark2", "--config", config, "-o", str(target))
    finally:
        os.umask(old)
    assert code == 0 and "private key" in err and out == ""
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    with tarfile.open(target) as tar:
        key = tar.extractfile("etc/dsv41/tls/node.key").read()
    assert key == (directory / "nodes" / "spark2.key").read_bytes()


def test_bundle_to_redirected_stdout_makes_the_file_0600(setup, tmp_path):
    config, directory = setup
    run("pki", "init", "--config", config)
    target = tmp_path / "out.tar"
    raw = open(target, "wb")
    os.chmod(target, 0o644)  # what `> spark2.tar` makes with a usual umask
    stream = BinaryOut(raw, encoding="utf-8")
    code, _, err = run("pki", "bundle", "spark2", "--dir", str(directory), out=stream)
    stream.flush()
    raw.close()
    assert code == 0, err
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    with tarfile.open(target) as tar:
        assert "etc/dsv41/tls/node.crt" in tar.getnames()


def test_bundle_refuses_a_terminal(setup):
    config, directory = setup
    run("pki", "init", "--config", config)

    class Tty(io.StringIO):
        buffer = io.BytesIO()

        def isatty(self):
            return True
    code, _, err = run("pki", "bundle", "spark2", "--dir", str(directory), out=Tty())
    assert code == 1 and "terminal" in err and Tty.buffer.getvalue() == b""


def test_bundle_of_an_unknown_node_says_how_to_make_it(setup):
    config, directory = setup
    run("pki", "init", "--config", config)
    code, _, err = run("pki", "bundle", "spark9", "--config", config)
    assert code == 1 and "pki rotate --node spark9" in err


def test_rotate_one_node_then_list(setup):
    config, directory = setup
    run("pki", "init", "--config", config)
    before = (directory / "nodes" / "spark2.crt").read_bytes()
    other = (directory / "nodes" / "spark3.crt").read_bytes()
    code, out, err = run("pki", "rotate", "--config", config, "--node", "spark2")
    assert code == 0, err
    assert "nodes/spark2.crt" in out and "spark3" not in out
    assert (directory / "nodes" / "spark2.crt").read_bytes() != before
    assert (directory / "nodes" / "spark3.crt").read_bytes() == other
    code, out, err = run("pki", "list", "--dir", str(directory))
    assert code == 0 and "warning" not in out
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["ca", "dsv41-coordinator", "spark1", "spark2",
                                                                   "spark3"]


def test_list_warns_and_exits_1_when_a_certificate_expires_soon(setup):
    config, directory = setup
    run("pki", "init", "--config", config)
    run("pki", "rotate", "--config", config, "--node", "spark3", "--days", "10")
    code, out, _ = run("pki", "list", "--dir", str(directory))
    assert code == 1
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "spark3: certificate expires in 9 days" in warnings[0]
    assert "dsv41ctl pki rotate --node spark3" in warnings[0]


def test_list_without_certificates(tmp_path):
    code, _, err = run("pki", "list", "--dir", str(tmp_path))
    assert code == 1 and "pki init" in err


@pytest.mark.parametrize("left_days, expected", [
    (60, None),
    (43, None),
    (41, "spark2: certificate expires in 41 days (2030-02-11)"),
    (0.5, "spark2: certificate expires in 0 days"),
    (-1, "spark2: certificate EXPIRED on 2029-12-31"),
])
def test_expiry_warning(left_days, expected):
    now = 1893456000.0  # 2030-01-01
    warning = ctl_pki.expiry_warning("spark2", now + left_days * 86400, now)
    if expected is None:
        assert warning is None
    else:
        assert warning.startswith(expected) and "pki rotate --node spark2" in warning


def test_expiry_warning_is_silent_when_the_agent_reports_no_certificate():
    assert ctl_pki.expiry_warning("spark2", 0, time.time()) is None


def test_pki_commands_do_not_import_the_certificate_code_for_other_commands():
    import subprocess
    import sys
    code = ("import sys; from coordinator import ctl; ctl._parser(); "
            "print(any(m.startswith('cryptography') or m == 'coordinator.pki' for m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert r.stdout.strip() == "False", r.stderr


def test_the_parsers_default_validity_is_the_stores():
    from coordinator import pki
    assert ctl_pki.DEFAULT_DAYS == pki.DEFAULT_LEAF_DAYS
