"""The real sglang-router 0.3.2 in front of two stand-in engines (dsv41-sim-rank, one rank each) as
local processes, driven by the coordinator's gateway manager (its HTTP side; the head agent's unit
RPC is a fake here): both groups added once healthy, requests reach both; remove_now takes one out
at once and holds it out while it still serves; release routes it again.

The router's Python: tools/router-venv.sh's cached environment (made on first use).
"""

import io
import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from coordinator import config
from coordinator.gateway import Gateway, gateway_args
from coordinator.gatewayapi import GatewayApi
from dsv41 import progress
from dsv41.journal import EventLog
from dsv41.v1 import agent_pb2 as pb
from testbed.sparks import router_venv
from tests.configtext import HOME, edited, nodes_text

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SIM = REPO / "bin" / "dsv41-sim-rank"
KEY = "gateway-test-key-0123456789"


def router_python() -> str:
    return str(router_venv() / "bin" / "python")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout=20.0, what="condition", details=lambda: ""):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}{details()}"
        time.sleep(0.1)


class Engine:
    """One stand-in group of one rank; its forward-step counter tells whether a request reached it."""

    def __init__(self, root: Path, name: str, key_file: Path, log):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.progress_dir = root / f"progress-{name}"
        self.progress_dir.mkdir()
        env = {**os.environ, "DSV41_PROGRESS_DIR": str(self.progress_dir), "DSV41_API_KEY_FILE": str(key_file)}
        argv = ["--model-path", "/models/dsv", "--served-model-name", "dsv", "--tp-size", "1", "--nnodes", "1",
                "--node-rank", "0", "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(["/usr/bin/python3", str(SIM), *argv], env=env, stdout=log,
                                     stderr=subprocess.STDOUT)

    def steps(self) -> int:
        found = progress.read(progress.path_for(0, str(self.progress_dir)), allowed_uids=(os.getuid(),))
        return found.count if found else 0


def http(method, url, body=None, key=KEY, timeout=10.0):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return None, ""


def chat(base, key=KEY):
    return http("POST", f"{base}/v1/chat/completions",
                {"model": "dsv", "messages": [{"role": "user", "content": "What is 19+23?"}], "max_tokens": 8}, key)


class FakeHead:
    def set_gateway(self, spec, timeout=30.0):
        return pb.GatewayState(active_state="active")


@pytest.fixture
def rig(tmp_path):
    python = router_python()
    key_file = tmp_path / "api-key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    procs = []
    logs = [open(tmp_path / name, "w") for name in ("g1.log", "g2.log", "router.log")]
    try:
        engines = [Engine(tmp_path, name, key_file, log) for name, log in zip(("g1", "g2"), logs)]
        procs += [e.proc for e in engines]
        port, metrics = free_port(), free_port()
        cfg = config.parse(edited(nodes_text(6), TP_SIZE="6", GROUPS='"spark1,spark2,spark3 spark4,spark5,spark6"',
                                  GATEWAY_PORT=str(port), GATEWAY_METRICS_LISTEN=f"127.0.0.1:{metrics}"),
                           "cluster.env", HOME)
        args = gateway_args(cfg)
        args[args.index("--host") + 1] = "127.0.0.1"
        # The wrapper of the real unit reads the key from a file; here it is given as the router takes it.
        router = subprocess.Popen([python, "-m", "sglang_router.launch_router", *args, "--api-key", KEY],
                                  stdout=logs[2], stderr=subprocess.STDOUT)
        procs.append(router)
        base = f"http://127.0.0.1:{port}"
        for engine in engines:
            wait_until(lambda: http("GET", f"{engine.url}/health", key=None)[0] == 200, what=f"{engine.url}/health")
        wait_until(lambda: http("GET", f"{base}/liveness", key=None)[0] == 200, what="the router's /liveness")
        routable = {"g1": engines[0].url, "g2": engines[1].url}
        log = EventLog("test", {}, stream=io.StringIO(), use_journal=False)
        gateway = Gateway(cfg, FakeHead(), lambda: pb.RankSpec(), KEY, log, lambda: dict(routable),
                          api=GatewayApi(base, KEY))
        yield gateway, GatewayApi(base, KEY), engines, base, routable
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        for log in logs:
            log.close()


def poll_until(gateway, predicate, what):
    def step():
        gateway.poll()
        return predicate()
    wait_until(step, what=what, details=lambda: f": the gateway lists {gateway.view().workers}")


def test_the_router_routes_the_serving_groups_and_holds_one_out(rig):
    gateway, api, (g1, g2), base, routable = rig
    assert api.readiness() == (False, 0, 0)
    both = sorted([(g1.url, True), (g2.url, True)])
    poll_until(gateway, lambda: sorted((w.url, w.healthy) for w in api.workers()) == both,
               "both groups listed healthy")
    assert api.readiness() == (True, 2, 2)
    assert chat(base, key=None)[0] == 401  # the cluster's key guards the gateway
    before = (g1.steps(), g2.steps())
    assert [chat(base)[0] for _ in range(6)] == [200] * 6
    assert g1.steps() > before[0] and g2.steps() > before[1], "round robin reaches both groups"

    assert gateway.remove_now("g2") is True
    assert [w.url for w in api.workers()] == [g1.url]
    before = (g1.steps(), g2.steps())
    assert [chat(base)[0] for _ in range(6)] == [200] * 6
    assert g2.steps() == before[1], "a held-out group gets no request"
    assert g1.steps() > before[0]
    for _ in range(3):  # g2 still serves and stays routable: held out all the same
        gateway.poll()
    assert [w.url for w in api.workers()] == [g1.url]

    gateway.release("g2")
    poll_until(gateway, lambda: sorted(w.url for w in api.workers()) == sorted([g1.url, g2.url]), "g2 re-added")
    before = g2.steps()
    assert [chat(base)[0] for _ in range(4)] == [200] * 4
    assert g2.steps() > before
    view = gateway.view()
    assert view.ready and sorted((g, healthy) for g, _, healthy in view.workers) == [("g1", True), ("g2", True)]


def test_a_group_that_stops_serving_leaves_the_gateway(rig):
    gateway, api, (g1, g2), base, routable = rig
    poll_until(gateway, lambda: len(api.workers()) == 2, "both groups listed")
    del routable["g1"]
    poll_until(gateway, lambda: [w.url for w in api.workers()] == [g2.url], "g1 removed")
    before = g1.steps()
    assert [chat(base)[0] for _ in range(4)] == [200] * 4
    assert g1.steps() == before
