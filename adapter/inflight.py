"""inflight: GET /dsv41/inflight on rank 0's HTTP server, the memory guard's view of the requests.

SGLang has no endpoint listing in-flight requests with their lengths (/v1/loads only has totals).
The route joins two views. The tokenizer manager's request states (`TokenizerManager.rid_to_state`
in rank 0's HTTP process) say which requests are in flight, their prompt and age: exactly the
rids /abort_request takes. Rank 0's scheduler, a separate process, says what each one does: an
AFTER hook on `Scheduler.get_next_batch_to_run` (adapter/scheduler_requests.py) publishes its
waiting queue, the request being chunk-prefilled and the decoding batch to a shared-memory
snapshot (adapter/reqstate.py), which the route reads without a lock on the scheduler's hot path.
The listing's schema, its record and its encoding are the contract's: dsv41/inflight.py (the
stand-in engine serves the same route with the same schema from its own scheduler).

"source" is "scheduler" when the scheduler's snapshot was read; without one (the scheduler has not
taken a step yet, or its process is gone) it is "tokenizer_manager" and the entries carry only
the first four fields, prefilled_tokens being 0 until the first output token and prompt_tokens
after it. "scheduler_age_s" says how old the snapshot is; "step_launched_monotonic_s" when the
step it lists was launched (`Scheduler.run_batch` returned, so its allocations are made), on rank
0's host's CLOCK_MONOTONIC, null while it is not yet (a memory sample of that host taken later
has the step's buffers in it); "kv_pool_high_water_tokens" the most KV pool slots its requests
held at once in the scheduler's iterations before the listed one (SGLang's allocator: its size
less what is free), so slots whose memory the pool has touched, null when not known;
"scheduler_problem" why it could not be used, when it could not. If the server's request states
cannot be read (still starting, or a multi-tokenizer layout without them) the route answers 503
with {"error": "..."}. SGLang's --api-key middleware covers this route like every other: the
caller sends the key.

Installed when SGLang imports `sglang.srt.entrypoints.http_server` (its FastAPI `app`); the
prompt length is recorded on each request state in `TokenizerManager._send_one_request` /
`_send_batch_request`, since SGLang keeps prompt ids only when the client asked for them.
The same adapter installs rank 0's drain (adapter/drain.py: POST/DELETE/GET /dsv41/drain and the
refusal of new requests while draining), since both are rank 0's routes for the coordinator.
DSV41_INFLIGHT_ROUTE=0 switches both off; DSV41_PROGRESS_DIR moves the snapshot (tests).
"""

from __future__ import annotations

import os
import sys
import time
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from dsv41.drain import PATH as DRAIN_PATH
from dsv41.inflight import PATH, SCHEDULER_SOURCE, InflightRequest, payload

from adapter import reqstate
from adapter.drain import DrainGate
from adapter.patching import AFTER, BEFORE, ON_IMPORT, AdapterSpec, Patch, PatchError
from adapter.scheduler_requests import SchedulerRequests
from dsv41 import rankadapters

NAME = "inflight"
# The variables build() reads: dsv41ctl config check reports any other adapter key as no effect.
ENV_KEYS = rankadapters.BY_NAME[NAME].keys  # every variable build() reads, declared in dsv41
HTTP_SERVER = "sglang.srt.entrypoints.http_server"
TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager"
SCHEDULER = "sglang.srt.managers.scheduler"
PROMPT_ATTR = "dsv41_prompt_tokens"


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
    """The unfinished requests in `states` (rid -> ReqState-like) as the tokenizer side knows
    them, oldest first."""
    out = []
    for rid, state in list(states.items()):
        if getattr(state, "finished", False):
            continue
        prompt = prompt_tokens(state)
        out.append(InflightRequest(str(rid), prompt, prompt if has_output(state) else 0, age_seconds(state, now)))
    out.sort(key=lambda r: (-r.age_s, r.rid))
    return out


def _scheduler_record(rid: str, by_rid: Mapping[str, reqstate.Record],
                      partial: Iterable[reqstate.Record]) -> reqstate.Record | None:
    found = by_rid.get(rid)
    if found is not None:
        return found
    # A rid longer than the record keeps: named by its first bytes and the digest of all of it.
    if not reqstate.is_long(rid):
        return None
    digest = reqstate.rid_digest(rid)
    matches = [r for r in partial if r.digest == digest and rid.startswith(r.rid)]
    return matches[0] if len(matches) == 1 else None


