"""inflight: GET /dsv41/inflight on rank 0's HTTP server, the memory guard's view of the requests.

SGLang has no endpoint listing in-flight requests with their lengths (/v1/loads only has totals).
This route reads the tokenizer manager's request states (`TokenizerManager.rid_to_state`) in rank
0's main process. Schema (the stand-in engine serves the same route with the same schema):

    GET /dsv41/inflight  ->  200, Content-Type: application/json
    {
      "requests": [
        {"rid": "3f2a...", "prompt_tokens": 200000, "prefilled_tokens": 0, "age_s": 41.7},
        {"rid": "chat-17", "prompt_tokens": 5120, "prefilled_tokens": 5120, "age_s": 3.25}
      ],
      "source": "tokenizer_manager"
    }

    rid               str    SGLang's request id, the value POST /abort_request {"rid": ...} takes
                             (an OpenAI request's own "rid" when it sent one)
    prompt_tokens     int    tokens of the tokenized prompt; 0 until tokenization has finished
    prefilled_tokens  int    prompt tokens prefilled so far, as far as rank 0's HTTP process
                             knows: 0 while the prefill runs, prompt_tokens once the first
                             output token has arrived (chunk progress is not reported to it)
    age_s             float  seconds since the request arrived
    Finished requests are not listed. Order: prompt_tokens descending, then age_s descending,
    so the first entry still prefilling is the largest prefill.

If the server's request states cannot be read (still starting, or a multi-tokenizer layout
without them) the route answers 503 with {"error": "..."}. SGLang's --api-key middleware covers
this route like every other: the caller sends the key.

Installed when SGLang imports `sglang.srt.entrypoints.http_server` (its FastAPI `app`); the
prompt length is recorded on each request state in `TokenizerManager._send_one_request` /
`_send_batch_request`, since SGLang keeps prompt ids only when the client asked for them.
DSV41_INFLIGHT_ROUTE=0 switches it off.
"""

from __future__ import annotations

import sys
import time
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from adapter.patching import BEFORE, ON_IMPORT, AdapterSpec, Patch, PatchError
from adapter.settings import env_flag

NAME = "inflight"
# The variables build() reads: dsv41ctl config check reports any other adapter key as no effect.
ENV_KEYS = ("DSV41_INFLIGHT_ROUTE",)
PATH = "/dsv41/inflight"
SOURCE = "tokenizer_manager"
HTTP_SERVER = "sglang.srt.entrypoints.http_server"
TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager"
PROMPT_ATTR = "dsv41_prompt_tokens"


@dataclass(frozen=True)
class InflightRequest:
    rid: str
    prompt_tokens: int
    prefilled_tokens: int
    age_s: float

    def as_json(self) -> dict[str, Any]:
        return {
            "rid": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "prefilled_tokens": self.prefilled_tokens,
            "age_s": self.age_s,
        }


def _token_count(ids: Any) -> int | None:
    if ids is None or isinstance(ids, (str, bytes)):
        return None
    try:
        if len(ids) and isinstance(ids[0], (list, tuple)):
            return None  # a batch of prompts inside one state: not a single request's length
        return len(ids)
    except TypeError:
        return None


def prompt_tokens(state: Any) -> int:
    for value in (
        getattr(state, PROMPT_ATTR, None),
        _token_count(getattr(state, "prompt_token_ids", None)),
        _token_count(getattr(getattr(state, "obj", None), "input_ids", None)),
    ):
        if isinstance(value, int) and value > 0:
            return value
    return 0


def has_output(state: Any) -> bool:
    if getattr(state, "out_list", None) or getattr(state, "output_ids", None):
        return True
    stats = getattr(state, "time_stats", None)
    return bool(getattr(stats, "first_token_time", 0.0) or 0.0)


def age_seconds(state: Any, now: float) -> float:
    created = getattr(getattr(state, "time_stats", None), "created_time", 0.0) or 0.0
    return round(max(0.0, now - created), 3) if created > 0 else 0.0


