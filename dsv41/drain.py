"""The drain before a restart that can wait, as rank 0 serves it (standard library only).

One definition for both sides: the rank installs it in SGLang's HTTP server (adapter/drain.py), the
stand-in serves it (sim/api.py), the coordinator drives it (coordinator/drain.py).

    POST   /dsv41/drain  {"reason": "..."}  ->  200 {"draining": true, "reason": "...", "since_s": 0.0}
                                                 (400 without a non-empty string reason)
    DELETE /dsv41/drain                     ->  200 {"draining": false}   (admits new requests again)
    GET    /dsv41/drain                     ->  200 {"draining": ..., "reason": ..., "since_s": ...}

While draining, a new request (POST or PUT to one of REFUSED_PATHS) gets

    503, Retry-After: RETRY_AFTER_S
    {"error": {"message": "rank 0 is draining for a restart: <reason>; retry after it (...)",
               "type": "service_unavailable", "code": 503}}

and what is already in flight goes on to its end; GET /dsv41/inflight (dsv41/inflight.py) shows
how much is left. Everything else stays open: /health and /health_generate answer as before (the
engine is healthy, it only refuses work by policy: the coordinator's canary and a monitoring probe
must not call the cluster broken during a drain; a balancer that wants to route away reads GET
/dsv41/drain), and so do /metrics, /abort_request, /v1/models, /dsv41/*. The routes sit behind
SGLang's API key like every other one. The state lives in rank 0's HTTP process only: a restart
ends it, and so does DELETE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PATH = "/dsv41/drain"
# The routes that hand the scheduler new work in SGLang 0.5.23's http_server (their default paths:
# SGLANG_OLLAMA_*_ROUTE and AIP_PREDICT_ROUTE can move the last three). Token counting, tokenize,
# the model list and the admin routes do no generation and stay open.
REFUSED_PATHS = frozenset({
    "/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
    "/invocations", "/encode", "/classify", "/v1/embeddings", "/v1/classify", "/v1/rerank", "/v1/score",
    "/v1/decisions", "/v1/systemone", "/api/chat", "/api/generate", "/vertex_generate",
})
REFUSED_METHODS = frozenset({"POST", "PUT"})
RETRY_AFTER_S = 60  # a restart of the group takes about a minute once the drain is over
ERROR_TYPE = "service_unavailable"
# SGLang's own health check sends requests with this rid prefix: not a client's request to wait for.
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"
MAX_REASON_CHARS = 500


@dataclass(frozen=True)
class DrainState:
    reason: str = ""  # "": admitting
    since: float = 0.0  # the server's monotonic clock when it began

    @property
    def draining(self) -> bool:
        return bool(self.reason)

    def as_json(self, now: float) -> dict[str, Any]:
        if not self.draining:
            return {"draining": False}
        return {"draining": True, "reason": self.reason, "since_s": round(max(0.0, now - self.since), 3)}


def refuses(state: DrainState, method: str, path: str) -> bool:
    """Whether this request is a new one the drain turns away."""
    return state.draining and method.upper() in REFUSED_METHODS and path.rstrip("/") in REFUSED_PATHS


def refusal_message(reason: str) -> str:
    return (f"rank 0 is draining for a restart: {reason}; retry after it (requests in flight finish first, "
            f"then the cluster restarts; try again in about {RETRY_AFTER_S} s)")


def refusal(reason: str) -> tuple[int, dict[str, str], dict[str, Any]]:
    """The refusal's status, headers and body."""
    body = {"error": {"message": refusal_message(reason), "type": ERROR_TYPE, "code": 503}}
    return 503, {"Retry-After": str(RETRY_AFTER_S)}, body


def parse_reason(body: object) -> str:
    """The reason a POST names; ValueError saying what is wrong otherwise."""
    if not isinstance(body, dict) or not isinstance(body.get("reason"), str) or not body["reason"].strip():
        raise ValueError(f"POST {PATH} takes a JSON object {{\"reason\": \"<why>\"}} with a non-empty reason")
    reason = " ".join(body["reason"].split())
    if len(reason) > MAX_REASON_CHARS:
        raise ValueError(f"the reason is {len(reason)} characters; at most {MAX_REASON_CHARS} are allowed")
    return reason


def answer(state: DrainState, method: str, body: object, now: float) -> tuple[int, DrainState, dict[str, Any]]:
    """One request to PATH: (status, the state after it, the body to send)."""
    method = method.upper()
    if method == "POST":
        try:
            reason = parse_reason(body)
        except ValueError as exc:
            return 400, state, {"error": {"message": str(exc), "type": "invalid_request_error", "code": 400}}
        # A second POST keeps the first one's start: the drain is the same one, its reason the newer.
        new = DrainState(reason, state.since if state.draining else now)
        return 200, new, new.as_json(now)
    if method == "DELETE":
        return 200, DrainState(), {"draining": False}
    return 200, state, state.as_json(now)


def client_rids(rids: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The rids a drain waits for: the listing's, less SGLang's own health checks."""
    return tuple(r for r in rids if not r.startswith(HEALTH_CHECK_RID_PREFIX))
