"""Who holds the memory and who is about to allocate it: the guard's victims by contribution.

Pure functions over rank 0's in-flight list (dsv41/inflight.py) and the cost model
(dsv41/cost.py). The guard aborts the fewest requests that keep the projected low above the
guard, preferring the one now growing; never by a rid that is a prefix of another request's
(SGLang aborts every rid that starts with the one given). How the low is projected:
docs/guard-internals.md.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterable, Protocol

from dsv41.cost import CostModel
from dsv41.inflight import InflightList, InflightRequest

from .additive import AdditiveProjection
from .kinds import Why
from .projection import Projection

# With more requests in flight than this, sets of more than two victims are grown greedily: each
# projection steps the whole queue through the allocator, and there are n-choose-k sets of k.
EXHAUSTIVE_UP_TO = 8


@dataclass(frozen=True)
class Victim:
    request: InflightRequest
    why: Why
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


class Projector(Protocol):
    """What the guard asks of a projection of the listed requests."""
    taken: int  # what the model says the listed requests hold from the system now

    def low(self, kept: Iterable[InflightRequest], aborted: Iterable[InflightRequest]) -> int:
        """The lowest available memory ahead if `kept` run to the end of their prefill and `aborted`
        end at the next step boundary."""

    def held_at_next_step(self, kept: Iterable[InflightRequest], aborted: Iterable[InflightRequest]) -> set[str]:
        """The waiting requests the ranks hold back at the next step (admission gate, KV pool slots)."""


def projector(inflight: InflightList, level: int, model: CostModel, running_in_level: bool) -> Projector:
    """The guard's one seam to the byte-exact allocator replay (projection.py): every projected
    low, hold-back and account goes through here. The listed requests' allocator and KV pool are
    replayed from the listing (with the pool's high-water mark it gives), to project from."""
    kind = Projection if model.replay else AdditiveProjection  # or each request's bytes summed (additive.py)
    return kind(level, inflight.requests, model, running_in_level, inflight.kv_high_water_tokens)


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
    return projector(inflight, level, model, running_in_level).held_at_next_step(live, gone)


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
    projection = projector(inflight, level, model, running_in_level)  # replayed once, for every set
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
    projection = projector(inflight, level, model, running_in_level)
    low = projection.low(kept, gone + now + list(later))
    return Choice(victims_of(now, {r.rid for r in grow}, model, blockers=conflicts, later=later), low,
                  projection.low(live, gone), (), needed=False, explained=False,
                  then=later)


def victims_of(requests: Iterable[InflightRequest], grow: set[str], model: CostModel,
               blockers: dict | None = None, later: Iterable[InflightRequest] = ()) -> tuple[Victim, ...]:
    """The requests as victims, the growing ones first, then the waiting, then the oldest. One
    aborted only so that a request whose rid is a prefix of its own can follow is "unblocks"."""
    unblocking = {o.rid for r in later for o in (blockers or {}).get(r.rid, ())}
    return tuple(Victim(r, Why.UNBLOCKS if r.rid in unblocking else _why(r, grow), model.held(r) + model.to_come(r))
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


def _why(r: InflightRequest, grow: set[str]) -> Why:
    if r.rid in grow:
        return Why.GROWING
    if r.waiting:
        return Why.CANNOT_FIT
    return Why.HOLDS
