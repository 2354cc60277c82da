"""How fast rank 0's scheduler prefills, from the in-flight listings the guard is given.

The cost model says how much a prefill takes; the listings say, whatever the model says, how many
tokens each prefilling request gained since the guard first saw it prefilling, and so when a
prefill ends. The guard uses it where it does not trust the model (memory close to running out):
a fall that is the prefills' ends when the last of those queued does (one request is prefilled at
a time, at about the same speed), not where the trend's line goes.

Pure: listings and the coordinator's clock in, tuples out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from dsv41.inflight import InflightList

# How much sooner than memory would run out a prefill must be seen to end for the guard to wait for
# it: the fall may speed up before the end (a chunk's indexer buffers grow with its prefix) and the
# prefill slow down (attention over a longer prefix).
END_MARGIN = 2.0


@dataclass(frozen=True)
class Sighting:
    """A request first seen prefilling: when, and how many tokens it had prefilled then."""
    rid: str
    at: float
    prefilled: int


def track(seen: tuple[Sighting, ...], inflight: InflightList, now: float) -> tuple[Sighting, ...]:
    """The first sighting of each request prefilling in this listing. A rid listed with fewer
    tokens than at its sighting is a new request reusing it: seen anew."""
    if inflight.unavailable:
        return seen
    before = {x.rid: x for x in seen}
    out = []
    for r in inflight.requests:
        if not r.prefilling or r.state is None:
            continue
        first = before.get(r.rid)
        out.append(first if first is not None and first.prefilled <= r.prefilled_tokens
                   else Sighting(r.rid, now, r.prefilled_tokens))
    return tuple(out)


@dataclass(frozen=True)
class Ending:
    """When the prefills growing now end, at the speed seen; `why` when that cannot be told."""
    seconds: float | None
    tokens_per_s: float = 0.0
    why: str = ""


def prefills_end(seen: tuple[Sighting, ...], inflight: InflightList, now: float, min_span_s: float,
                 aborted: Iterable[str] = ()) -> Ending:
    """How long until the requests prefilling have prefilled the rest of their prompts, and the
    requests waiting theirs after them, at the tokens per second the slowest of those prefilling
    gained since its sighting. Not told (seconds None) while a prefix-cache hit waits (its first
    step takes the buffers over its cached prefix at once, a step no rate foresees), none
    prefills (a fall then is not a prefill's), or a prefill was seen too briefly (less than
    min_span_s, or no token gained: it may be stalled)."""
    gone = set(aborted)
    live = [r for r in inflight.requests if r.rid not in gone]
    if inflight.unavailable or not inflight.scheduler_view:
        return Ending(None, why="no scheduler view")
    # Rank 0 lists a waiting hit with its match (the adapter matches each waiting request;
    # SGLang under fcfs would only at its first step). Where that match failed the hit is listed
    # as a cold prompt: then it is not excluded here, its whole prompt counts in the time below
    # (longer), and the cost model charges it a cold prompt's KV.
    hit = next((r for r in live if r.waiting and r.cached_tokens), None)
    if hit is not None:
        # its first step takes the buffers over its whole cached prefix at once: not a rate
        return Ending(None, why=f"{hit.rid}, a prefix-cache hit, waits to start")
    growing = [r for r in live if r.prefilling]
    if not growing:
        return Ending(None, why="no request is prefilling")
    first = {x.rid: x for x in seen}
    slowest = math.inf
    for r in growing:
        x = first.get(r.rid)
        span = now - x.at if x is not None else 0.0
        gained = r.prefilled_tokens - x.prefilled if x is not None else 0
        if span < min_span_s or gained <= 0:
            return Ending(None, why=f"{r.rid}'s prefill was not seen progressing for {min_span_s:g} s")
        slowest = min(slowest, gained / span)
    # The scheduler prefills one request at a time: the queue behind them follows at the same speed.
    tokens = sum(r.remaining_tokens for r in growing) + \
        sum(max(0, r.prompt_tokens - r.cached_tokens) for r in live if r.waiting)
    return Ending(tokens / slowest, slowest)


def ends_in_time(end: Ending, exhaust_s: float | None) -> bool:
    """The prefills end within 1 / END_MARGIN of the time memory would last at the rate it falls."""
    return end.seconds is not None and exhaust_s is not None and end.seconds * END_MARGIN < exhaust_s
