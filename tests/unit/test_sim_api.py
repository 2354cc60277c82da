"""Rank 0's HTTP API, in process on loopback."""

import http.client
import json
import threading
import time

import pytest

from sim.api import ApiState, serve
from sim.args import parse
from sim.engine import Engine, EngineConfig
from sim.tokens import count_tokens

pytestmark = pytest.mark.unit

ARGV = ["--model-path", "/models/dsv", "--served-model-name", "dsv", "--enable-cache-report", "--context-length",
        "100000", "--tp-size", "3", "--max-total-tokens", "200000", "--max-running-requests", "4",
        "--enable-metrics"]


def start(argv=ARGV):
    args = parse(argv)
    engine = Engine(EngineConfig(chunk_tokens=256, max_running=4, prefill_tokens_per_s=20000.0,
                                 decode_tokens_per_s=5000.0, bytes_per_token=1024,
                                 max_total_tokens=args.max_total_tokens, context_length=args.context_length),
                    on_fatal=pytest.fail)
    engine.start()
    state = ApiState(args, engine, log=lambda line: None)
    server = serve(state, "127.0.0.1", 0)
    return state, server


@pytest.fixture(scope="module")
def api():
    state, server = start()
    state.set_state("serving")
    yield state, server.server_address[1]
    server.shutdown()
    state.engine.close()


def call(port, method, path, body=None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers=headers or {})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp.status, (json.loads(raw) if raw and resp.getheader("Content-Type") == "application/json" else raw)


def chat(port, text, headers=None, **extra):
    return call(port, "POST", "/v1/chat/completions", {"model": "dsv", "messages": [{"role": "user", "content": text}],
                                                        **extra}, headers=headers)


def test_health_follows_the_serving_state():
    state, server = start()
    port = server.server_address[1]
    try:
        assert call(port, "GET", "/health")[0] == 503
        assert chat(port, "hi")[0] == 503
        state.set_state("serving")
        assert call(port, "GET", "/health")[0] == 200
        state.set_state("draining")
        assert call(port, "GET", "/health")[0] == 503
        status, body = chat(port, "hi")
        assert status == 503 and body["object"] == "error" and body["code"] == 503
    finally:
        server.shutdown()
        state.engine.close()


