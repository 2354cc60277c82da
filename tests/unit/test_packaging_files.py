"""The files the packages install, checked against the code they describe or start: the
launchers, the default /etc/dsv41/*.env, the man pages, and the build driver's pure parts."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agent import settings as agent_settings
from coordinator import config as cluster_config
from coordinator import schema as cluster_schema
from dsv41.version import VERSION
from testbed.debs import debs_module

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
BIN = REPO / "packaging" / "bin"
ETC = REPO / "packaging" / "etc"
MAN = REPO / "packaging" / "man"
SEED = REPO / "tests" / "cluster.env.example"


def _launcher(tmp_path: Path, name: str, private: Path, rank: Path | None = None) -> Path:
    """The launcher with its installed paths pointed at directories of this machine."""
    text = (BIN / name).read_text()
    text = re.sub(r'sys\.path\.insert\(0, ".+?"\)', f"sys.path.insert(0, {str(private)!r})", text)
    if rank is not None:
        text = text.replace('sys.path.append("/usr/share/dsv41/rank")', f"sys.path.append({str(rank)!r})")
    path = tmp_path / name
    path.write_text(text)
    path.chmod(0o755)
    return path


def _run(path: Path, *args: str) -> subprocess.CompletedProcess:
    # Through the #! line, as the units and operators run them (with its -I and -B flags).
    return subprocess.run([str(path), *args], capture_output=True, text=True, timeout=60, cwd="/")


# ----- launchers -----

def test_launcher_interpreter_and_flags() -> None:
    for path in BIN.iterdir():
        text = path.read_text()
        interpreter, *options = text.splitlines()[0].removeprefix("#!").split()
        flags = "".join(options).lstrip("-")
        assert interpreter == "/usr/bin/python3", path.name
        assert path.stat().st_mode & 0o111, f"{path.name}: not executable"
        # -I: nothing from PYTHONPATH or the user's site; but the stand-in honours PYTHONPATH like a rank.
        assert ("I" in flags) == (path.name != "dsv41-sim-rank"), path.name
        # -B: no __pycache__ in the adapter's directory, for everything that imports from it.
        loads_adapter = "/usr/share/dsv41/rank" in text or path.name == "dsv41-sim-rank"
        assert ("B" in flags) == loads_adapter, path.name


def test_launcher_runs_the_module_as_python_m_does(tmp_path: Path) -> None:
    ctl = _launcher(tmp_path, "dsv41ctl", REPO)
    r = _run(ctl, "config", "keys")
    assert r.returncode == 0, r.stderr
    assert "HEAD_IP" in r.stdout
    agent = _launcher(tmp_path, "dsv41-agent", REPO, rank=REPO)
    r = _run(agent, "--version")
    assert (r.returncode, r.stdout.strip()) == (0, VERSION), r.stderr
    pack = _launcher(tmp_path, "dsv41-pack", REPO, rank=REPO)
    r = _run(pack, "--help")
    assert r.returncode == 0 and "--tp" in r.stdout, r.stderr


def test_launcher_without_its_module_fails_clearly(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    for name, module in (("dsv41-coordinator", "coordinator.daemon"), ("dsv41-sim-rank", "sim.main")):
        r = _run(_launcher(tmp_path, name, empty), "--help")
        assert r.returncode == 1, (name, r.stdout, r.stderr)
        assert f"built without the Python module {module}" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_daemon_launchers_write_no_bytecode_into_the_adapter_directory(tmp_path: Path) -> None:
    rank = tmp_path / "rank"
    shutil.copytree(REPO / "adapter", rank / "adapter", ignore=shutil.ignore_patterns("__pycache__"))
    r = _run(_launcher(tmp_path, "dsv41-pack", REPO, rank=rank), "--help")
    assert r.returncode == 0, r.stderr
    assert not list(rank.rglob("__pycache__"))


# ----- /etc/dsv41 -----

def _uncommented_defaults(text: str) -> str:
    return "\n".join(line[1:] for line in text.splitlines() if re.match(r"#[A-Z_]+=", line))


def test_agent_env_documents_every_key_with_its_default() -> None:
    shipped = (ETC / "agent.env").read_text()
    documented = re.findall(r"^#([A-Z_]+)=", shipped, re.MULTILINE)
    assert sorted(documented) == sorted(agent_settings._KEYS)
    # Uncommenting every other line changes nothing: the values shown are the defaults.
    required = "NODE_NAME=spark1\nINSECURE_NO_TLS=1\n"
    defaults = "\n".join(line for line in _uncommented_defaults(shipped).splitlines()
                         if not line.startswith(("NODE_NAME=", "INSECURE_NO_TLS=")))
    assert len(defaults.splitlines()) == len(agent_settings._KEYS) - 2
    as_shipped = agent_settings.parse(defaults + "\n" + required, "agent.env", {})
    assert as_shipped == agent_settings.parse(required, "agent.env", {})
    assert "#INSECURE_NO_TLS=0" in shipped.splitlines()


def test_agent_env_as_shipped_is_refused_clearly() -> None:
    with pytest.raises(agent_settings.SettingsError) as e:
        agent_settings.parse((ETC / "agent.env").read_text(), "/etc/dsv41/agent.env", {})
    assert "NODE_NAME" in str(e.value) and "TLS_CA/TLS_CERT/TLS_KEY" in str(e.value)


def test_cluster_env_is_the_recipe_example_with_a_comment_header_and_trailer() -> None:
    shipped = (ETC / "cluster.env").read_text()
    seed = SEED.read_text()
    header, found, trailer = shipped.partition(seed)
    assert found and "MUST BE EDITED" in header
    assert all(line.startswith("#") or not line.strip() for line in (header + trailer).splitlines())
    cfg = cluster_config.parse(shipped, "/etc/dsv41/cluster.env", {"HOME": "/home/spark"})
    assert [n.name for n in cfg.nodes] == ["spark1", "spark2", "spark3"]
    # The trailer documents keys beyond the recipe's, each with its default.
    documented = dict(re.findall(r"^#([A-Z_]+)=(.*)$", trailer, re.MULTILINE))
    assert set(documented) >= {"METRICS_LISTEN", "METRICS_POLL_S", "INCIDENT_HOOK", "INCIDENT_HOOK_TIMEOUT_S"}
    assert {k: cluster_schema.BY_NAME[k].default for k in documented} == documented


def test_cluster_env_ends_with_a_newline_so_an_appended_key_is_its_own_line() -> None:
    shipped = (ETC / "cluster.env").read_text()
    assert shipped.endswith("\n")
    last_key = [line for line in shipped.splitlines() if line and not line.startswith("#")][-1]
    key, _, value = last_key.partition("=")
    with open(ETC / "cluster.env") as f:
        appended = f.read() + "METRICS_POLL_S=7\n"  # what `echo KEY=VALUE >> cluster.env` does
    cfg = cluster_config.parse(appended, "/etc/dsv41/cluster.env", {"HOME": "/home/spark"})
    assert cfg.raw[key] == value and cfg.number("METRICS_POLL_S") == 7.0


# ----- man pages -----

def _man_text(name: str) -> str:
    """The page's text with roff escapes for - removed, as a reader would search it."""
    return (MAN / name).read_text().replace("\\-", "-").replace("\\fI", "").replace("\\fP", "")


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings if o.startswith("--")} - {"--help"}