def snapshot(states: Mapping[str, Any], now: float) -> list[InflightRequest]:
    """The unfinished requests in `states` (rid -> ReqState-like), largest prompt first."""
    out = []
    for rid, state in list(states.items()):
        if getattr(state, "finished", False):
            continue
        prompt = prompt_tokens(state)
        out.append(InflightRequest(str(rid), prompt, prompt if has_output(state) else 0, age_seconds(state, now)))
    out.sort(key=lambda r: (-r.prompt_tokens, -r.age_s, r.rid))
    return out


def payload(requests: Iterable[InflightRequest]) -> dict[str, Any]:
    return {"requests": [r.as_json() for r in requests], "source": SOURCE}


def record_prompt_length(manager: Any, tokenized: Any) -> None:
    states = getattr(manager, "rid_to_state", None)
    state = states.get(getattr(tokenized, "rid", None)) if isinstance(states, Mapping) else None
    count = _token_count(getattr(tokenized, "input_ids", None))
    if state is not None and count:
        setattr(state, PROMPT_ATTR, count)


def states_from_http_server() -> Mapping[str, Any] | None:
    """rank 0's rid_to_state through http_server.get_global_state(), or None if not readable."""
    server = sys.modules.get(HTTP_SERVER)
    getter = getattr(server, "get_global_state", None)
    state = getter() if callable(getter) else None
    manager = getattr(state, "tokenizer_manager", None)
    states = getattr(manager, "rid_to_state", None)
    return states if isinstance(states, Mapping) else None


class InflightRoute:
    def __init__(
        self,
        states: Callable[[], Mapping[str, Any] | None] = states_from_http_server,
        clock: Callable[[], float] = time.perf_counter,  # ReqState times come from perf_counter
    ) -> None:
        self._states = states
        self._clock = clock

    def body(self) -> tuple[int, dict[str, Any]]:
        states = self._states()
        if states is None:
            return 503, {"error": "the tokenizer manager's request states are not available (yet)"}
        return 200, payload(snapshot(states, self._clock()))

    def install(self, app: Any) -> None:
        from starlette.requests import Request
        from starlette.responses import JSONResponse

        async def dsv41_inflight(request: Request) -> JSONResponse:
            status, body = self.body()
            return JSONResponse(body, status_code=status)

        if any(getattr(r, "path", None) == PATH for r in getattr(app, "routes", ())):
            return
        app.add_route(PATH, dsv41_inflight, methods=["GET"], include_in_schema=False)

    def on_http_server(self, module: types.ModuleType) -> None:
        app = getattr(module, "app", None)
        if app is None or not hasattr(app, "add_route"):
            raise PatchError(f"{module.__name__} has no ASGI app with add_route")
        if not callable(getattr(module, "get_global_state", None)):
            raise PatchError(f"{module.__name__} has no get_global_state()")
        self.install(app)

    def before_send_one(self, manager: Any, tokenized: Any, *_args: Any, **_kwargs: Any) -> None:
        record_prompt_length(manager, tokenized)
        return None

    def before_send_batch(self, manager: Any, tokenized_objs: Any, *_args: Any, **_kwargs: Any) -> None:
        for tokenized in tokenized_objs or ():
            record_prompt_length(manager, tokenized)
        return None


def build(env: Mapping[str, str]) -> AdapterSpec | None:
    if not env_flag(env, "DSV41_INFLIGHT_ROUTE", True):
        return None
    route = InflightRoute()
    return AdapterSpec(
        name=NAME,
        state=route,
        detail=f"GET {PATH}",
        patches=(
            Patch(
                TOKENIZER_MANAGER,
                "TokenizerManager._send_one_request",
                BEFORE,
                route.before_send_one,
                params=("self", "tokenized_obj"),
            ),
            Patch(
                TOKENIZER_MANAGER,
                "TokenizerManager._send_batch_request",
                BEFORE,
                route.before_send_batch,
                params=("self", "tokenized_objs"),
            ),
            Patch(HTTP_SERVER, "", ON_IMPORT, route.on_http_server),
        ),
    )