def test_models_and_model_info(api):
    _, port = api
    status, body = call(port, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == ["dsv"]
    assert body["data"][0]["max_model_len"] == 100000
    assert call(port, "GET", "/model_info")[1]["model_path"] == "/models/dsv"


def test_the_smoke_completion(api):
    _, port = api
    status, body = chat(port, "What is 19+23?", rid="smoke-1")
    assert status == 200
    assert body["id"] == "smoke-1" and body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert "42" in choice["message"]["content"] and choice["finish_reason"] == "stop"
    assert choice["message"]["role"] == "assistant"
    usage = body["usage"]
    assert usage["prompt_tokens"] == count_tokens("What is 19+23?")
    assert usage["completion_tokens"] == len(choice["message"]["content"].split())
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


def sse(raw):
    events = [block[len("data: "):] for block in raw.decode().split("\n\n") if block]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_streaming_sends_openai_chunks(api):
    _, port = api
    status, raw = chat(port, "What is 19+23?", rid="stream-1", stream=True, stream_options={"include_usage": True})
    assert status == 200
    chunks = sse(raw)
    assert all(c["id"] == "stream-1" and c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert "42" in text and len([c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]) > 3
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(text.split())


def test_tool_calls_and_json_schema(api):
    _, port = api
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
    status, body = chat(port, "Use the tool for 19+23", tools=tools)
    (choice,) = body["choices"]
    assert status == 200 and choice["finish_reason"] == "tool_calls"
    (tool_call,) = choice["message"]["tool_calls"]
    assert tool_call["function"]["name"] == "add" and set(json.loads(tool_call["function"]["arguments"])) == {"a", "b"}
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    status, body = chat(port, "19+23 as JSON", response_format={"type": "json_schema",
                                                                 "json_schema": {"name": "s", "schema": schema}})
    assert status == 200 and json.loads(body["choices"][0]["message"]["content"]) == {"answer": 42}


def test_max_tokens_cuts_the_answer_with_finish_length(api):
    _, port = api
    status, body = chat(port, "Tell me a story about a cluster", max_tokens=2)
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length" and len(choice["message"]["content"].split()) == 2
    assert body["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("body, fragment", [
    (b"{not json", "not valid JSON"),
    ({"messages": []}, "messages must be a non-empty list"),
    ({"messages": [{"role": "user", "content": "x" * 400_004}]}, "longer than the model's context length"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens must be a positive integer"),
    ({"messages": [{"role": "user", "content": 3}]}, "invalid messages"),
])
def test_bad_requests_get_400_with_an_error_object(api, body, fragment):
    _, port = api
    status, answer = call(port, "POST", "/v1/chat/completions", body)
    assert status == 400 and answer["object"] == "error" and fragment in answer["message"], answer


def test_unknown_paths_are_404(api):
    assert call(api[1], "GET", "/v2/nothing")[0] == 404


def test_abort_of_a_long_prefill_by_rid_returns_finish_abort_and_inflight_shows_progress(api):
    state, port = api
    result = {}
    text = "word " * 79_000  # ~99k tokens: 5 s of prefill at 20k tokens/s
    worker = threading.Thread(target=lambda: result.update(zip(("status", "body"), chat(port, text, rid="long-7"))))
    worker.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        status, inflight = call(port, "GET", "/dsv41/inflight")
        entries = [r for r in inflight["requests"] if r["rid"] == "long-7"]
        if entries and entries[0]["prefilled_tokens"] >= 512:
            break
        time.sleep(0.02)
    assert status == 200 and set(inflight) == {"requests", "source", "step_launched_monotonic_s",
                                               "kv_pool_high_water_tokens"}
    assert inflight["kv_pool_high_water_tokens"] is None  # its KV in its allocator: no pool to say
    assert inflight["source"] == "sim"
    launched = inflight["step_launched_monotonic_s"]  # the stand-in prefills on: a step is running, or just ended
    assert launched is None or 0 < time.monotonic() - launched < 5
    (entry,) = entries
    assert set(entry) == {"rid", "prompt_tokens", "prefilled_tokens", "cached_tokens", "state", "chunk_tokens",
                          "output_tokens", "age_s"}
    assert entry["state"] == "prefilling" and entry["cached_tokens"] == 0 and entry["output_tokens"] == 0
    assert entry["prompt_tokens"] == count_tokens(text) and 512 <= entry["prefilled_tokens"] < entry["prompt_tokens"]
    assert isinstance(entry["age_s"], float) and entry["age_s"] > 0
    status, loads = call(port, "GET", "/v1/loads")
    assert status == 200 and loads["loads"][0]["num_running_reqs"] == 1 and loads["loads"][0]["memory_bytes"] > 0
    assert call(port, "POST", "/abort_request", {"rid": "long", "abort_all": False})[0] == 200  # not a rid: no-op
    assert call(port, "POST", "/abort_request", {"rid": "unknown", "abort_all": False})[0] == 200
    assert call(port, "GET", "/dsv41/inflight")[1]["requests"][0]["rid"] == "long-7"
    assert call(port, "POST", "/abort_request", {"rid": "long-7", "abort_all": False})[0] == 200
    worker.join(10)
    assert result["status"] == 200 and result["body"]["id"] == "long-7"
    assert result["body"]["choices"][0]["finish_reason"] == "abort"
    assert call(port, "GET", "/dsv41/inflight")[1] == {"requests": [], "source": "sim", "step_launched_monotonic_s": None,
                                                       "kv_pool_high_water_tokens": None}
    loads = state.engine.loads()
    assert loads["memory_bytes"] == 0 and loads["memory_reserved_bytes"] > 0  # the allocator keeps it


def test_server_info_loads_and_metrics(api):
    _, port = api
    status, info = call(port, "GET", "/server_info")
    assert status == 200 and info["tp_size"] == 3 and info["served_model_name"] == "dsv"
    assert info["api_key"] is None and info["internal_states"][0]["api_key"] is None  # SGLang's shape: no key set
    status, loads = call(port, "GET", "/v1/loads")
    (load,) = loads["loads"]
    assert loads["num_accelerators"] == 3
    core = {"num_running_reqs", "num_waiting_reqs", "num_used_tokens", "max_total_num_tokens", "token_usage"}
    assert core <= set(load)
    assert load["max_total_num_tokens"] == 200000 and load["max_running_requests"] == 4
    status, metrics = call(port, "GET", "/metrics")
    assert status == 200 and b'sglang:num_running_reqs{model_name="dsv"}' in metrics


def test_api_key_guards_everything_but_health():
    state, server = start(ARGV + ["--api-key", "sekret"])
    state.set_state("serving")
    port = server.server_address[1]
    try:
        assert call(port, "GET", "/health")[0] == 200
        assert call(port, "GET", "/v1/models")[0] == 401
        assert call(port, "POST", "/abort_request", {"rid": "x"})[0] == 401
        assert call(port, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"})[0] == 401
        assert call(port, "GET", "/v1/models", headers={"Authorization": "Bearer sekret"})[0] == 200
        # Like SGLang 0.5.23 without the adapter: a key given in argv comes back in clear, twice.
        info = call(port, "GET", "/server_info", headers={"Authorization": "Bearer sekret"})[1]
        assert info["api_key"] == "sekret" and info["internal_states"][0]["api_key"] == "sekret"
    finally:
        server.shutdown()
        state.engine.close()


def test_a_drain_refuses_new_requests_naming_it_while_one_in_flight_finishes_with_its_answer():
    state, server = start(ARGV + ["--api-key", "sekret"])
    state.set_state("serving")
    port = server.server_address[1]
    key = {"Authorization": "Bearer sekret"}
    try:
        assert call(port, "POST", "/dsv41/drain", {"reason": "x"})[0] == 401  # behind the key, like the rank's
        result = {}
        text = "word " * 40_000  # ~2.5 s of prefill at 20k tokens/s
        worker = threading.Thread(target=lambda: result.update(zip(("status", "body"), chat(
            port, text, rid="drained-1", headers=key))))
        worker.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not call(port, "GET", "/dsv41/inflight", headers=key)[1]["requests"]:
            time.sleep(0.02)
        status, body = call(port, "POST", "/dsv41/drain", {"reason": "dsv41ctl restart --drain"}, headers=key)
        assert status == 200 and body["draining"] and body["reason"] == "dsv41ctl restart --drain"
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("POST", "/v1/chat/completions", body=json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
                     headers=key)
        resp = conn.getresponse()
        refused = json.loads(resp.read())
        conn.close()
        assert resp.status == 503 and resp.getheader("Retry-After") == "60"
        assert "draining for a restart: dsv41ctl restart --drain" in refused["error"]["message"]
        assert call(port, "POST", "/generate", {"text": "hi"}, headers=key)[0] == 503  # refused before routing
        assert call(port, "GET", "/health")[0] == 200  # the engine is healthy: the canary must not fail
        assert call(port, "GET", "/dsv41/drain", headers=key)[1]["draining"] is True
        worker.join(15)
        assert result["status"] == 200 and result["body"]["choices"][0]["finish_reason"] == "stop"
        assert call(port, "DELETE", "/dsv41/drain", headers=key)[1] == {"draining": False}
        assert chat(port, "What is 19+23?", headers=key)[0] == 200
    finally:
        server.shutdown()
        state.engine.close()
