"""Who holds the memory and who is about to allocate it: the guard's victims by contribution.

Pure functions over rank 0's in-flight list (its scheduler's view: adapter/inflight.py) and a
model of what a request costs, per rank (MEMORY_GUARD_TOKEN_BYTES, MEMORY_GUARD_TRANSIENT_BYTES,
CHUNKED_PREFILL_SIZE, DSV41_PREFILL_EMPTY_CACHE_TOKENS):
- a request's KV grows by token_bytes per prefilled token and is held until it ends; ended (or
  aborted), it stays with the process, where the next allocations reuse it (SGLang's KV pool: the
  next requests' KV alone; the stand-in's caching allocator by default: anything): aborting a
  request stops its growth and leaves what it held to the others, it does not give memory back;
- each prefill chunk of c tokens at prefix p (this chunk included) needs transient_bytes x c x p
  for the indexer's buffers. With the prefill_empty_cache hook (the prompt at least its
  threshold) that is returned after the chunk, so a request's peak is its last chunk's; without
  it every larger chunk takes new memory and the allocator keeps the old blocks;
- a waiting request holds nothing yet; its projected peak follows from its prompt.

The requests still to run are projected as if all were held at once (SGLang prefills one at a
time, and a finished prompt decodes for as long as its client wants): the lowest point is the
available memory now, minus everything the kept requests are still to allocate, plus what the
aborted ones leave to them. The guard aborts the fewest requests that keep that point above the
guard, preferring the one now growing; it never aborts by a rid that is a prefix of another
request's (SGLang's scheduler aborts every rid that starts with the one given).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterable

from .projection import Projection, projected_low

WAITING, PREFILLING, DECODING = "waiting", "prefilling", "decoding"
# With more requests in flight than this, sets of more than two victims are grown greedily: each
# projection steps the whole queue through the allocator, and there are n-choose-k sets of k.
EXHAUSTIVE_UP_TO = 8


@dataclass(frozen=True)
class InflightRequest:
    rid: str
    prompt_tokens: int
    prefilled_tokens: int
    age_s: float = 0.0
    state: str | None = None   # None: the route had no scheduler view (an older adapter)
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


@dataclass(frozen=True)
class InflightList:
    requests: tuple[InflightRequest, ...] = ()
    unavailable: str = ""   # why there is no list (route missing, rank 0 not answering); "" when there is
    # When the step it lists was launched (its memory taken), on rank 0's host's CLOCK_MONOTONIC;
    # None while it is not, or when the route does not say.
    step_launched_at: float | None = None
    # The most KV pool slots (tokens) rank 0's requests have held at once so far: the pool's
    # memory covers them, ended requests' slots included; None when the route does not say.
    kv_high_water_tokens: int | None = None

    @property
    def scheduler_view(self) -> bool:
        """Every entry says what it does (the route read rank 0's scheduler)."""
        return bool(self.requests) and all(r.state is not None for r in self.requests)


@dataclass(frozen=True)
class CostModel:
    token_bytes: int = 0          # KV per prompt token, per rank
    transient_bytes: float = 0.0  # per (chunk token x prefix token) of a prefill chunk
    chunk_tokens: int = 8192      # CHUNKED_PREFILL_SIZE (-1: a prompt is prefilled at once)
    empty_cache_tokens: int = 0   # the prefill_empty_cache hook's threshold (0: off)
    # The ranks' admission gate (MEMORY_GUARD_ADMISSION=1: adapter/admission_gate.py): a new
    # request's first step waits while it would leave less than this; 0: no gate.
    admission_guard_bytes: int = 0
    # The KV in a pool of slots, as SGLang keeps it (projection.py): reused by later KV alone, its
    # memory never given back; False: in the caching allocator (the stand-in's default).
    kv_pool: bool = False
    # Its slots (MAX_TOTAL_TOKENS, --max-total-tokens; 0: no limit): a request not yet started
    # waits while its rest would not fit in the free ones (projection.py, SGLang's PrefillAdder).
    kv_pool_tokens: int = 0

    @property
    def configured(self) -> bool:
        """Whether there is a cost to project with (MEMORY_GUARD_TOKEN_BYTES or _TRANSIENT_BYTES)."""
        return self.token_bytes > 0 or self.transient_bytes > 0

    def chunk_of(self, r: InflightRequest) -> int:
        """The tokens a prefill chunk of `r` takes (its whole prompt when prefill is not chunked)."""
        return r.prompt_tokens if self.chunk_tokens <= 0 else self.chunk_tokens

    def hooked(self, r: InflightRequest) -> bool:
        return 0 < self.empty_cache_tokens <= r.prompt_tokens

    def held(self, r: InflightRequest) -> int:
        """KV the request holds now (what it leaves in the allocator when aborted)."""
        if r.waiting:
            return 0
        return self.token_bytes * max(0, r.prefilled_tokens - r.cached_tokens)

    def kv_to_come(self, r: InflightRequest) -> int:
        return self.token_bytes * r.remaining_tokens

    def transient_peak(self, r: InflightRequest) -> int:
        """The indexer buffers its remaining chunks need at their largest: the last chunk's with
        the hook, all of them (each larger than any block the allocator keeps) without it."""
        left = r.remaining_tokens
        if not left or not self.transient_bytes:
            return 0
        chunk = self.chunk_of(r)
        if self.hooked(r):
            last = min(chunk, r.prompt_tokens)
            return int(self.transient_bytes * last * r.prompt_tokens)
        total, prefix = 0.0, r.prefilled_tokens
        while prefix < r.prompt_tokens:
            take = min(chunk, r.prompt_tokens - prefix)
            prefix += take
            total += self.transient_bytes * take * prefix
        return int(total)

    def to_come(self, r: InflightRequest) -> int:
        return self.kv_to_come(r) + self.transient_peak(r)


@dataclass(frozen=True)
class Victim:
    request: InflightRequest
    why: str            # growing | cannot_fit | holds | unblocks
    charged_bytes: int  # what it holds plus what it is still to allocate


@dataclass(frozen=True)
class Choice:
    victims: tuple[Victim, ...]
    projected_low: int                    # with the victims aborted
    projected_low_keeping_all: int
    skipped: tuple[tuple[str, str], ...]  # (rid, why it cannot be aborted by its rid)
    needed: bool                          # keeping every request, the projected low is below the guard
    explained: bool                       # the victims keep the projected low above the guard
    then: tuple[InflightRequest, ...] = ()  # to abort once the victims (their rid's other matches) are gone


def prefix_conflicts(requests: Iterable[InflightRequest]) -> dict[str, list[str]]:
    """rid -> the other in-flight rids an /abort_request of it would also end."""
    rids = [r.rid for r in requests]
    out = {}
    for rid in rids:
        others = [o for o in rids if o != rid and o.startswith(rid)]
        if others:
            out[rid] = others
    return out


def growing(requests: Iterable[InflightRequest]) -> list[InflightRequest]:
    """Requests allocating now: the chunk-prefilled one (its chunk is running), or, without the
    scheduler's view, every request still short of its prompt."""
    reqs = list(requests)
    if reqs and all(r.state is not None for r in reqs):
        return [r for r in reqs if r.prefilling and (r.chunk_tokens > 0 or r.remaining_tokens > 0)]
    return [r for r in reqs if r.prefilling]


def projection_of(inflight: InflightList, level: int, model: CostModel, running_in_level: bool) -> Projection:
    """The listed requests' allocator and KV pool replayed from the listing (with the pool's
    high-water mark it gives), to project from."""
    return Projection(level, inflight.requests, model, running_in_level, inflight.kv_high_water_tokens)


def held_back(inflight: InflightList, level: int, model: CostModel, exclude: Iterable[str] = (),
              running_in_level: bool = False) -> set[str]:
    """The waiting requests the ranks hold back at the next step: by their admission gate, or for
    KV pool slots (none without either, or with nothing waiting)."""
    if (model.admission_guard_bytes <= 0 and not (model.kv_pool and model.kv_pool_tokens > 0)) \
            or not any(r.waiting for r in inflight.requests):
        return set()
    skip = set(exclude)
    live = [r for r in inflight.requests if r.rid not in skip]
    gone = [r for r in inflight.requests if r.rid in skip]
    return projection_of(inflight, level, model, running_in_level).held_at_next_step(live, gone)


def choose(inflight: InflightList, level: int, guard_bytes: int, model: CostModel,
           exclude: Iterable[str] = (), max_victims: int = 8, running_in_level: bool = False) -> Choice:
    """The fewest aborts that keep the projected low at or above the guard, preferring sets that
    hold the request now growing, then those that leave the most; requests already aborted
    (`exclude`) count as aborted. A request whose rid is a prefix of others' can only go after
    them: a set holding it costs those too, which are the victims now (`then` holds it for the
    next decision). When keeping every request already stays above the guard there are no
    victims (`needed` False: the caller decides whether to trust that). When no set of up to
    max_victims is enough, the victims are the growing requests (they explain the fall the guard
    saw) and `explained` is False."""
    skip = set(exclude)
    live = [r for r in inflight.requests if r.rid not in skip]
    gone = [r for r in inflight.requests if r.rid in skip]
    by_rid = {r.rid: r for r in live}
    conflicts = {rid: [by_rid[o] for o in others if o in by_rid]
                 for rid, others in prefix_conflicts(inflight.requests).items() if rid in by_rid}
    conflicts = {rid: others for rid, others in conflicts.items() if others}
    skipped = tuple((rid, f"/abort_request {rid!r} would also end {', '.join(o.rid for o in others)}")
                    for rid, others in sorted(conflicts.items()))
    grow = {r.rid for r in growing(live)}
    projection = projection_of(inflight, level, model, running_in_level)  # replayed once, for every set
    keep_all = projection.low(live, gone)

    def expanded(chosen: tuple[InflightRequest, ...]) -> tuple[InflightRequest, ...]:
        out = list(chosen)
        for r in chosen:
            out += [o for o in conflicts.get(r.rid, ()) if o not in out]
        return tuple(out)

    lows: dict[frozenset[str], int] = {}  # a set is ranked after it is tried: project it once

    def low_without(victims: Iterable[InflightRequest]) -> int:
        victims = list(victims)
        key = frozenset(r.rid for r in victims)
        if key not in lows:
            lows[key] = projection.low([r for r in live if r not in victims], gone + victims)
        return lows[key]

    def rank(chosen: tuple[InflightRequest, ...]) -> tuple:
        return (len(expanded(chosen)), not any(v.rid in grow for v in chosen), -low_without(expanded(chosen)),
                sum(v.age_s for v in chosen))  # younger first: less sunk work

    if keep_all >= guard_bytes:
        return Choice((), keep_all, keep_all, skipped, needed=False, explained=True)
    best: tuple[InflightRequest, ...] | None = None
    for k in range(1, min(max_victims, len(live)) + 1):
        sets = [c for c in itertools.combinations(live, k) if low_without(expanded(c)) >= guard_bytes]
        if sets:
            best = min(sets, key=rank)
            break
        if len(live) > EXHAUSTIVE_UP_TO and k >= 2:
            best = _greedy(live, lambda c: low_without(expanded(c)), guard_bytes, max_victims)  # a long queue
            break
    explained = best is not None
    if best is None:
        # Nothing short of the model's answer: the fall the guard measured comes from what grows.
        best = tuple(r for r in live if r.rid in grow)
    total = expanded(best)
    later = tuple(r for r in total if r.rid in conflicts)  # after the requests their rid would also end
    return Choice(victims_of([r for r in total if r not in later], grow, model, blockers=conflicts, later=later),
                  low_without(total), keep_all, skipped, needed=True, explained=explained, then=later)


def growing_choice(inflight: InflightList, level: int, model: CostModel, exclude: Iterable[str] = (),
                   running_in_level: bool = False) -> Choice:
    """The requests now growing as victims (those whose rid is a prefix of others' after them)."""
    skip = set(exclude)
    live = [r for r in inflight.requests if r.rid not in skip]
    by_rid = {r.rid: r for r in live}
    conflicts = {rid: [by_rid[o] for o in others if o in by_rid]
                 for rid, others in prefix_conflicts(inflight.requests).items() if rid in by_rid}
    grow = growing(live)
    later = tuple(r for r in grow if conflicts.get(r.rid))
    now = [r for r in grow if r not in later] + [o for r in later for o in conflicts[r.rid] if o not in grow]
    gone = [r for r in inflight.requests if r.rid in skip]
    kept = [r for r in live if r not in now and r not in later]
    projection = projection_of(inflight, level, model, running_in_level)
    low = projection.low(kept, gone + now + list(later))
    return Choice(victims_of(now, {r.rid for r in grow}, model, blockers=conflicts, later=later), low,
                  projection.low(live, gone), (), needed=False, explained=False,
                  then=later)


def victims_of(requests: Iterable[InflightRequest], grow: set[str], model: CostModel,
               blockers: dict | None = None, later: Iterable[InflightRequest] = ()) -> tuple[Victim, ...]:
    """The requests as victims, the growing ones first, then the waiting, then the oldest. One
    aborted only so that a request whose rid is a prefix of its own can follow is "unblocks"."""
    unblocking = {o.rid for r in later for o in (blockers or {}).get(r.rid, ())}
    return tuple(Victim(r, "unblocks" if r.rid in unblocking else _why(r, grow), model.held(r) + model.to_come(r))
                 for r in sorted(requests, key=lambda r: (r.rid not in grow, not r.waiting, -r.age_s)))


def _greedy(candidates, low_without, guard_bytes, max_victims):
    chosen: tuple = ()
    while len(chosen) < max_victims:
        rest = [r for r in candidates if r not in chosen]
        if not rest:
            return None
        chosen = chosen + (max(rest, key=lambda r: low_without(chosen + (r,))),)
        if low_without(chosen) >= guard_bytes:
            return chosen
    return None


def _why(r: InflightRequest, grow: set[str]) -> str:
    if r.rid in grow:
        return "growing"
    if r.waiting:
        return "cannot_fit"
    return "holds"
