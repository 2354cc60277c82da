"""The model gateway's wrapper (adapter/gateway.py) running the real sglang-router 0.3.2 from its
cached venv (tools/router-venv.sh), as the agent's unit runs it: the API key read from a 0600 file
named by DSV41_API_KEY_FILE, never on the command line; the router's health routes, its worker API
guarded by the key, and its exit on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from testbed.sparks import router_venv
from tests.sglang.harness import REPO

pytestmark = pytest.mark.sglang

KEY = "gw-test-key-5f3a9c1e"


@pytest.fixture(scope="module")
def python() -> Path:
    return router_venv() / "bin" / "python"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def key_file(tmp_path: Path, key: str = KEY) -> Path:
    path = tmp_path / "api-key"
    path.write_text(key + "\n")
    path.chmod(0o600)
    return path


def gateway_env(tmp_path: Path, key_path: Path | None) -> dict[str, str]:
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONDONTWRITEBYTECODE": "1"}
    if key_path is not None:
        env["DSV41_API_KEY_FILE"] = str(key_path)
    return env


def request(url: str, method: str = "GET", body: dict | None = None, key: str | None = None) -> tuple[int, str]:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers, method=method), timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def wait_live(base: str, proc: subprocess.Popen, log: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the gateway exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        try:
            if request(f"{base}/liveness")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    pytest.fail(f"the gateway did not answer /liveness in {timeout_s} s:\n{log.read_text()[-3000:]}")


def test_the_router_serves_with_the_key_from_the_file_and_exits_on_sigterm(python: Path, tmp_path: Path) -> None:
    port, prometheus = free_port(), free_port()
    log = tmp_path / "gateway.log"
    argv = [str(python), "-m", "adapter.gateway", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus), "--policy", "round_robin"]
    with log.open("w") as out:
        proc = subprocess.Popen(argv, cwd=tmp_path, env=gateway_env(tmp_path, key_file(tmp_path)), stdout=out,
                                stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_live(base, proc, log)
        assert request(f"{base}/readiness")[0] == 503  # no worker yet
        worker = {"url": f"http://127.0.0.1:{free_port()}"}
        assert request(f"{base}/workers", "POST", worker)[0] == 401
        assert request(f"{base}/workers", "POST", worker, key="not-the-key")[0] == 401
        status, body = request(f"{base}/workers", "POST", worker, key=KEY)
        assert status == 202 and json.loads(body)["worker_id"]
        assert request(f"http://127.0.0.1:{prometheus}/metrics")[0] == 200
        for what in ("cmdline", "environ"):
            assert KEY.encode() not in Path(f"/proc/{proc.pid}/{what}").read_bytes(), what
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert KEY not in log.read_text()  # nor in what it logged


def run_wrapper(python: Path, tmp_path: Path, *flags: str, key_path: Path | None) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-m", "adapter.gateway", "--port", str(free_port()),
                           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), *flags],
                          cwd=tmp_path, env=gateway_env(tmp_path, key_path), capture_output=True, text=True, timeout=60)


def test_a_key_on_the_command_line_is_refused(python: Path, tmp_path: Path) -> None:
    for flags in (("--api-key", "secret-on-argv"), ("--api-key=secret-on-argv",), ("--api-k", "secret-on-argv")):
        done = run_wrapper(python, tmp_path, *flags, key_path=None)
        assert done.returncode == 2 and "the key comes from DSV41_API_KEY_FILE" in done.stderr, (flags, done.stderr)
        assert "secret-on-argv" not in done.stderr


def test_a_key_file_that_cannot_be_used_stops_it(python: Path, tmp_path: Path) -> None:
    done = run_wrapper(python, tmp_path, key_path=tmp_path / "missing")
    assert done.returncode == 2 and f"DSV41_API_KEY_FILE={tmp_path / 'missing'}: no such file" in done.stderr
    loose = key_file(tmp_path)
    loose.chmod(0o644)
    done = run_wrapper(python, tmp_path, key_path=loose)
    assert done.returncode == 2 and "mode 0644" in done.stderr and KEY not in done.stderr
