"""Rank 0's HTTP API: the SGLang endpoints the coordinator, the smoke test and the memory guard use,
with SGLang's shapes (OpenAI-compatible chat completions, SSE streaming with chunked encoding)."""

from __future__ import annotations

import hmac
import json
import socket
import threading
import time
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator

from adapter.redact import redact_secrets
from dsv41 import drain as drain_contract

from .answers import Answer, answer
from .args import SimArgs
from .engine import Engine, Rejected, Request
from .tokens import count_tokens, output_pieces, prompt_text

VERSION = "0.5.23-dsv41-sim"
# Like SGLang's /health: a one-token generation, checked once a second, 503 after this long.
HEALTH_CHECK_TIMEOUT_S = 20.0
HEALTH_CHECK_POLL_S = 1.0
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"
# Paths SGLang leaves open when --api-key is set (k8s probes, Prometheus).
_OPEN_PREFIXES = ("/health", "/ready", "/metrics")


def inflight_body(engine: Engine) -> dict:
    """GET /dsv41/inflight; the adapter's route inside real SGLang serves the same schema."""
    return {"requests": engine.inflight(), "source": "sim", "step_launched_monotonic_s": engine.step_launched_at(),
            "kv_pool_high_water_tokens": engine.kv_high_water()}


class ApiState:
    """What the handler threads share: the engine, the serving state and a count of open responses."""

    def __init__(self, args: SimArgs, engine: Engine, log: Callable[[str], None],
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.args = args
        self.engine = engine
        self.log = log
        self.wall_clock = wall_clock
        self._lock = threading.Condition()
        self._state = "starting"  # -> serving -> draining
        self._open = 0
        self._drain = drain_contract.DrainState()  # POST /dsv41/drain: refusing new requests for a restart

    def drain_answer(self, method: str, body: object) -> tuple[int, dict]:
        """/dsv41/drain, as the rank's adapter answers it (dsv41/drain.py)."""
        with self._lock:
            before = self._drain
            status, self._drain, out = drain_contract.answer(before, method, body, time.monotonic())
            after = self._drain
        if after.reason != before.reason:
            self.log(f"drain: refusing new requests: {after.reason}" if after.draining
                     else "drain: lifted, admitting new requests")
        return status, out

    def drain_refusal(self, method: str, path: str) -> tuple[int, dict, dict] | None:
        with self._lock:
            state = self._drain
        return drain_contract.refusal(state.reason) if drain_contract.refuses(state, method, path) else None

    @property
    def state(self) -> str:
        with self._lock:
            return self._state

    def set_state(self, state: str) -> None:
        with self._lock:
            self._state = state

    def opened(self) -> None:
        with self._lock:
            self._open += 1

    def closed(self) -> None:
        with self._lock:
            self._open -= 1
            self._lock.notify_all()

    def health_generate(self, timeout_s: float = HEALTH_CHECK_TIMEOUT_S,
                        poll_s: float = HEALTH_CHECK_POLL_S) -> bool:
        """SGLang's health check: queue a one-token request and call the server healthy as soon as
        the scheduler completes any step after it was asked (a busy server needs no extra work), or
        unhealthy after timeout_s. A TP group stuck in a collective completes none."""
        asked = time.monotonic()
        try:
            request = self.engine.submit(f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}", 1)
        except Rejected:
            return False
        try:
            while time.monotonic() < asked + timeout_s:
                time.sleep(poll_s)
                if self.engine.last_step_at > asked:
                    return True
            return False
        finally:
            self.engine.cancel(request)

    def wait_responses(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._open:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
            return True


def _error(status: int, message: str) -> dict:
    names = {400: "BadRequestError", 401: "Unauthorized", 404: "NotFoundError", 503: "ServiceUnavailable"}
    return {"object": "error", "message": message, "type": names.get(status, "InternalServerError"),
            "param": None, "code": status}


def _events(ans: Answer) -> list[tuple[str, Any, int]]:
    """The answer as output events (kind, payload, tokens it costs)."""
    events: list[tuple[str, Any, int]] = [("reasoning", p, 1) for p in output_pieces(ans.reasoning or "")]
    events += [("content", p, 1) for p in output_pieces(ans.content or "")]
    events += [("tool", call, max(1, count_tokens(call.arguments))) for call in ans.tool_calls]
    return events


def _tool_json(index: int, call) -> dict:
    return {"index": index, "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


class ChatRun:
    """One chat completion going through the engine: yields output events as they are decoded."""

    def __init__(self, state: ApiState, body: dict) -> None:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise Rejected(400, "messages must be a non-empty list of message objects")
        rid = body.get("rid")
        if rid is None:
            rid = uuid.uuid4().hex
        if not isinstance(rid, str) or not rid:
            raise Rejected(400, "rid must be a non-empty string")
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise Rejected(400, "max_tokens must be a positive integer")
        try:
            text = prompt_text(messages)
        except (ValueError, AttributeError) as exc:
            raise Rejected(400, f"invalid messages: {exc}") from None
        self.state = state
        self.body = body
        self.rid = rid
        self.model = body.get("model") or state.args.model_name
        self.answer = answer(body, rid)
        self.limit = limit
        self.request: Request = state.engine.submit(rid, count_tokens(text))
        self.finish_reason: str | None = None

    def events(self) -> Iterator[tuple[str, Any]]:
        engine, request = self.state.engine, self.request
        engine.wait_prefilled(request)
        if request.finish_reason is not None:  # aborted before the first token
            self.finish_reason = request.finish_reason
            return
        emitted = 0
        for kind, payload, cost in _events(self.answer):
            if self.limit is not None and emitted + cost > self.limit:
                engine.finish(request, "length")
                self.finish_reason = request.finish_reason
                return
            for _ in range(cost):
                if not engine.next_token(request):
                    self.finish_reason = "abort"
                    return
            emitted += cost
            yield kind, payload
        engine.finish(request, self.answer.finish_reason)
        self.finish_reason = request.finish_reason

    def close(self) -> None:
        """Aborts the request unless it finished: a response that could not be delivered must not
        leave a request (and its memory) behind."""
        if self.request.finish_reason is None:
            self.state.engine.cancel(self.request)

    def usage(self) -> dict:
        request = self.request
        usage = {"prompt_tokens": request.prompt_tokens, "completion_tokens": request.generated,
                 "total_tokens": request.prompt_tokens + request.generated}
        if self.state.args.enable_cache_report:
            usage["prompt_tokens_details"] = {"cached_tokens": 0}
        return usage


class Handler(BaseHTTPRequestHandler):
    api: ApiState  # set by make_handler's subclass
    protocol_version = "HTTP/1.1"
    server_version = "dsv41-sim-rank"

    def log_message(self, fmt: str, *args: Any) -> None:
        if self.api.args.log_requests:
            self.api.log(f"http {self.address_string()} {fmt % args}")

    # --- plumbing ---------------------------------------------------------------------------
    def _send(self, status: int, body: Any = None, content_type: str = "application/json",
              headers: dict[str, str] | None = None) -> None:
        data = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _read_json(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            return json.loads(raw or b"{}")
        except ValueError as exc:
            raise Rejected(400, f"request body is not valid JSON: {exc}") from None

    def _authorised(self) -> bool:
        key = self.api.args.api_key
        if not key or self.path.startswith(_OPEN_PREFIXES):
            return True
        # Constant-time, as SGLang compares it.
        return hmac.compare_digest(self.headers.get("Authorization", "").encode(), f"Bearer {key}".encode())

    def _dispatch(self, routes: dict[str, Callable[[], None]]) -> None:
        path = self.path.split("?", 1)[0]
        if not self._authorised():
            self._send(401, {"error": "Unauthorized"})
            return
        refused = self.api.drain_refusal(self.command, path)
        if refused is not None:  # before routing, as the rank's middleware does
            status, headers, body = refused
            self._discard_body()
            self._send(status, body, headers=headers)
            return
        route = routes.get(path)
        if route is None:
            self._send(404, {"detail": "Not Found"})
            return
        self.api.opened()
        try:
            route()
        except Rejected as exc:
            self._send(exc.status, _error(exc.status, str(exc)))
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            self.close_connection = True
        finally:
            self.api.closed()

    def do_GET(self) -> None:
        self._dispatch({"/health": self._health, "/health_generate": self._health, "/ready": self._health,
                        "/v1/models": self._models, "/model_info": self._model_info,
                        "/server_info": self._server_info, "/get_server_info": self._server_info,
                        "/v1/loads": self._loads, "/metrics": self._metrics,
                        "/dsv41/inflight": lambda: self._send(200, inflight_body(self.api.engine)),
                        drain_contract.PATH: self._drain})

    def do_POST(self) -> None:
        self._dispatch({"/v1/chat/completions": self._chat, "/abort_request": self._abort,
                        drain_contract.PATH: self._drain})

    def do_DELETE(self) -> None:
        self._dispatch({drain_contract.PATH: self._drain})

    def _discard_body(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)

    def _drain(self) -> None:
        body = None
        if self.command == "POST":
            try:
                body = self._read_json()
            except Rejected:
                body = None
        self._send(*self.api.drain_answer(self.command, body))

    # --- routes -----------------------------------------------------------------------------
    def _health(self) -> None:
        if self.api.state != "serving":
            self._send(503)
            return
        self._send(200 if self.api.health_generate() else 503)

    def _models(self) -> None:
        self._send(200, {"object": "list", "data": [{
            "id": self.api.args.model_name, "object": "model", "created": int(self.api.wall_clock()),
            "owned_by": "sglang", "root": self.api.args.model_name,
            "max_model_len": self.api.args.context_length}]})

    def _model_info(self) -> None:
        self._send(200, {"model_path": self.api.args.model_path,
                         "tokenizer_path": self.api.args.tokenizer_path or self.api.args.model_path,
                         "is_generation": True, "served_model_name": self.api.args.model_name,
                         "engine": "dsv41-sim-rank"})

    def _server_info(self) -> None:
        # As SGLang 0.5.23 answers: its server args, the API key among them, and each scheduler's
        # resolved args again in internal_states. Only the adapter's redaction hides the key, and
        # only where the adapter would run: when the key came from DSV41_API_KEY_FILE.
        loads = self.api.engine.loads()
        info = {**self.api.args.values, "version": VERSION, "engine": "dsv41-sim-rank", "state": self.api.state,
                "internal_states": [{**self.api.args.values, "last_gen_throughput": 0.0,
                                     "memory_usage": {"sim_prefill_bytes": loads["memory_bytes"]}}]}
        if self.api.args.key_from_file:
            info = redact_secrets(info)
        self._send(200, info)

    def _loads(self) -> None:
        load = {"timestamp": self.api.wall_clock(), **self.api.engine.loads()}
        self._send(200, {"timestamp": datetime.now(timezone.utc).isoformat(), "version": VERSION,
                         "accelerator": None, "num_accelerators": int(self.api.args.tp_size),
                         "loads": [load]})

    def _metrics(self) -> None:
        if not self.api.args.enable_metrics:
            self._send(404, {"detail": "Not Found"})
            return
        load = self.api.engine.loads()
        name = self.api.args.model_name
        lines = [f'sglang:num_running_reqs{{model_name="{name}"}} {load["num_running_reqs"]}',
                 f'sglang:num_queue_reqs{{model_name="{name}"}} {load["num_waiting_reqs"]}',
                 f'sglang:token_usage{{model_name="{name}"}} {load["token_usage"]}']
        self._send(200, ("\n".join(lines) + "\n").encode(), "text/plain; version=0.0.4")

    def _abort(self) -> None:
        body = self._read_json()
        if not isinstance(body, dict):
            raise Rejected(400, "abort_request takes a JSON object {\"rid\": ..., \"abort_all\": ...}")
        rid = body.get("rid") or ""
        aborted = self.api.engine.abort(str(rid), bool(body.get("abort_all", False)))
        if aborted:
            self.api.log(f"abort_request rid={rid!r} abort_all={bool(body.get('abort_all'))}: "
                      f"aborting {', '.join(aborted)}")
        self._send(200)

    def _chat(self) -> None:
        body = self._read_json()
        if not isinstance(body, dict):
            raise Rejected(400, "the request body must be a JSON object")
        if self.api.state != "serving":
            raise Rejected(503, f"the server is {self.api.state}")
        run = ChatRun(self.api, body)
        try:
            if body.get("stream"):
                self._stream(run, bool((body.get("stream_options") or {}).get("include_usage")))
            else:
                self._complete(run)
        finally:
            run.close()

    def _complete(self, run: ChatRun) -> None:
        reasoning, content, calls = [], [], []
        for kind, payload in run.events():
            {"reasoning": reasoning, "content": content, "tool": calls}[kind].append(payload)
        message = {"role": "assistant",
                   "content": "".join(content) if content or not calls else None,
                   "reasoning_content": "".join(reasoning) if reasoning else None,
                   "tool_calls": [_tool_json(i, c) for i, c in enumerate(calls)] or None}
        self._send(200, {"id": run.rid, "object": "chat.completion", "created": int(self.api.wall_clock()),
                         "model": run.model,
                         "choices": [{"index": 0, "message": message, "logprobs": None,
                                      "finish_reason": run.finish_reason, "matched_stop": None}],
                         "usage": run.usage()})

    def _stream(self, run: ChatRun, include_usage: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        created = int(self.api.wall_clock())

        def chunk(delta: dict, finish: str | None = None, usage: dict | None = None,
                  choices: bool = True) -> None:
            body = {"id": run.rid, "object": "chat.completion.chunk", "created": created, "model": run.model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                                 "matched_stop": None}] if choices else [],
                    "usage": usage}
            self._write_chunk(b"data: " + json.dumps(body).encode() + b"\n\n")

        first, calls = True, 0
        for kind, payload in run.events():
            if first:
                chunk({"role": "assistant", "content": ""})
                first = False
            if kind == "tool":
                chunk({"tool_calls": [_tool_json(calls, payload)]})
                calls += 1
            else:
                chunk({"reasoning_content" if kind == "reasoning" else "content": payload})
        if first:
            chunk({"role": "assistant", "content": ""})
        chunk({}, run.finish_reason)
        if include_usage:
            chunk({}, usage=run.usage(), choices=False)
        self._write_chunk(b"data: [DONE]\n\n")
        self._write_chunk(b"")

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()


def make_handler(state: ApiState) -> type[BaseHTTPRequestHandler]:
    return type("BoundHandler", (Handler,), {"api": state})


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def serve(state: ApiState, host: str, port: int) -> Server:
    """Binds and starts serving in a background thread; OSError when the address cannot be bound."""
    server_class: type[Server] = Server
    if ":" in host:
        server_class = type("Server6", (Server,), {"address_family": socket.AF_INET6})
    server = server_class((host, port), make_handler(state))
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    return server
