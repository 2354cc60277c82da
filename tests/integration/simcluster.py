"""Three booted nodes on a bridge, each running the agent from this source tree, and a cluster.env
that uses the stand-in engine; the coordinator runs on the host (the test machine) against them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc

from dsv41.v1 import control_pb2 as cpb
from dsv41.v1 import control_pb2_grpc
from testbed.nspawn import Cluster
from testbed.sparks import sim_cluster_env
from tests.integration.agentnode import REPO, SRC, install_agent

AGENT_PORT = 7441
SIM = f"{SRC}/bin/dsv41-sim-rank"
ADAPTER = "/usr/share/dsv41/rank"


def cluster_env(nodes: dict, port: int = 8888, **extra: str | None) -> str:
    """cluster.env for nodes running the agent and the stand-in from this source tree. The scenarios
    kill ranks moments after restarting with a new file: ROLLOUT_CONFIRM_S=0 keeps such a fault from
    rolling the file back (a rollout's bring-up failure still does; the rollback at a rank exit after
    serving is pinned in tests/unit/test_supervisor.py)."""
    return sim_cluster_env(nodes, SIM, port, **{"ROLLOUT_CONFIRM_S": "0", **extra})


def boot(rootfs, names=("spark1", "spark2", "spark3"), **options) -> Cluster:
    cluster = Cluster(rootfs, list(names), **options)
    cluster.boot()
    try:
        for node in cluster.nodes.values():
            node.copy_in(REPO / "sim", f"{SRC}/sim")
            node.copy_in(REPO / "coordinator", f"{SRC}/coordinator")
            node.copy_in(REPO / "bin", f"{SRC}/bin")
            node.run(["mkdir", "-p", ADAPTER, "/var/tmp/model", "/var/tmp/engram"])
            install_agent(node, AGENT_PORT, listen=f"{node.address}:{AGENT_PORT}",
                          extra=f"ALLOWED_EXECUTABLES={SIM}\nADAPTER_DIR={ADAPTER}\n")
    except BaseException:
        cluster.stop()
        raise
    return cluster


class Coordinator:
    """dsv41-coordinator from this source tree, as a host process."""

    def __init__(self, workdir: Path, env_text: str):
        self.workdir = workdir
        self.config = workdir / "cluster.env"
        self.config.write_text(env_text)
        self.socket = str(workdir / "control.sock")
        self.log = workdir / "coordinator.log"
        self.proc: subprocess.Popen | None = None

    def start(self, *extra: str) -> "Coordinator":
        if os.path.exists(self.socket):  # left by a killed coordinator
            os.unlink(self.socket)
        log = open(self.log, "ab")
        # Its own state directory: the applied configuration and the incident history are this test's.
        self.proc = subprocess.Popen([sys.executable, "-m", "coordinator.daemon", "--config", str(self.config),
                                      "--control-socket", self.socket, "--state-dir", str(self.workdir / "state"),
                                      *extra], cwd=REPO, stdout=log,
                                     stderr=subprocess.STDOUT, env=self._env())
        deadline = time.monotonic() + 20
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"coordinator did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.05)
        return self

    @staticmethod
    def _env() -> dict[str, str]:
        # Not a systemd service, also when the tests run in one: SIGTERM stops the cluster.
        env = {k: v for k, v in os.environ.items() if k != "INVOCATION_ID"}
        return {**env, "PYTHONPATH": str(REPO)}

    def stub(self) -> control_pb2_grpc.ControlStub:
        return control_pb2_grpc.ControlStub(grpc.insecure_channel(f"unix:{self.socket}"))

    def status(self) -> cpb.ClusterStatus:
        return self.stub().GetStatus(cpb.ClusterStatusRequest(), timeout=20)

    def wait_phase(self, *phases: str, timeout: float = 60.0) -> cpb.ClusterStatus:
        """The status once its phase is one of `phases`."""
        deadline = time.monotonic() + timeout
        status = None
        while time.monotonic() < deadline:
            try:
                status = self.status()
            except grpc.RpcError as exc:  # the socket exists a moment before the server answers
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                time.sleep(0.05)
                continue
            if status.phase in phases:
                return status
            time.sleep(0.1)
        raise AssertionError(f"phase {status.phase if status else '?'} ({status.phase_detail if status else ''}), "
                             f"wanted {phases}\n{self.log.read_text()[-3000:]}")

    def terminate(self, timeout: float = 90.0) -> int:
        self.proc.terminate()
        return self.proc.wait(timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def rank_pids(nodes) -> dict[str, int]:
    return {name: int(node.show("dsv41-rank.service", "MainPID")["MainPID"]) for name, node in nodes.items()}


def no_rank_anywhere(nodes) -> bool:
    for node in nodes.values():
        if node.show("dsv41-rank.service", "ActiveState")["ActiveState"] not in ("inactive", "failed"):
            return False
        if node.run(["pgrep", "-f", "dsv41-sim-rank"], check=False).stdout.strip():
            return False
    return True


def chat(address: str, port: int = 8888) -> dict:
    body = json.dumps({"model": "deepseek-v4.1-flash", "messages": [{"role": "user", "content": "What is 19+23?"}]})
    request = urllib.request.Request(f"http://{address}:{port}/v1/chat/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=20) as reply:
        return json.loads(reply.read())


def ctl(c: Coordinator, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coordinator.ctl", *args, "--socket", c.socket, "--config",
                           str(c.config)], cwd=REPO, capture_output=True, text=True, timeout=60)
