"""Booted nodes named spark1..N (three by default; six as two TP groups with boot_groups) with the
project's .deb packages installed by apt, configured the way an operator would (agent.env on every
node, cluster.env on the head, the stand-in engine), driven only through systemctl, dsv41ctl and
journalctl inside the nodes."""

from __future__ import annotations

import http.client
import ipaddress
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
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
    # None: the key's default; a value with spaces (GROUPS) is quoted, as the file's syntax asks
    return "".join(f'{k}="{v}"\n' if " " in v else f"{k}={v}\n" for k, v in lines.items() if v is not None)


def spark_names(count: int) -> list[str]:
    return [f"spark{i}" for i in range(1, count + 1)]


def _setup_node(node: Node, debs: Path, head: str, extra_agent_env: str) -> None:
    packages = ["dsv41-adapter", "dsv41-agent", "dsv41-sim"]
    if node.name == head:
        packages.append("dsv41-coordinator")
    install(node, debs, packages)
    node.write_file("/etc/dsv41/agent.env", agent_env(node) + extra_agent_env)
    node.run(["mkdir", "-p", "/var/tmp/model", "/var/tmp/engram"])
    node.run(["systemctl", "restart", "dsv41-agent.service"], timeout=60)


def boot_sparks(rootfs, debs: Path, node_options: dict | None = None, nodes: int = 3,
                head_agent_env: str = "", **extra_env: str | None) -> Cluster:
    """spark1..spark<nodes> booted, the packages installed, agent.env on each (the head's with
    head_agent_env appended) and cluster.env on the head (extra_env overrides its keys); the
    coordinator not started. node_options: more Node options for every node (binds_ro, syscalls, ...)."""
    names = spark_names(nodes)
    cluster = Cluster(rootfs, names, memory_writable=True, **(node_options or {}))
    cluster.boot()
    try:
        # Three at a time: apt and dpkg on two cores; more would only queue.
        with ThreadPoolExecutor(max_workers=3) as pool:
            for done in [pool.submit(_setup_node, node, debs, names[0], head_agent_env if k == 0 else "")
                         for k, node in enumerate(cluster.nodes.values())]:
                done.result()
        # METRICS_LISTEN: the packaged default (0.0.0.0:9441), inside the head's own network namespace
        env = sim_cluster_env(cluster.nodes, SIM, **{"METRICS_LISTEN": None, **extra_env})
        cluster.nodes[names[0]].write_file("/etc/dsv41/cluster.env", env, mode=0o640)
    except BaseException:
        cluster.stop()
        raise
    return cluster


# The gateway's own Python (sglang-router 0.3.2, made by tools/router-venv.sh under /var/tmp). Every
# node sees it read-only under /opt, as the engine's environment is (testbed/rehearsal.py): the agent
# runs no code from below a world-writable directory, sticky or not, so not from /var/tmp.
NODE_ROUTER_VENV = "/opt/dsv41-router"
GATEWAY_PYTHON = f"{NODE_ROUTER_VENV}/bin/python"
GROUP_SIZE = 3


