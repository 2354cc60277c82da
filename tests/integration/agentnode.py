"""Runs the agent from this source tree inside a booted node, as the real unit file does."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import grpc

from dsv41.v1 import agent_pb2 as pb
from dsv41.v1 import agent_pb2_grpc
from testbed.nspawn import Node

REPO = Path(__file__).resolve().parents[2]
SRC = "/opt/dsv41-src"
STANDIN = f"{SRC}/tests/integration/standin_rank.py"

DROP_IN = f"""[Service]
ExecStart=
ExecStart=/usr/bin/python3 -m agent --config /etc/dsv41/agent.env
WorkingDirectory={SRC}
Environment=PYTHONPATH={SRC}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What the test nodes may show a rank: the stand-in engine's model and pack directories.
ALLOWED_PATHS = "/var/tmp/model,/var/tmp/engram"


def copy_source(node: Node, parts=("agent", "dsv41", "adapter", "tests/integration/standin_rank.py")) -> None:
    for part in parts:
        node.copy_in(REPO / part, f"{SRC}/{part}")
    node.run(["chmod", "0755", STANDIN])  # an entry point: the agent runs it directly


def install_agent(node: Node, port: int, extra: str = "", listen: str | None = None) -> None:
    copy_source(node)
    node.write_file("/etc/systemd/system/dsv41-agent.service", (REPO / "units/dsv41-agent.service").read_text())
    node.write_file("/etc/systemd/system/dsv41-agent.service.d/source.conf", DROP_IN)
    settings = {"NODE_NAME": node.name, "LISTEN": listen or f"127.0.0.1:{port}", "INSECURE_NO_TLS": "1",
                "ALLOWED_RUNTIMES": "host", "ALLOWED_PYTHONS": "/usr/bin/python3",
                "ALLOWED_EXECUTABLES": f"{STANDIN},/usr/local/bin/missing-rank", "ALLOWED_PATHS": ALLOWED_PATHS,
                "ADAPTER_DIR": f"{SRC}/adapter"}
    for line in extra.splitlines():
        key, _, value = line.partition("=")
        settings[key] = value
    node.write_file("/etc/dsv41/agent.env", "".join(f"{k}={v}\n" for k, v in settings.items()))
    node.run(["systemctl", "daemon-reload"])
    node.run(["systemctl", "start", "dsv41-agent.service"], timeout=60)


def channel(port: int) -> agent_pb2_grpc.AgentStub:
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(ch).result(timeout=20)
    return agent_pb2_grpc.AgentStub(ch)


def spec(*args: str, fingerprint: str = "a1", rank: int = 1, stop_timeout_s: int = 10,
         env: dict | None = None, **fields) -> pb.RankSpec:
    return pb.RankSpec(runtime="host", argv=[STANDIN, *args],
                       env={"PYTHONPATH": f"{SRC}/adapter", **(env or {})}, fingerprint=fingerprint, rank=rank,
                       stop_timeout_s=stop_timeout_s, cluster_generation="g1", **fields)


def wait(predicate, timeout: float = 10.0, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(step)
