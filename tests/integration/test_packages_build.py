"""`make debs` is reproducible and lintian-clean: two builds of one commit give identical .deb
files, and lintian reports no error and no warning that packaging/LINTIAN.md does not explain.

Builds with the distribution's debhelper, dh-python and lintian (tools/install-test-deps.sh);
needs no root and no booted node.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.debs import debs_module

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"dsv41-adapter", "dsv41-agent", "dsv41-coordinator", "dsv41-sim"}


@pytest.fixture(scope="module")
def commit() -> str:
    """Pinned: others may commit between two builds of this test."""
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def _build(out: Path, commit: str, suffix: str = "") -> dict[str, str]:
    debs = debs_module()
    try:
        made = debs.build(REPO, out, suffix, source=commit, log=sys.stderr)
    except debs.BuildError as e:
        pytest.fail(str(e), pytrace=False)
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in made}


def test_two_builds_of_one_commit_are_identical(tmp_path: Path, commit: str) -> None:
    first = _build(tmp_path / "a", commit)
    second = _build(tmp_path / "b", commit)
    version = debs_module().read_version((REPO / "dsv41" / "version.py").read_text())
    assert set(first) == {f"{p}_{version}_all.deb" for p in PACKAGES}
    assert first == second


def test_version_suffix_makes_a_higher_version(tmp_path: Path, commit: str) -> None:
    made = _build(tmp_path, commit, "+1")
    version = debs_module().read_version((REPO / "dsv41" / "version.py").read_text())
    assert set(made) == {f"{p}_{version}+1_all.deb" for p in PACKAGES}
    deb = tmp_path / f"dsv41-agent_{version}+1_all.deb"
    control = subprocess.run(["dpkg-deb", "-f", str(deb), "Version", "Depends"], capture_output=True,
                             text=True, check=True).stdout
    assert f"Version: {version}+1" in control
    assert f"dsv41-adapter (= {version}+1)" in control


def test_lintian_reports_no_errors_and_only_explained_warnings(tmp_path: Path, commit: str) -> None:
    _build(tmp_path, commit)
    code, text = debs_module().run_lintian(tmp_path)
    errors = [line for line in text.splitlines() if line.startswith("E:")]
    assert code == 0 and not errors, text
    explained = (REPO / "packaging" / "LINTIAN.md").read_text()
    for line in text.splitlines():
        match = re.match(r"W: (\S+?): (\S+)", line)
        if match:
            assert f"`{match.group(2)}`" in explained, f"not explained in packaging/LINTIAN.md: {line}"


def test_files_are_where_debian_13_wants_them(tmp_path: Path, commit: str) -> None:
    """Nothing under the aliased /lib, /bin or /sbin (trixie's lintian: aliased-location errors); the
    units in /usr/lib/systemd/system; the Grafana dashboard under /usr/share/dsv41."""
    _build(tmp_path, commit)
    listing = {}
    for deb in tmp_path.glob("*.deb"):
        out = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True, check=True).stdout
        listing[deb.name.split("_")[0]] = [line.split()[-1].removeprefix(".") for line in out.splitlines()]
    aliased = [f"{p}: {f}" for p, files in listing.items() for f in files if f.startswith(("/lib", "/bin", "/sbin"))]
    assert not aliased, aliased
    assert "/usr/lib/systemd/system/dsv41-agent.service" in listing["dsv41-agent"]
    assert "/usr/lib/systemd/system/dsv41-coordinator.service" in listing["dsv41-coordinator"]
    assert "/usr/share/dsv41/grafana/dsv41-cluster.json" in listing["dsv41-coordinator"]
    postinst = subprocess.run(["dpkg-deb", "--ctrl-tarfile", str(next(tmp_path.glob("dsv41-agent_*.deb")))],
                              capture_output=True, check=True).stdout
    assert b"deb-systemd-helper" in postinst  # dh_installsystemd still wrote the enable/start snippets


def test_debian_13_lintian_reports_no_errors(tmp_path: Path, commit: str) -> None:
    """tools/lintian-trixie.sh: trixie's lintian in a cached mmdebstrap tree (root only)."""
    import os
    if os.geteuid() != 0:
        pytest.skip("tools/lintian-trixie.sh needs root (mmdebstrap, systemd-nspawn)")
    _build(tmp_path, commit)
    proc = subprocess.run([str(REPO / "tools" / "lintian-trixie.sh"), str(tmp_path)], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "(Debian 13 trixie)" in proc.stdout and "lintian (trixie): 0 error(s), 0 warning(s)" in proc.stdout
