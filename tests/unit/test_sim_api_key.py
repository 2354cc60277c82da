"""The stand-in engine reads its API key from DSV41_API_KEY_FILE like the adapter in SGLang: the same
refusals, the key never in its log, /server_info or the group's settings; and the coordinator's
smoke test refuses a rank 0 that answers without the key."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordinator import serving
from sim import group
from sim.api import ApiState, serve
from sim.args import parse, with_key_file
from sim.engine import Engine, EngineConfig
from sim.main import main

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
KEY = "sim-s3cret-KEY-0123"
VARIABLE = "DSV41_API_KEY_FILE"
HEAD = ["--model-path", "/m", "--served-model-name", "dsv", "--tp-size", "3", "--nnodes", "3", "--node-rank", "0",
        "--dist-init-addr", "127.0.0.1:20000"]


def key_file(tmp_path: Path, content: str = KEY + "\n", mode: int = 0o600) -> str:
    path = tmp_path / "sglang-api-key"
    path.write_text(content)
    path.chmod(mode)
    return str(path)


def test_the_key_comes_from_the_file_only_when_the_variable_is_set(tmp_path: Path) -> None:
    args = parse(HEAD)
    assert with_key_file(args, {}) is args and args.api_key is None
    assert with_key_file(args, {VARIABLE: key_file(tmp_path)}).api_key == KEY


def test_the_same_refusals_as_the_adapter(tmp_path: Path) -> None:
    path = key_file(tmp_path, mode=0o644)
    with pytest.raises(ValueError) as info:
        with_key_file(parse(HEAD), {VARIABLE: path})
    assert str(info.value) == f"{VARIABLE}={path}: mode 0644 lets group or other read the key; it must be 0600"
    with pytest.raises(ValueError, match="no such file"):
        with_key_file(parse(HEAD), {VARIABLE: str(tmp_path / "gone")})
    with pytest.raises(ValueError) as info:
        with_key_file(parse(HEAD + ["--api-key", "argv-key-123"]), {VARIABLE: key_file(tmp_path)})
    assert "visible to every local user in ps" in str(info.value) and "argv-key-123" not in str(info.value)


def test_the_key_stays_out_of_the_group_settings(tmp_path: Path) -> None:
    head = with_key_file(parse(HEAD), {VARIABLE: key_file(tmp_path)})
    worker = parse([a if a != "0" else "1" for a in HEAD])
    assert worker.rank == 1
    assert "api_key" not in group.settings_of(head)
    assert group.differences(group.settings_of(head), group.settings_of(worker)) == []


def test_main_refuses_a_bad_file_before_anything_starts(tmp_path: Path, monkeypatch, capsys) -> None:
    path = key_file(tmp_path, content="\n")
    monkeypatch.setenv(VARIABLE, path)
    assert main(HEAD) == 1
    err = capsys.readouterr().err
    assert err.rstrip().endswith(f"error: {VARIABLE}={path}: empty (it must hold the key on one line); "
                                 "the rank does not start")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(port: int, method: str, path: str, key: str | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(method, path, headers={"Authorization": f"Bearer {key}"} if key else {})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, body


def test_a_sim_rank_serves_only_with_the_key_and_never_prints_it(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_")}
    env[VARIABLE] = key_file(tmp_path)
    proc = subprocess.Popen([sys.executable, str(REPO / "bin" / "dsv41-sim-rank"), "--model-path", "/m",
                             "--served-model-name", "dsv", "--host", "127.0.0.1", "--port", str(port),
                             "--log-requests"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if call(port, "GET", "/health")[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "the stand-in did not come up"
            time.sleep(0.05)
        assert call(port, "GET", "/v1/models")[0] == 401
        assert call(port, "GET", "/v1/models", "wrong-key-123")[0] == 401
        assert call(port, "GET", "/v1/models", KEY)[0] == 200
        for route in ("/server_info", "/get_server_info"):
            status, body = call(port, "GET", route, KEY)
            # the stand-in answers as SGLang does; the adapter's redaction (armed by the file) hides it
            info = json.loads(body)
            assert status == 200 and KEY.encode() not in body
            assert info["api_key"] == "<redacted>" and info["internal_states"][0]["api_key"] == "<redacted>"
        assert serving.smoke(f"http://127.0.0.1:{port}", "dsv", True, 1, 10, api_key=KEY).ok
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert KEY not in err and "serving dsv" in err


def test_the_smoke_test_refuses_a_rank_0_that_answers_without_the_key() -> None:
    args = parse(HEAD[:4] + ["--tp-size", "3"])  # a rank 0 started without any key
    engine = Engine(EngineConfig(chunk_tokens=256, max_running=4, prefill_tokens_per_s=20000.0,
                                 decode_tokens_per_s=5000.0, bytes_per_token=1024, max_total_tokens=50000,
                                 context_length=None), on_fatal=pytest.fail)
    engine.start()
    state = ApiState(args, engine, log=lambda line: None)
    server = serve(state, "127.0.0.1", 0)
    state.set_state("serving")
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert serving.smoke(base, "dsv", True, 1, 10).ok  # no key configured: nothing to check
        result = serving.smoke(base, "dsv", True, 1, 10, api_key=KEY)
        assert not result.ok
        assert result.detail.startswith(f"{base}/v1/models answered 200 without the API key, expected 401")
        assert KEY not in result.detail
    finally:
        server.shutdown()
        engine.close()
