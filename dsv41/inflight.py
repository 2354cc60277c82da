"""The in-flight listing: what rank 0 serves at GET /dsv41/inflight and the memory guard reads.

One definition for both sides (standard library only): the rank encodes it (adapter/inflight.py), the
coordinator's guard parses it (coordinator/guard/engine.py); the stand-in (sim/api.py) serves
the same schema.

    GET /dsv41/inflight  ->  200, Content-Type: application/json
    {"requests": [{"rid": "chat-17", "prompt_tokens": 5120, "prefilled_tokens": 5120, "age_s": 3.25,
                   "state": "decoding", "cached_tokens": 0, "chunk_tokens": 0, "output_tokens": 212}, ...],
     "source": "scheduler", "scheduler_age_s": 0.012,
     "step_launched_monotonic_s": 81234.567891, "kv_pool_high_water_tokens": 412032}

A request's fields (oldest first; finished requests are not listed):
    rid               str    SGLang's request id, what POST /abort_request {"rid": ...} takes
    prompt_tokens     int    tokens of the tokenized prompt; 0 until tokenization has finished
    prefilled_tokens  int    prompt tokens in its KV so far (prefix-cache hits included; waiting:
                             its prefix-cache match)
    age_s             float  seconds since it arrived
    state             str    waiting | prefilling | decoding; absent without the scheduler's view
    cached_tokens     int    prompt tokens served from the prefix cache
    chunk_tokens      int    its tokens in the prefill step now launched (0: none)
    output_tokens     int    tokens generated so far
The listing's: "source" (scheduler | tokenizer_manager), "scheduler_age_s",
"step_launched_monotonic_s" (when the listed step was launched, on rank 0's host's
CLOCK_MONOTONIC; null while it is not), "kv_pool_high_water_tokens" (the most KV pool slots held
at once so far; null when not known), "scheduler_problem" (why the scheduler's view is missing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

PATH = "/dsv41/inflight"
WAITING, PREFILLING, DECODING = "waiting", "prefilling", "decoding"
STATES = (WAITING, PREFILLING, DECODING)
SOURCE = "tokenizer_manager"   # only the tokenizer side's view: the first four fields
SCHEDULER_SOURCE = "scheduler"


@dataclass(frozen=True)
class InflightRequest:
    rid: str
    prompt_tokens: int
    prefilled_tokens: int
    age_s: float = 0.0
    state: str | None = None   # None: the route had no scheduler view
    cached_tokens: int = 0
    chunk_tokens: int = 0      # its tokens in the prefill step now running
    output_tokens: int = 0

    @property
    def prefilling(self) -> bool:
        if self.state is not None:
            return self.state == PREFILLING
        return self.prefilled_tokens < self.prompt_tokens

    @property
    def waiting(self) -> bool:
        return self.state == WAITING

    @property
    def remaining_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.prefilled_tokens)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rid": self.rid, "prompt_tokens": self.prompt_tokens,
                               "prefilled_tokens": self.prefilled_tokens, "age_s": self.age_s}
        if self.state is not None:
            out.update(state=self.state, cached_tokens=self.cached_tokens, chunk_tokens=self.chunk_tokens,
                       output_tokens=self.output_tokens)
        return out


@dataclass(frozen=True)
class InflightList:
    requests: tuple[InflightRequest, ...] = ()
    unavailable: str = ""   # why there is no list (route missing, rank 0 not answering); "" when there is
    step_launched_at: float | None = None    # step_launched_monotonic_s
    kv_high_water_tokens: int | None = None  # kv_pool_high_water_tokens

    @property
    def scheduler_view(self) -> bool:
        """Every entry says what it does (the route read rank 0's scheduler)."""
        return bool(self.requests) and all(r.state is not None for r in self.requests)


def payload(requests: Iterable[InflightRequest], source: str = SOURCE, **extra: Any) -> dict[str, Any]:
    """The route's JSON body for these requests (`extra`: the listing's other fields)."""
    return {"requests": [r.as_json() for r in requests], "source": source, **extra}


def _request(item: object) -> InflightRequest:
    if not isinstance(item, dict) or not isinstance(item.get("rid"), str):
        raise ValueError(f"request entry without a string rid: {item!r}")
    state = item.get("state")
    if state is not None and state not in STATES:
        raise ValueError(f"request {item['rid']!r}: state {state!r} is not one of {', '.join(STATES)}")
    return InflightRequest(item["rid"], int(item.get("prompt_tokens", 0)), int(item.get("prefilled_tokens", 0)),
                           float(item.get("age_s", 0.0)), state, int(item.get("cached_tokens", 0)),
                           int(item.get("chunk_tokens", 0)), int(item.get("output_tokens", 0)))


def parse(body: object) -> InflightList:
    """The route's JSON as an InflightList; ValueError (or TypeError, KeyError) when it is not one."""
    if not isinstance(body, dict) or not isinstance(body.get("requests"), list):
        raise ValueError("expected an object with a list under 'requests'")
    requests = tuple(_request(item) for item in body["requests"])
    launched = body.get("step_launched_monotonic_s")
    if launched is not None and (isinstance(launched, bool) or not isinstance(launched, (int, float))):
        raise ValueError(f"step_launched_monotonic_s {launched!r} is not a number")
    high = body.get("kv_pool_high_water_tokens")
    if high is not None and (isinstance(high, bool) or not isinstance(high, int) or high < 0):
        raise ValueError(f"kv_pool_high_water_tokens {high!r} is not a whole number of tokens")
    return InflightList(requests, step_launched_at=None if launched is None else float(launched),
                        kv_high_water_tokens=high)
