"""Three booted nodes named spark1..3 with the project's .deb packages installed by apt, configured
the way an operator would (agent.env on every node, cluster.env on the head, the stand-in engine),
driven only through systemctl, dsv41ctl and journalctl inside the nodes."""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys
import time
from pathlib import Path

from tests.debs import debs_module
from tests.harness.nspawn import Cluster, Node
from tests.integration.simcluster import cluster_env

REPO = Path(__file__).resolve().parents[2]
APT = ["apt-get", "-y", "-q", "--no-install-recommends", "-o", "Dpkg::Options::=--force-confdef",
       "-o", "Dpkg::Options::=--force-confold"]
APT_ENV = {"DEBIAN_FRONTEND": "noninteractive"}
SIM = "/usr/bin/dsv41-sim-rank"
# The test-only stand-in for a worker's NFS client (the kernel here has none); see the script.
NFS_CLIENT_STANDIN = Path(__file__).with_name("standin_mount_nfs4.sh")


def build_debs(out: Path, suffix: str = "", commit: str | None = None) -> Path:
    commit = commit or subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                                      text=True, check=True).stdout.strip()
    debs_module().build(REPO, out, suffix, source=commit, log=sys.stderr)
    return out


def install(node: Node, debs: Path, packages: list[str], remote: str = "/var/tmp/debs") -> None:
    node.run(["rm", "-rf", remote])
    node.run(["mkdir", "-p", remote])
    files = []
    for package in packages:
        (deb,) = sorted(debs.glob(f"{package}_*_all.deb"))
        node.copy_in(deb, f"{remote}/{deb.name}")
        files.append(f"{remote}/{deb.name}")
    node.run([*APT, "install", *files], env=APT_ENV, timeout=300)


# The stand-in's model and packs, and scenario 8's export and mount point (tests/cluster/test_cluster.py).
ALLOWED_PATHS = "/var/tmp/model,/var/tmp/engram,/srv/dsv41-model,/var/tmp/dsv41-model"


def agent_env(node: Node) -> str:
    # The head exports on the bridge: workers may mount from its network only.
    network = ipaddress.ip_interface(f"{node.address}/24").network
    return (f"NODE_NAME={node.name}\nLISTEN={node.address}:7441\nINSECURE_NO_TLS=1\nALLOWED_RUNTIMES=host\n"
            f"ALLOWED_EXECUTABLES={SIM}\nALLOWED_PATHS={ALLOWED_PATHS}\nALLOWED_MOUNT_SERVERS={network}\n")


def boot_sparks(rootfs, debs: Path, node_options: dict | None = None, **extra_env: str) -> Cluster:
    """node_options: more Node options for every node (binds_ro, syscalls, ...)."""
    cluster = Cluster(rootfs, ["spark1", "spark2", "spark3"], memory_writable=True, **(node_options or {}))
    cluster.boot()
    try:
        for node in cluster.nodes.values():
            packages = ["dsv41-adapter", "dsv41-agent", "dsv41-sim"]
            if node.name == "spark1":
                packages.append("dsv41-coordinator")
            install(node, debs, packages)
            node.write_file("/etc/dsv41/agent.env", agent_env(node))
            node.run(["mkdir", "-p", "/var/tmp/model", "/var/tmp/engram"])
            node.run(["systemctl", "restart", "dsv41-agent.service"], timeout=60)
        # METRICS_LISTEN: the packaged default (0.0.0.0:9441), inside the head's own network namespace
        env = cluster_env(cluster.nodes, SIM_RANK_COMMAND=SIM, **{"METRICS_LISTEN": None, **extra_env})
        cluster.nodes["spark1"].write_file("/etc/dsv41/cluster.env", env, mode=0o640)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def install_nfs_client_standin(node: Node) -> None:
    """Replaces the node's mount.nfs4 (nfs-common's, which needs the kernel's NFS client) with the
    test-only stand-in: mount(8) runs it for the agent's nfs4 mount unit."""
    node.run(["rm", "-f", "/usr/sbin/mount.nfs4"])  # a symbolic link to mount.nfs: not written through
    node.write_file("/usr/sbin/mount.nfs4", NFS_CLIENT_STANDIN.read_text(), mode=0o755)


def ctl(head: Node, *args: str, check: bool = False) -> subprocess.CompletedProcess:
    return head.run(["dsv41ctl", *args], check=check, timeout=60)


def status(head: Node) -> dict:
    proc = ctl(head, "status", "--json")
    return json.loads(proc.stdout)


def wait_serving(head: Node, timeout: float = 90.0, changed_from: dict | None = None) -> dict:
    deadline = time.monotonic() + timeout
    body = {}
    while time.monotonic() < deadline:
        try:
            body = status(head)
        except (ValueError, subprocess.SubprocessError):
            body = {}
        if body.get("phase") == "serving" and (changed_from is None or rank_pids(body) != changed_from):
            return body
        time.sleep(0.2)
    raise AssertionError(f"not serving after {timeout} s: {body.get('phase')}: {body.get('phase_detail')}\n"
                         + head.run(["journalctl", "-u", "dsv41-coordinator", "-n", "40", "--no-pager"],
                                    check=False).stdout)


def rank_pids(body: dict) -> dict[str, int]:
    return {n["name"]: int(n["status"]["rank"].get("main_pid", 0)) for n in body.get("nodes", [])}


def unit_pid(node: Node, unit: str) -> int:
    return int(node.show(unit, "MainPID")["MainPID"])


def coordinator_events(head, incident: str | None = None) -> list[dict]:
    matches = ["DSV41_EVENT=incident"] + ([f"DSV41_INCIDENT={incident}"] if incident else [])
    return head.journal(unit="dsv41-coordinator.service", fields=None, matches=matches)


def incidents(head, kind: str) -> list[dict]:
    return coordinator_events(head, kind)


def wait_for(predicate, timeout: float, what: str, step: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, what
        time.sleep(step)


def new_incident(head, kind: str, seen: int, timeout: float) -> dict:
    return wait_for(lambda: incidents(head, kind)[seen:] and incidents(head, kind)[-1], timeout,
                    f"no new {kind} incident within {timeout} s: {status(head).get('phase_detail')}", step=0.1)
