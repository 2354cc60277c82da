#!/usr/bin/python3
"""The local demo: three systemd nodes (spark1-3) on a private bridge, the project's packages
installed with apt, the coordinator started on spark1; with --groups 2, six nodes (spark1-6) as two
TP groups of three behind the model gateway on spark1.

    sudo tools/demo.py up [--engine sglang|sim] [--groups 1|2]
                                 # build, boot, install, start; prints status and
                                 # what to try. sglang (the default): real SGLang 0.5.23 ranks on the
                                 # CPU serving a tiny model over TP 3, set up as docs/cpu-rehearsal.md
                                 # says (mutual TLS, API key); sim: the stand-in engine (seconds to
                                 # serve, no 2 GB engine environment; its runaway prompt shows the guard).
                                 # --groups 2: the stand-in engine only (the default engine then), the
                                 # gateway (sglang-router, tools/router-venv.sh) on spark1's port 30000
    sudo tools/demo.py sh spark2 [COMMAND...]   # a shell (or one command) inside a node
    sudo tools/demo.py poweroff spark3          # the node loses power: all its processes die at once
    sudo tools/demo.py boot spark3              # power it on again: a fresh systemd on the same disk
    sudo tools/demo.py freeze spark3            # every process of the node stops (a wedged node)
    sudo tools/demo.py thaw spark3
    sudo tools/demo.py unplug spark3            # its network cable out (the link down) ...
    sudo tools/demo.py plug spark3              # ... and back in
    sudo tools/demo.py down      # tear everything down

`up` leaves a small supervisor process holding the nodes; the node commands and `down` ask it, over
a unix socket, to act on them. Needs root, systemd-nspawn and mmdebstrap (tools/install-test-deps.sh
installs them).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

STATE = Path("/run/dsv41-demo.json")
SOCKET = "/run/dsv41-demo.sock"
NODE_COMMANDS = ("poweroff", "boot", "freeze", "thaw", "unplug", "plug")
ENGINES = ("sglang", "sim")
SERVE_S = {"sglang": 300, "sim": 90}  # three CPU ranks of real SGLang on two cores: about a minute
GROUPS_SERVE_S = 180  # six stand-in nodes and two bring-ups on two cores
GROUP_COUNTS = (1, 2)
GATEWAY_PORT = 30000  # GATEWAY_PORT's default


def _save_state(cluster) -> None:
    STATE.write_text(json.dumps({"pid": os.getpid(), "nodes": {
        n.name: {"leader": n.leader, "address": n.address} for n in cluster.nodes.values()}}))


def _node_command(cluster, line: str) -> str:
    """One node command from `tools/demo.py COMMAND NODE`; the answer line."""
    parts = line.split()
    if len(parts) != 2 or parts[0] not in NODE_COMMANDS:
        return f"error: expected one of {', '.join(NODE_COMMANDS)} and a node"
    command, name = parts
    node = cluster.nodes.get(name)
    if node is None:
        return f"error: no node {name}; nodes: {', '.join(cluster.nodes)}"
    try:
        if command == "poweroff":
            node.power_cut()
        elif command == "boot":
            node.power_on()
        elif command == "freeze":
            node.freeze()
        elif command == "thaw":
            node.thaw()
        else:
            node.link(up=command == "plug")
    except Exception as exc:  # the answer says what went wrong; the demo goes on
        return f"error: {command} {name}: {exc}"
    _save_state(cluster)
    return f"ok: {command} {name}"


def _boot(engine: str, groups: int, debs: Path):
    from testbed.nspawn import build_rootfs

    if groups > 1:
        from testbed.sparks import boot_groups
        return boot_groups(build_rootfs(), debs, groups=groups, SMOKE_QUICK="0")
    if engine == "sim":
        from testbed.sparks import boot_sparks
        return boot_sparks(build_rootfs(), debs, SMOKE_QUICK="0")
    from testbed.rehearsal import boot_rehearsal, engine_venv, tiny_model
    venv = engine_venv()
    return boot_rehearsal(build_rootfs(), debs, venv, tiny_model(venv, Path(tempfile.mkdtemp(prefix="dsv41-demo-model-"))))


def _wait_ready(head, engine: str, groups: int) -> dict:
    """Waits for the cluster to serve; what `up` prints: the status, and with groups a chat
    completion asked through the gateway."""
    from testbed.sparks import chat, ctl, wait_groups_serving, wait_serving

    if groups == 1:
        wait_serving(head, timeout=SERVE_S[engine])
        return {"status": ctl(head, "status").stdout}
    wait_groups_serving(head, timeout=GROUPS_SERVE_S, groups=groups)
    code, reply = chat(f"http://{head.address}:{GATEWAY_PORT}")
    return {"status": ctl(head, "status").stdout, "chat": f"{code} {reply}"}


def _supervise(ready_fd: int, engine: str, groups: int) -> None:
    from testbed.sparks import build_debs

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    with os.fdopen(ready_fd, "w") as ready:
        try:
            debs = build_debs(Path(tempfile.mkdtemp(prefix="dsv41-demo-debs-")),
                              commit=os.environ.get("DEMO_COMMIT") or None)
            cluster = _boot(engine, groups, debs)
        except Exception as exc:  # report to the waiting `up`, then exit
            ready.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
            return
        try:
            head = cluster.nodes["spark1"]
            head.run(["systemctl", "start", "dsv41-coordinator.service"], timeout=60)
            answer = _wait_ready(head, engine, groups)
            _save_state(cluster)
            ready.write(json.dumps(answer))
        except Exception as exc:
            ready.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
            cluster.stop()
            return
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    Path(SOCKET).unlink(missing_ok=True)
    server.bind(SOCKET)
    os.chmod(SOCKET, 0o600)
    server.listen(4)
    server.settimeout(0.5)
    while not stop:
        try:
            conn, _ = server.accept()
        except (socket.timeout, InterruptedError):
            continue
        with conn:
            conn.settimeout(120)
            try:
                line = conn.makefile().readline()
                conn.sendall((_node_command(cluster, line) + "\n").encode())
            except OSError:
                pass
    server.close()
    Path(SOCKET).unlink(missing_ok=True)
    try:
        cluster.nodes["spark1"].run(["systemctl", "stop", "dsv41-coordinator.service"], check=False, timeout=120)
    finally:
        cluster.stop()
        STATE.unlink(missing_ok=True)


def up(engine: str, groups: int = 1) -> int:
    if STATE.exists():
        print(f"a demo is already up ({STATE}); `sudo tools/demo.py down` first", file=sys.stderr)
        return 1
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.setsid()
        log = os.open("/var/tmp/dsv41-demo.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        try:
            _supervise(write, engine, groups)
        finally:
            os._exit(0)
    os.close(write)
    print(f"building the packages, booting spark1-{3 * groups}, installing, starting the coordinator "
          "(log: /var/tmp/dsv41-demo.log) ...", flush=True)
    with os.fdopen(read) as ready:
        answer = ready.read()
    result = json.loads(answer) if answer else {"error": "the demo supervisor died; see /var/tmp/dsv41-demo.log"}
    if "error" in result:
        print(f"demo failed: {result['error']}", file=sys.stderr)
        return 1
    print(result["status"])
    nodes = json.loads(STATE.read_text())["nodes"]
    head = nodes["spark1"]["address"]
    if groups > 1:
        _print_groups_help(head, result["chat"])
        return 0
    if engine == "sglang":
        what = "real SGLang 0.5.23 ranks (CPU, the tiny model of docs/cpu-rehearsal.md, TP 3 over gloo)"
        auth = " -H \"Authorization: Bearer $(sudo tools/demo.py sh spark1 cat /etc/dsv41/api-key)\""
        stall = "pkill -STOP -f sglang::scheduler"  # the process that takes the forward steps
    else:
        what, auth = "the stand-in engine", ""
        stall = "kill -STOP $(systemctl show -p MainPID --value dsv41-rank)"
    print(f"""The cluster is serving with {what}. Look around:
  sudo tools/demo.py sh spark1 dsv41ctl status
  sudo tools/demo.py sh spark1 dsv41ctl events
  sudo tools/demo.py sh spark3 journalctl -u dsv41-rank -n 20
  sudo tools/demo.py sh spark1 journalctl -u dsv41-coordinator DSV41_EVENT=serving
  curl -s http://{head}:8888/v1/chat/completions -H 'Content-Type: application/json'{auth} \\
       -d '{{"model": "deepseek-v4.1-flash", "messages": [{{"role": "user", "content": "19+23?"}}]}}'
  curl -s http://{head}:9441/metrics | grep -E '^dsv41_(phase|incidents_total|restarts_total)'
  sudo tools/demo.py sh spark3 sh -c 'kill -9 $(systemctl show -p MainPID --value dsv41-rank)'
  sudo tools/demo.py sh spark1 dsv41ctl bundle -o /root/bundle.tar