def router_venv() -> Path:
    """The gateway's environment (sglang-router 0.3.2): tools/router-venv.sh makes it once and prints
    its path."""
    done = subprocess.run([str(REPO / "tools" / "router-venv.sh")], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"tools/router-venv.sh failed:\n{done.stderr[-3000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def groups_setting(names: list[str], size: int) -> str:
    """GROUPS for these nodes cut into groups of `size`, in order: "spark1,spark2,spark3 spark4,..."."""
    if size < 1 or len(names) % size:
        raise ValueError(f"{len(names)} nodes cannot be cut into groups of {size}")
    return " ".join(",".join(names[i:i + size]) for i in range(0, len(names), size))


def boot_groups(rootfs, debs: Path, groups: int = 2, size: int = GROUP_SIZE, node_options: dict | None = None,
                head_agent_env: str = "", **extra_env: str | None) -> Cluster:
    """groups * size stand-in nodes configured as that many TP groups (GROUPS, TP_SIZE=size) with the
    gateway's Python (router_venv()) bound read-only into every node as GATEWAY_PYTHON, which the head's
    agent allows; head_agent_env: more lines for the head's agent.env."""
    venv = router_venv()
    options = dict(node_options or {})
    options["binds_ro"] = [*options.get("binds_ro", []), f"{venv}:{NODE_ROUTER_VENV}"]
    names = spark_names(groups * size)
    env = {"GROUPS": groups_setting(names, size), "TP_SIZE": str(size), "GATEWAY_PYTHON": GATEWAY_PYTHON,
           **extra_env}
    # The head's agent runs GATEWAY_PYTHON only as one of its ALLOWED_PYTHONS.
    return boot_sparks(rootfs, debs, node_options=options, nodes=len(names),
                       head_agent_env=f"ALLOWED_PYTHONS={GATEWAY_PYTHON}\n{head_agent_env}", **env)


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
    return {n["name"]: int(n.get("status", {}).get("rank", {}).get("main_pid", 0)) for n in body.get("nodes", [])}


# Two or more GROUPS: `status --json` (protobuf's JSON, proto field names) has `groups` (name, phase,
# phase_detail, nodes, endpoint, serving_since_unix_s, generation, restart_attempt) and `gateway` (url,
# unit_state, ready, workers: group, url, healthy; error); the top-level phase is serving while any
# group serves, and its endpoint is then the gateway's.

def group_views(body: dict) -> dict[str, dict]:
    return {g["name"]: g for g in body.get("groups", [])}


def group_phases(body: dict) -> dict[str, str]:
    return {name: g.get("phase", "") for name, g in group_views(body).items()}


def group_rank_pids(body: dict, group: str) -> dict[str, int]:
    """The rank PIDs of one group's nodes (0: no rank)."""
    members = set(group_views(body)[group].get("nodes", []))
    return {name: pid for name, pid in rank_pids(body).items() if name in members}


def gateway_workers(body: dict) -> dict[str, bool]:
    """group -> healthy, for each worker the gateway lists."""
    return {w["group"]: bool(w.get("healthy")) for w in body.get("gateway", {}).get("workers", [])}


def groups_serving(body: dict, groups: int, changed_from: dict[str, dict[str, int]] | None = None,
                   gateway: bool = True) -> bool:
    """Every one of `groups` groups serves (with other rank PIDs than changed_from's, for the groups
    named there) and, with gateway, the gateway is ready with each group a healthy worker."""
    views = group_views(body)
    if len(views) != groups or any(g.get("phase") != "serving" for g in views.values()):
        return False
    if changed_from and any(group_rank_pids(body, name) == pids for name, pids in changed_from.items()):
        return False
    workers = gateway_workers(body)
    return not gateway or (body.get("gateway", {}).get("ready", False) and len(workers) == groups
                           and all(workers.values()))


def wait_groups_serving(head: Node, timeout: float = 120.0, groups: int = 2,
                        changed_from: dict[str, dict[str, int]] | None = None, gateway: bool = True) -> dict:
    """The status once groups_serving(...) holds; an AssertionError with the last status and the
    coordinator's journal when it does not within timeout."""
    deadline = time.monotonic() + timeout
    body: dict = {}
    while time.monotonic() < deadline:
        try:
            body = status(head)
        except (ValueError, subprocess.SubprocessError):
            body = {}
        if groups_serving(body, groups, changed_from, gateway):
            return body
        time.sleep(0.3)
    seen = {name: (g.get("phase"), g.get("phase_detail")) for name, g in group_views(body).items()}
    raise AssertionError(f"not {groups} groups serving after {timeout} s: phase {body.get('phase')}, groups {seen}, "
                         f"gateway {body.get('gateway')}\n"
                         + head.run(["journalctl", "-u", "dsv41-coordinator", "-n", "40", "--no-pager"],
                                    check=False).stdout)


CHAT = {"model": "deepseek-v4.1-flash", "messages": [{"role": "user", "content": "19+23?"}]}


def chat(url: str, timeout: float = 20.0, api_key: str | None = None) -> tuple[int, str]:
    """One chat completion POSTed from the test machine to url (http://HOST:PORT): status and body
    (an HTTP error's own status and body; 0 and the error for no answer at all)."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(CHAT).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, reply.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (OSError, http.client.HTTPException) as exc:
        return 0, f"{type(exc).__name__}: {exc}"
