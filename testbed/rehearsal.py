"""The CPU rehearsal on three booted nodes: the project's packages installed with apt, real SGLang
ranks from the engine's environment (tools/sglang-venv.sh) serving the tiny model
(tools/engine/tiny_model.py), configured as docs/cpu-rehearsal.md tells an operator: the profile
docs/cpu-rehearsal.env with the nodes' addresses, `dsv41ctl pki init` on the head and each node's
bundle installed on it. Used by the real-engine tier and by `make demo ENGINE=sglang`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from testbed.nspawn import Cluster, Node
from testbed.sparks import install

REPO = Path(__file__).resolve().parents[1]
PROFILE = REPO / "docs" / "cpu-rehearsal.env"
ENGINE = "/opt/dsv41-engine"  # where every node sees the engine's environment (read-only)
REHEARSAL = "/srv/dsv41-rehearsal"  # the model (read-only) and the node's engram directory
MODEL = f"{REHEARSAL}/model"
NODES = ("spark1", "spark2", "spark3")
API_KEY_FILE = "/etc/dsv41/api-key"  # the profile's API_KEY_FILE


def engine_venv() -> Path:
    done = subprocess.run([str(REPO / "tools" / "sglang-venv.sh")], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"tools/sglang-venv.sh failed:\n{done.stderr[-3000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def tiny_model(venv: Path, out: Path) -> Path:
    subprocess.run([str(venv / "bin" / "python"), str(REPO / "tools" / "engine" / "tiny_model.py"), str(out)],
                   check=True, capture_output=True, text=True, timeout=300)
    return out


def profile_env(nodes: dict[str, Node], **changes: str) -> str:
    """docs/cpu-rehearsal.env with these nodes' names and addresses, and `changes` applied."""
    head, *workers = (nodes[name] for name in NODES)
    values = {"HEAD_HOST": head.name, "HEAD_IP": head.address}
    for k, worker in enumerate(workers, start=1):
        values.update({f"WORKER{k}_HOST": worker.name, f"WORKER{k}_IP": worker.address})
    values.update(changes)
    lines, seen = [], set()
    for line in PROFILE.read_text().splitlines():
        key = line.partition("=")[0].strip()
        if key in values and not line.lstrip().startswith("#"):
            lines.append(f"{key}={values[key]}")
            seen.add(key)
        else:
            lines.append(line)
    lines += [f"{k}={v}" for k, v in values.items() if k not in seen]
    return "\n".join(lines) + "\n"


def agent_env(node: Node, bundle_lines: str) -> str:
    """The bundle's lines (NODE_NAME and TLS) and what the node allows the rank."""
    return (f"{bundle_lines}LISTEN={node.address}:7441\nALLOWED_RUNTIMES=host\n"
            f"ALLOWED_PYTHONS={ENGINE}/bin/python\nALLOWED_PATHS={REHEARSAL}\n")


def install_pki(head: Node, nodes: dict[str, Node]) -> None:
    """`dsv41ctl pki init` on the head; each node's bundle unpacked on it, its lines in agent.env."""
    head.run(["dsv41ctl", "pki", "init"], timeout=120)
    for node in nodes.values():
        bundle = f"/var/tmp/{node.name}-bundle.tar"
        head.run(["dsv41ctl", "pki", "bundle", node.name, "-o", bundle], timeout=60)
        if node is not head:
            node.copy_in(head.host_path(bundle), bundle)
        node.run(["tar", "-xpf", bundle, "-C", "/"])
        node.run(["rm", "-f", bundle])
        tls = "".join(line + "\n" for line in node.run(["cat", "/etc/dsv41/tls/agent.env"]).stdout.splitlines()
                      if line.strip() and not line.startswith("#"))
        node.write_file("/etc/dsv41/agent.env", agent_env(node, tls))
        restart = node.run(["systemctl", "restart", "dsv41-agent.service"], check=False, timeout=60)
        if restart.returncode != 0:
            log = node.run(["journalctl", "-u", "dsv41-agent", "-n", "20", "--no-pager"], check=False).stdout
            raise RuntimeError(f"{node.name}: dsv41-agent did not start with the bundle's TLS settings:\n{log}")


def boot_rehearsal(rootfs: Path, debs: Path, venv: Path, model: Path, **changes: str) -> Cluster:
    """Three nodes, packages installed, the profile on the head and the PKI in place; the
    coordinator not started."""
    binds = [f"{venv}:{ENGINE}", f"{model}:{MODEL}"]
    cluster = Cluster(rootfs, list(NODES), memory_writable=True, binds_ro=binds)
    cluster.boot()
    try:
        head = cluster.nodes[NODES[0]]
        for node in cluster.nodes.values():
            install(node, debs, ["dsv41-adapter", "dsv41-agent", *(["dsv41-coordinator"] if node is head else [])])
            node.run(["mkdir", "-p", f"{REHEARSAL}/engram"])
        head.write_file("/etc/dsv41/cluster.env", profile_env(cluster.nodes, **changes), mode=0o640)
        head.run(["sh", "-c", f"umask 077; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n' > {API_KEY_FILE}"])
        install_pki(head, cluster.nodes)
    except BaseException:
        cluster.stop()
        raise
    print(f"rehearsal nodes up: {', '.join(f'{n.name} {n.address}' for n in cluster.nodes.values())}",
          file=sys.stderr)
    return cluster


def api_key(head: Node) -> str:
    return head.run(["cat", API_KEY_FILE]).stdout.strip()