Faults a Spark cluster has (then watch `dsv41ctl status` and `dsv41ctl events`):
  sudo tools/demo.py freeze spark3     # wedged: node_lost, phase waiting; `thaw spark3` and it serves again
  sudo tools/demo.py poweroff spark3   # power lost: node_lost; `boot spark3`: node_rebooted, serving again
  sudo tools/demo.py unplug spark2     # the cable out; `plug spark2` and it serves again
  sudo tools/demo.py sh spark2 sh -c '{stall}'  # with a request in flight: rank_hung
Tear it down:
  sudo tools/demo.py down""")
    return 0


def _print_groups_help(head: str, chat: str) -> None:
    gateway = f"http://{head}:{GATEWAY_PORT}"
    print(f"""Two TP groups of the stand-in engine serve: g1 (spark1-3) and g2 (spark4-6), each group's rank 0 a
worker of the model gateway (sglang-router) on spark1. Clients connect to the gateway:
  {gateway}
A chat completion through it answered: {chat}
Look around:
  curl -s {gateway}/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{{"model": "deepseek-v4.1-flash", "messages": [{{"role": "user", "content": "19+23?"}}]}}'
  sudo tools/demo.py sh spark1 dsv41ctl status          # both groups, the gateway and its workers
  sudo tools/demo.py sh spark1 systemctl status dsv41-gateway.service
  sudo tools/demo.py sh spark1 dsv41ctl events
