"""Finding 4, the stand-in's side: SGLang 0.5.23 answers /server_info and /get_server_info with its
server args, the API key in clear (twice: once more in each scheduler's internal_states). The
stand-in left the key out, so the test of its absence proved nothing. Now the stand-in is as
unkind as SGLang, the key is hidden only by the adapter's own redaction (as in the rank, where
the file DSV41_API_KEY_FILE arms it), and the coordinator's smoke test fails a rank 0 that shows
it. (SGLang's real app with and without the adapter: test_poc_server_info_sglang.py.)"""

from __future__ import annotations

import json
import urllib.request

import pytest

from adapter import redact
from coordinator import serving
from sim.api import ApiState, serve
from sim.args import SimArgs, parse
from sim.engine import Engine, EngineConfig

pytestmark = pytest.mark.unit

KEY = "sglang-K3y_from-the-file"
ARGV = ["--model-path", "/m", "--served-model-name", "dsv", "--host", "127.0.0.1", "--port", "8888"]


def running(args: SimArgs):
    engine = Engine(EngineConfig(chunk_tokens=256, max_running=4, prefill_tokens_per_s=20000.0,
                                 decode_tokens_per_s=5000.0, bytes_per_token=1024, max_total_tokens=50000,
                                 context_length=None), on_fatal=pytest.fail)
    engine.start()
    state = ApiState(args, engine, log=lambda line: None)
    server = serve(state, "127.0.0.1", 0)
    state.set_state("serving")
    return state, server


def server_info(port: int, route: str) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{route}", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


@pytest.mark.parametrize("from_file", [False, True])
def test_the_key_is_in_server_info_unless_the_adapter_redacts_it(from_file):
    parsed = parse(ARGV + ([] if from_file else ["--api-key", KEY]))
    args = SimArgs({**parsed.values, "api_key": KEY}, key_from_file=True) if from_file else parsed
    state, server = running(args)
    port = server.server_address[1]
    base = f"http://127.0.0.1:{port}"
    try:
        for route in ("/server_info", "/get_server_info"):
            info = server_info(port, route)
            if from_file:
                assert KEY not in json.dumps(info)
                assert info["api_key"] == info["internal_states"][0]["api_key"] == redact.REDACTED
            else:  # as SGLang alone answers: the key, twice
                assert info["api_key"] == info["internal_states"][0]["api_key"] == KEY
        shown = serving.key_not_shown(base, 10, KEY)
        assert shown.ok is from_file
        if not from_file:
            assert "/server_info answers with the API key in clear" in shown.detail and KEY not in shown.detail
        assert serving.smoke(base, "dsv", True, 1, 10, api_key=KEY).ok is from_file
    finally:
        server.shutdown()
        state.engine.close()


def test_the_redaction_reaches_every_depth_and_copies():
    value = {"api_key": KEY, "x": [{"admin_api_key": KEY}], "states": ({"api_key": None},)}
    out = redact.redact_secrets(value)
    assert out == {"api_key": "<redacted>", "x": [{"admin_api_key": "<redacted>"}], "states": ({"api_key": None},)}
    assert value["api_key"] == KEY  # the original is not changed
