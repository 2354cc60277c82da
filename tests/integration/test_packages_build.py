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

from tests.debs import debs_module

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