def merge(requests: list[InflightRequest], records: Iterable[reqstate.Record]) -> list[InflightRequest]:
    """The tokenizer side's requests (what is in flight, what /abort_request can name) with what
    the scheduler says each one does. One the scheduler does not list yet (tokenizing, on its way,
    or newer than the snapshot) waits: it holds nothing."""
    records = list(records)
    by_rid = {r.rid: r for r in records if r.complete}
    partial = [r for r in records if not r.complete]
    out = []
    for t in requests:
        r = _scheduler_record(t.rid, by_rid, partial)
        if r is None:
            state = "decoding" if t.prefilled_tokens else "waiting"
            out.append(InflightRequest(t.rid, t.prompt_tokens, t.prefilled_tokens, t.age_s, state))
            continue
        out.append(InflightRequest(t.rid, r.prompt_tokens or t.prompt_tokens, r.prefilled_tokens, t.age_s, r.state,
                                   r.cached_tokens, r.chunk_tokens, r.output_tokens))
    return out


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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SchedulerSnapshot:
    """Rank 0's scheduler's snapshot file, as the HTTP process reads it: None when there is none
    or its writer is gone; Unreadable when it cannot be trusted."""

    def __init__(self, directory: str, tp_rank: int = 0, alive: Callable[[int], bool] = _alive) -> None:
        self.path = reqstate.path_for(tp_rank, directory)
        self._alive = alive

    def __call__(self) -> reqstate.Snapshot | None:
        snap = reqstate.read(self.path)
        return snap if snap is not None and self._alive(snap.pid) else None


class InflightRoute:
    def __init__(
        self,
        states: Callable[[], Mapping[str, Any] | None] = states_from_http_server,
        clock: Callable[[], float] = time.perf_counter,  # ReqState times come from perf_counter
        scheduler: Callable[[], reqstate.Snapshot | None] = lambda: None,
        monotonic_ns: Callable[[], int] = time.monotonic_ns,  # the snapshot's clock
        drain: DrainGate | None = None,  # /dsv41/drain, installed with this route
    ) -> None:
        self._states = states
        self._drain = drain
        self._clock = clock
        self._scheduler = scheduler
        self._monotonic_ns = monotonic_ns

    def body(self) -> tuple[int, dict[str, Any]]:
        states = self._states()
        if states is None:
            return 503, {"error": "the tokenizer manager's request states are not available (yet)"}
        requests = snapshot(states, self._clock())
        try:
            snap = self._scheduler()
        except reqstate.Unreadable as exc:
            return 200, payload(requests, scheduler_problem=str(exc))
        if snap is None:
            return 200, payload(requests)
        age = round(max(0, self._monotonic_ns() - snap.written_ns) / 1e9, 3)
        launched = round(snap.launched_ns / 1e9, 6) if snap.launched_ns else None
        return 200, payload(merge(requests, snap.records), SCHEDULER_SOURCE, scheduler_age_s=age,
                            step_launched_monotonic_s=launched,
                            kv_pool_high_water_tokens=snap.kv_high_water or None)

    def install(self, app: Any) -> None:
        from starlette.requests import Request
        from starlette.responses import JSONResponse

        async def dsv41_inflight(request: Request) -> JSONResponse:
            status, body = self.body()
            return JSONResponse(body, status_code=status)

        if self._drain is not None:
            self._drain.install(app)
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
    if not rankadapters.DSV41_INFLIGHT_ROUTE.read(env):
        return None
    directory = rankadapters.DSV41_PROGRESS_DIR.read(env)
    tracker = SchedulerRequests(directory)
    route = InflightRoute(scheduler=SchedulerSnapshot(directory), drain=DrainGate())
    return AdapterSpec(
        name=NAME,
        state=route,
        detail=f"GET {PATH}, the scheduler's request states in {directory}; {DRAIN_PATH}",
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
            Patch(
                SCHEDULER,
                "Scheduler.get_next_batch_to_run",
                AFTER,
                tracker.after_next_batch,
                params=("self", "running_batch", "last_batch"),
            ),
            Patch(SCHEDULER, "Scheduler.run_batch", AFTER, tracker.after_run_batch, params=("self", "batch")),
        ),
    )