def _subcommands(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out[f"{prefix}{name}"] = sub
                out.update(_subcommands(sub, f"{prefix}{name} "))
    return out


def test_man_pages_exist_for_every_command_and_render_without_warnings() -> None:
    pages = {p.name.rsplit(".", 1)[0]: p for p in MAN.iterdir()}
    assert set(pages) == {p.name for p in BIN.iterdir()}
    for name, page in pages.items():
        assert re.match(rf'\.TH {re.escape(name.upper())} {page.suffix[1:]} ', page.read_text()), page.name
    if shutil.which("man") is None:
        pytest.skip("man-db is not installed")
    for page in pages.values():
        r = subprocess.run(["man", "--warnings", "-E", "UTF-8", "-l", "-Tutf8", "-Z", str(page)],
                           capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8",
                                                                "MANROFFSEQ": "", "MANWIDTH": "80"})
        assert r.returncode == 0 and not r.stderr.strip(), (page.name, r.stderr)


def test_dsv41ctl_man_page_covers_every_command_and_option() -> None:
    from coordinator import ctl
    text = _man_text("dsv41ctl.8")
    missing = []
    for command, sub in _subcommands(ctl._parser()).items():
        if command not in text:
            missing.append(command)
        missing += [f"{command} {o}" for o in _options(sub) if o not in text]
    assert not missing, f"not in packaging/man/dsv41ctl.8: {missing}"