A rank of group 2 killed -9: g2 restarts on its own, g1 keeps serving (and its PIDs) behind the gateway:
  sudo tools/demo.py sh spark5 sh -c 'kill -9 $(systemctl show -p MainPID --value dsv41-rank)'
A planned restart goes group by group, one group always serving:
  sudo tools/demo.py sh spark1 dsv41ctl restart
Node faults as with one group (poweroff, freeze, unplug spark5 ...). Tear it down:
  sudo tools/demo.py down""")


def sh(name: str, command: list[str]) -> int:
    if not STATE.exists():
        print("no demo is up: `sudo tools/demo.py up`", file=sys.stderr)
        return 1
    nodes = json.loads(STATE.read_text())["nodes"]
    if name not in nodes:
        print(f"no node {name}; nodes: {', '.join(nodes)}", file=sys.stderr)
        return 1
    argv = ["nsenter", "-t", str(nodes[name]["leader"]), "-a", "--", *(command or ["/bin/bash", "-l"])]
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "TERM": os.environ.get("TERM", "xterm"),
           "HOME": "/root", "LANG": "C.UTF-8"}
    return subprocess.call(argv, env=env)


def node_command(command: str, name: str) -> int:
    if not STATE.exists():
        print("no demo is up: `sudo tools/demo.py up`", file=sys.stderr)
        return 1
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(180)
        try:
            conn.connect(SOCKET)
            conn.sendall(f"{command} {name}\n".encode())
            answer = conn.makefile().readline().strip()
        except OSError as exc:
            print(f"cannot reach the demo supervisor at {SOCKET}: {exc}", file=sys.stderr)
            return 1
    print(answer, file=sys.stdout if answer.startswith("ok") else sys.stderr)
    return 0 if answer.startswith("ok") else 1


def down() -> int:
    if not STATE.exists():
        print("no demo is up", file=sys.stderr)
        return 0
    pid = json.loads(STATE.read_text())["pid"]
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        STATE.unlink(missing_ok=True)
        return 0
    deadline = time.monotonic() + 180
    while STATE.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    print("demo torn down" if not STATE.exists() else "teardown still running; see /var/tmp/dsv41-demo.log")
    return 0 if not STATE.exists() else 1


def groups_problem(engine: str | None, groups: int) -> str:
    """Why `up` cannot run this many groups with this engine (empty: it can)."""
    if groups not in GROUP_COUNTS:
        return f"--groups {groups}: this demo runs 1 group (spark1-3) or 2 groups of three (spark1-6)"
    if groups > 1 and engine == "sglang":
        return ("--groups 2 runs the stand-in engine only: two groups of real SGLang CPU ranks do not fit this "
                "machine (one group of three takes its two cores for about a minute to serve); use "
                "`make demo GROUPS=2` (ENGINE=sim), or one group with ENGINE=sglang")
    return ""


def main(argv: list[str]) -> int:
    if os.geteuid() != 0:
        print("the demo boots systemd containers: run it as root (sudo)", file=sys.stderr)
        return 1
    if not argv or argv[0] not in ("up", "sh", "down", *NODE_COMMANDS):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "up":
        parser = argparse.ArgumentParser(prog="tools/demo.py up")
        parser.add_argument("--engine", choices=ENGINES, help="sglang (the default with one group) or sim")
        parser.add_argument("--groups", type=int, default=1, help="TP groups of three nodes: 1 or 2")
        args = parser.parse_args(argv[1:])
        problem = groups_problem(args.engine, args.groups)
        if problem:
            print(problem, file=sys.stderr)
            return 2
        return up(args.engine or ("sglang" if args.groups == 1 else "sim"), args.groups)
    if argv[0] == "down":
        return down()
    if argv[0] in NODE_COMMANDS:
        if len(argv) != 2:
            print(f"usage: tools/demo.py {argv[0]} NODE", file=sys.stderr)
            return 2
        return node_command(argv[0], argv[1])
    if len(argv) < 2:
        print("usage: tools/demo.py sh NODE [COMMAND...]", file=sys.stderr)
        return 2
    return sh(argv[1], argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
