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

from testbed.debs import debs_module
from testbed.nspawn import Cluster, Node

REPO = Path(__file__).resolve().parents[1]
AGENT_PORT = 7441
APT = ["apt-get", "-y", "-q", "--no-install-recommends", "-o", "Dpkg::Options::=--force-confdef",
       "-o", "Dpkg::Options::=--force-confold"]
APT_ENV = {"DEBIAN_FRONTEND": "noninteractive"}
SIM = "/usr/bin/dsv41-sim-rank"


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


def sim_cluster_env(nodes: dict, sim_rank_command: str, port: int = 8888, **extra: str | None) -> str:
    """cluster.env for these nodes (the first is the head) with the stand-in engine at sim_rank_command;
    `extra` overrides keys (None: the key's default)."""
    names = list(nodes)
    head, workers = nodes[names[0]], [nodes[n] for n in names[1:]]
    lines = {
        "HEAD_IP": head.address, "HEAD_HOST": names[0], "AGENT_PORT": str(AGENT_PORT),
        "FABRIC_IFACE": "host0", "FABRIC_MTU": "1500", "GLOO_SOCKET_IFNAME": "host0", "NCCL_SOCKET_IFNAME": "host0",
        "IB_HCA": "rocep1s0f0,rocep1s0f1", "NCCL_NET": "Socket", "NCCL_IB_DISABLE": "1",
        "MODEL_DIR": "/var/tmp/model", "COMMON_MODEL": "/var/tmp/model",
        "BASE_IMAGE": "lmsysorg/sglang:dev-dsv41@sha256:" + "0" * 64, "PORT": str(port),
        "NFS_SHARE": "0", "NNODES": str(len(nodes)), "TP_SIZE": str(len(nodes)), "DIST_PORT": "20000",
        "OFFLOAD_MODE": "host", "CONTEXT_LENGTH": "65536", "MEM_FRACTION_STATIC": "0.9",
        "MAX_TOTAL_TOKENS": "131072", "DSV41_MAX_NEW_TOKENS": "1024", "ENGRAM_DIR": "/var/tmp/engram",
        "RANK_RUNTIME": "host", "RANK_ENGINE": "sim", "SIM_RANK_COMMAND": sim_rank_command, "RANK_MEMORY_GIB": "0.05",
        "INSECURE_NO_TLS": "1", "RESTART_BACKOFF_S": "0.2", "RANK_STOP_TIMEOUT_S": "10",
        "HEALTH_TIMEOUT_S": "60", "MEMORY_RECOVERY_TIMEOUT_S": "10",
        # The stand-in engine's runtime (the host's Python) has no torch: the collective gate cannot
        # run there, so it is off, and every bring-up warns of it (collective_gate_off).
        "COLLECTIVE_GATE": "0",
        # Off by default: these coordinators run on the test machine itself, where concurrent runs
        # would race for the one default port. A test that wants metrics names a port.
        "METRICS_LISTEN": "",
    }
    for k, worker in enumerate(workers, start=1):
        lines[f"WORKER{k}_IP"] = worker.address
        lines[f"WORKER{k}_HOST"] = names[k]
    lines.update(extra)
    return "".join(f"{k}={v}\n" for k, v in lines.items() if v is not None)  # None: the key's default


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
        env = sim_cluster_env(cluster.nodes, SIM, **{"METRICS_LISTEN": None, **extra_env})
        cluster.nodes["spark1"].write_file("/etc/dsv41/cluster.env", env, mode=0o640)
    except BaseException:
        cluster.stop()
        raise
    return cluster


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