def test_pack_man_page_covers_every_option() -> None:
    from agent.pack.__main__ import build_parser
    text = _man_text("dsv41-pack.8")
    assert not [o for o in _options(build_parser()) if o not in text]


@pytest.mark.parametrize("page, module", [("dsv41-agent.8", "agent"), ("dsv41-coordinator.8", "coordinator.daemon")])
def test_daemon_man_pages_cover_every_option(page: str, module: str) -> None:
    r = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    options = set(re.findall(r"(--[a-z][a-z-]*)", r.stdout)) - {"--help"}
    assert options, r.stdout
    text = _man_text(page)
    assert not [o for o in options if o not in text]


# ----- the build driver's pure parts -----

def test_version_comes_from_dsv41_version_py() -> None:
    debs = debs_module()
    assert debs.read_version((REPO / "dsv41" / "version.py").read_text()) == VERSION
    assert debs.debian_version(VERSION) == VERSION
    assert debs.debian_version(VERSION, "+1") == f"{VERSION}+1"
    with pytest.raises(debs.BuildError):
        debs.read_version("VERSION = 1\n")


def test_the_packaged_version_py_names_the_package_version_suffix_included() -> None:
    debs = debs_module()
    text = (REPO / "dsv41" / "version.py").read_text()
    stamped = debs.stamp_version(text, f"{VERSION}+1")
    assert debs.read_version(stamped) == f"{VERSION}+1"
    assert stamped.replace(f"{VERSION}+1", VERSION) == text  # nothing else changed
    assert debs.stamp_version(text, VERSION) == text
    with pytest.raises(debs.BuildError, match="VERSION"):
        debs.stamp_version("VERSION = 1\n", "0.1.0")


@pytest.mark.parametrize("suffix", ["1", "+1 ", "-1", "+1/2", "+ä"])
def test_bad_version_suffixes_are_refused(suffix: str) -> None:
    debs = debs_module()
    with pytest.raises(debs.BuildError, match="suffix"):
        debs.debian_version("0.1.0", suffix)


@pytest.mark.skipif(shutil.which("dpkg") is None, reason="dpkg is not installed")
@pytest.mark.parametrize("suffix, relation", [("+1", "gt"), ("+2", "gt"), ("~rc1", "lt")])
def test_suffixes_order_as_dpkg_compares_them(suffix: str, relation: str) -> None:
    version = debs_module().debian_version(VERSION, suffix)
    assert subprocess.run(["dpkg", "--compare-versions", version, relation, VERSION]).returncode == 0


@pytest.mark.skipif(shutil.which("dpkg-parsechangelog") is None, reason="dpkg-dev is not installed")
def test_changelog_parses_and_carries_the_commit_date(tmp_path: Path) -> None:
    debs = debs_module()
    who = debs.maintainer((REPO / "packaging" / "debian" / "control").read_text())
    path = tmp_path / "changelog"
    path.write_text(debs.changelog(f"{VERSION}+1", who, 1_790_000_000, "ab" * 20, modified=True))
    fields = subprocess.run(["dpkg-parsechangelog", "-l", str(path)], capture_output=True, text=True,
                            check=True).stdout
    assert f"Version: {VERSION}+1\n" in fields
    assert "Timestamp: 1790000000\n" in fields
    assert f"Maintainer: {who}\n" in fields
    assert "uncommitted changes" in fields


def test_build_environment_is_fixed() -> None:
    env = debs_module().build_environment(1_790_000_000, "/nonexistent")
    assert env["PATH"] == "/usr/sbin:/usr/bin:/sbin:/bin"  # never a pyenv or venv python3
    assert env["SOURCE_DATE_EPOCH"] == "1790000000"
    assert env["TZ"] == "UTC" and env["LC_ALL"] == "C.UTF-8"


def test_lintian_counts() -> None:
    text = "E: p: tag-a x\nW: p: tag-b\nW: q: tag-c [f]\nI: p: tag-d\nN: note\nrunning with root\n"
    assert debs_module().lintian_counts(text) == {"E": 1, "W": 2, "I": 1, "N": 1}


def test_adapter_plugin_metadata_carries_the_project_version() -> None:
    metadata = REPO / "adapter" / "dsv41_adapter.dist-info" / "METADATA"
    if not metadata.exists():
        pytest.skip("adapter/dsv41_adapter.dist-info is not in this tree")
    assert f"Version: {VERSION}\n" in metadata.read_text()
