"""The packages on a real systemd: install, configure, upgrade and purge with apt, as an operator would.

One booted node (tests/harness) gets the .deb files built from this tree (`packaging/debs.py`,
what `make debs` runs), once at the tree's version and once with the suffix +1 for the upgrade.
The base root file system already holds the python3-* dependencies, so apt needs no network.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from testbed.debs import debs_module
from testbed.nspawn import Node

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("dsv41-adapter", "dsv41-agent", "dsv41-coordinator", "dsv41-sim")
APT = ["apt-get", "-y", "-q", "--no-install-recommends", "-o", "Dpkg::Options::=--force-confdef",
       "-o", "Dpkg::Options::=--force-confold"]
APT_ENV = {"DEBIAN_FRONTEND": "noninteractive"}
V1, V2 = "/var/tmp/debs-v1", "/var/tmp/debs-v2"
AGENT_ENV = """NODE_NAME={name}
LISTEN=127.0.0.1:7441
INSECURE_NO_TLS=1
ALLOWED_RUNTIMES=host
ALLOWED_EXECUTABLES=/usr/bin/dsv41-sim-rank
"""
# The real coordinator under the packaged unit, told not to bring the cluster up: what is under
# test is how the packages treat the service (group, socket, start, upgrade), not the bring-up.
COORDINATOR_DROP_IN = "/etc/systemd/system/dsv41-coordinator.service.d/test.conf"
COORDINATOR_NO_AUTOSTART = ("[Service]\nExecStart=\n"
                            "ExecStart=/usr/bin/dsv41-coordinator --config /etc/dsv41/cluster.env --no-autostart\n")
# The shipped example, edited as an operator would: addresses that refuse at once (no agents in
# this test), no TLS, and short stop budgets because no rank ever runs.
CLUSTER_EDITS = {"HEAD_IP": "127.0.0.1", "WORKER1_IP": "127.0.0.2", "WORKER2_IP": "127.0.0.3"}
CLUSTER_ADDED = "INSECURE_NO_TLS=1\nAGENT_PORT=7449\nRANK_STOP_TIMEOUT_S=5\nMEMORY_RECOVERY_TIMEOUT_S=1\n"


@pytest.fixture(scope="module")
def debs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    debs = debs_module()
    # One commit for both versions: others may commit in between.
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    out = {}
    for name, suffix in (("v1", ""), ("v2", "+1")):
        out[name] = tmp_path_factory.mktemp(f"debs-{name}")
        try:
            debs.build(REPO, out[name], suffix, source=commit, log=sys.stderr)
        except debs.BuildError as e:
            pytest.fail(str(e), pytrace=False)
    yield out


def _version() -> str:
    return debs_module().read_version((REPO / "dsv41" / "version.py").read_text())


def _sh(n: Node, script: str, check: bool = True) -> subprocess.CompletedProcess:
    return n.run(["sh", "-c", script], check=check)


def _status(n: Node, package: str) -> str:
    r = n.run(["dpkg-query", "-W", "-f=${db:Status-Abbrev}${Version}", package], check=False)
    return r.stdout.strip() if r.returncode == 0 else "unknown"


def _wait(predicate, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def _agent_messages(n: Node) -> str:
    return "\n".join(e.get("MESSAGE", "") for e in n.journal(unit="dsv41-agent.service"))


def _debs_in(directory: str, version: str) -> list[str]:
    return [f"{directory}/{p}_{version}_all.deb" for p in PACKAGES]


def test_install_configure_upgrade_purge(node, debs: dict[str, Path]) -> None:
    version = _version()
    n = node("pkgnode")
    n.copy_in(debs["v1"], V1)
    n.copy_in(debs["v2"], V2)

    # --- install: nothing configured yet ---
    n.run([*APT, "install", *_debs_in(V1, version)], env=APT_ENV, timeout=120)
    for p in PACKAGES:
        assert _status(n, p) == f"ii {version}", p
    n.run(["apt-get", "check", "-q"])
    conffiles = n.run(["dpkg-query", "-W", "-f=${Conffiles}\n", "dsv41-agent", "dsv41-coordinator"]).stdout
    assert {line.split()[0] for line in conffiles.splitlines() if line.strip()} == {
        "/etc/dsv41/agent.env", "/etc/dsv41/cluster.env"}
    modes = _sh(n, "stat -c '%n %a %U:%G' /usr/bin/dsv41-agent /usr/bin/dsv41-pack /usr/bin/dsv41ctl "
                   "/usr/bin/dsv41-coordinator /usr/bin/dsv41-sim-rank /etc/dsv41/agent.env "
                   "/etc/dsv41/cluster.env /usr/lib/systemd/system/dsv41-agent.service "
                   "/usr/lib/systemd/system/dsv41-coordinator.service /usr/lib/sysusers.d/dsv41.conf "
                   "/usr/share/dsv41/grafana/dsv41-cluster.json").stdout
    for line in modes.splitlines():
        path, mode, owner = line.split()
        assert owner == "root:root", line
        assert mode == ("755" if path.startswith("/usr/bin/") else "644"), line
    group = n.run(["getent", "group", "dsv41"]).stdout.split(":")
    assert group[0] == "dsv41" and int(group[2]) < 1000, group  # a system group
    # Private module directories, byte-compiled by py3compile; nothing in dist-packages.
    _sh(n, "test -d /usr/share/dsv41-agent/agent/__pycache__ && test -d /usr/share/dsv41-coordinator/"
           "coordinator/__pycache__ && test -f /usr/share/dsv41/rank/dsv41/engram_format.py")
    assert not _sh(n, "ls /usr/lib/python3/dist-packages | grep -E '^(agent|coordinator|adapter|dsv41|sim)$'",
                   check=False).stdout
    has_sitecustomize = (REPO / "adapter" / "sitecustomize.py").exists() and bool(
        subprocess.run(["git", "-C", str(REPO), "ls-files", "adapter/sitecustomize.py"], capture_output=True,
                       text=True).stdout.strip())
    rank_files = n.run(["ls", "/usr/share/dsv41/rank"]).stdout.split()
    assert ("sitecustomize.py" in rank_files) == has_sitecustomize, rank_files

    # The code and the generated stubs run on the distribution's Python and packages.
    assert n.run(["dsv41-agent", "--version"]).stdout.strip() == version
    assert "HEAD_IP" in n.run(["dsv41ctl", "config", "keys"]).stdout
    _sh(n, "HOME=/root dsv41ctl config check /etc/dsv41/cluster.env")  # the shipped example is valid
    assert "--rank" in n.run(["dsv41-pack", "--help"]).stdout
    assert "usage" in n.run(["dsv41-sim-rank", "--help"]).stdout.lower()
    for d in ("/usr/share/dsv41-agent", "/usr/share/dsv41-coordinator"):
        n.run(["python3", "-I", "-c", f"import sys; sys.path.insert(0, {d!r}); "
               "import dsv41.v1.agent_pb2_grpc, dsv41.v1.control_pb2_grpc"])

    # Units: the agent enabled and started (it fails at once, clearly, without a configuration);
    # the coordinator neither enabled nor started.
    assert n.run(["systemctl", "is-enabled", "dsv41-agent"], check=False).stdout.strip() == "enabled"
    assert n.run(["systemctl", "is-enabled", "dsv41-coordinator"], check=False).stdout.strip() == "disabled"
    assert n.show("dsv41-coordinator", "ActiveState")["ActiveState"] == "inactive"
    text = _wait(lambda: (t := _agent_messages(n)) and "invalid configuration" in t and t, "the agent's refusal")
    assert "NODE_NAME" in text and "TLS" in text, text
    assert n.show("dsv41-agent", "ActiveState")["ActiveState"] != "active"

    # --- configure the agent; a rank and a coordinator are running ---
    n.write_file("/etc/dsv41/agent.env", AGENT_ENV.format(name=n.name))
    n.run(["systemctl", "reset-failed", "dsv41-agent"], check=False)
    n.run(["systemctl", "restart", "dsv41-agent"])
    agent_pid = n.show("dsv41-agent", "ActiveState", "MainPID")
    assert agent_pid["ActiveState"] == "active", agent_pid
    assert n.run(["pgrep", "-x", "dsv41-agent"]).stdout.split() == [agent_pid["MainPID"]]
    n.run(["systemd-run", "--unit=dsv41-rank", "--quiet", "/bin/sleep", "infinity"])
    cluster = n.run(["cat", "/etc/dsv41/cluster.env"]).stdout
    for key, value in CLUSTER_EDITS.items():
        cluster = re.sub(rf"^{key}=.*$", f"{key}={value}", cluster, count=1, flags=re.MULTILINE)
    n.write_file("/etc/dsv41/cluster.env", "HOME=/root\n" + cluster.rstrip("\n") + "\n" + CLUSTER_ADDED)
    n.write_file(COORDINATOR_DROP_IN, COORDINATOR_NO_AUTOSTART)
    n.run(["systemctl", "daemon-reload"])
    started = n.run(["systemctl", "start", "dsv41-coordinator"], check=False)  # returns after READY=1
    assert started.returncode == 0, "\n".join(e.get("MESSAGE", "") for e in n.journal("dsv41-coordinator.service"))
    before = {u: n.show(u, "ActiveState", "MainPID") for u in ("dsv41-coordinator", "dsv41-rank")}
    assert all(s["ActiveState"] == "active" for s in before.values()), before
    socket = _sh(n, "stat -c '%F %a %U:%G' /run/dsv41/control.sock").stdout.strip()
    assert socket == "socket 660 root:dsv41", socket
    # Members of the dsv41 group reach the coordinator (exit 1: not serving); others may not (4).
    n.run(["useradd", "--groups", "dsv41", "clusterop"])
    n.run(["useradd", "passerby"])
    # Until its search for running ranks ends (the other nodes' agents do not answer here: a call
    # timeout each) the coordinator says "starting"; then "stopped" (--no-autostart).
    member = _wait(lambda: (m := n.run(["runuser", "-u", "clusterop", "--", "dsv41ctl", "status"], check=False))
                   and "CLUSTER: STARTING" not in m.stdout.upper() and m, "the search for running ranks to end", 60.0)
    assert member.returncode == 1 and "STOPPED" in member.stdout.upper(), (member.stdout, member.stderr)
    visitor = n.run(["runuser", "-u", "passerby", "--", "dsv41ctl", "status"], check=False)
    assert visitor.returncode == 4 and "dsv41 group" in visitor.stderr, (visitor.stdout, visitor.stderr)

    # --- upgrade to a rebuilt higher version ---
    upgraded = n.run([*APT, "install", *_debs_in(V2, f"{version}+1")], env=APT_ENV, timeout=120)
    for p in PACKAGES:
        assert _status(n, p) == f"ii {version}+1", (p, upgraded.stdout)
    after_agent = n.show("dsv41-agent", "ActiveState", "MainPID")
    assert after_agent["ActiveState"] == "active" and after_agent["MainPID"] != agent_pid["MainPID"], \
        (agent_pid, after_agent)  # restarted
    after = {u: n.show(u, "ActiveState", "MainPID") for u in ("dsv41-coordinator", "dsv41-rank")}
    assert after["dsv41-rank"] == before["dsv41-rank"]  # the rank was not touched
    # The running coordinator was restarted (a restart job: it left the rank alone) to run the new code.
    assert after["dsv41-coordinator"]["ActiveState"] == "active", after
    assert after["dsv41-coordinator"]["MainPID"] != before["dsv41-coordinator"]["MainPID"], (before, after)
    kept = n.journal("dsv41-coordinator.service", fields=None, matches=["DSV41_EVENT=coordinator_stopping"])
    assert kept and kept[-1]["DSV41_JOB_TYPE"] == "restart" and kept[-1]["DSV41_RANKS_KEPT"] == "yes", kept
    assert n.run(["systemctl", "is-enabled", "dsv41-coordinator"], check=False).stdout.strip() == "disabled"
    assert n.run(["cat", "/etc/dsv41/agent.env"]).stdout == AGENT_ENV.format(name=n.name)
    assert n.run(["ls", "/etc/dsv41"]).stdout.split() == ["agent.env", "cluster.env"]  # no .dpkg-* files
    _wait(lambda: f"pid {before['dsv41-rank']['MainPID']}" in _agent_messages(n), "the rank re-adopted")

    # --- purge ---
    n.run(["systemctl", "stop", "dsv41-coordinator", "dsv41-rank"], timeout=60)
    assert n.show("dsv41-coordinator", "Result")["Result"] == "success"  # exited by itself on SIGTERM
    n.run(["rm", "-r", str(Path(COORDINATOR_DROP_IN).parent)])
    n.run(["systemctl", "daemon-reload"])
    n.run([*APT, "purge", *PACKAGES], env=APT_ENV, timeout=120)
    for p in PACKAGES:
        assert _status(n, p) in ("unknown", "un "), p
    left = _sh(n, "ls -d /etc/dsv41 /var/cache/dsv41 /usr/share/dsv41 /usr/share/dsv41-* /usr/bin/dsv41* "
                  "/lib/systemd/system/dsv41* /usr/lib/systemd/system/dsv41* /etc/systemd/system/*/dsv41* "
                  "/usr/lib/sysusers.d/dsv41.conf "
                  "/var/lib/systemd/deb-systemd-helper-enabled/*dsv41* "
                  "/var/lib/systemd/deb-systemd-helper-enabled/*/dsv41* 2>/dev/null", check=False).stdout
    assert left == "", left
    units = n.run(["systemctl", "list-unit-files", "--no-legend", "dsv41*"], check=False).stdout
    assert units.strip() == "", units
    assert n.show("dsv41-agent", "LoadState")["LoadState"] == "not-found"
    assert not n.run(["pgrep", "-x", "dsv41-agent"], check=False).stdout  # comm of the agent

    # --- a node provisioned with its agent.env before the packages: the agent runs at once ---
    n.write_file("/etc/dsv41/agent.env", AGENT_ENV.format(name=n.name))
    n.run([*APT, "install", *_debs_in(V2, f"{version}+1")[:2]], env=APT_ENV, timeout=120)
    state = n.show("dsv41-agent", "ActiveState", "SubState")
    assert state == {"ActiveState": "active", "SubState": "running"}, state
    assert n.run(["cat", "/etc/dsv41/agent.env"]).stdout == AGENT_ENV.format(name=n.name)
