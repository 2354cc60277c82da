"""The aborts after they are sent: what fresh listings confirm, the aborts that waited for
others, the rids reused, and whether a hold's projection was broken (pure)."""

from __future__ import annotations

import math
from typing import Iterable

from dsv41.inflight import DECODING, InflightList

from . import charge
from .kinds import Basis, Kind, Why
from .settings import GuardSettings
from .state import RECENT, Confirmation, Decision, GuardState
from .trend import Assessment
from .wording import gb


def confirm(s: GuardSettings, state: GuardState, inflight: InflightList, now: float,
            asked: Iterable[str] | None = None) -> tuple[Confirmation, GuardState]:
    """Checks the aborts sent against a fresh listing. A victim may be listed for up to a chunk;
    still listed past confirm_s it did not take effect (reported once) and stays pending.
    `asked`: the rids pending when the listing was asked for (None: all); a victim chosen while it
    was on its way may have arrived after it, and its absence there says nothing."""
    ab = state.aborts
    if not ab.pending or inflight.unavailable:
        return Confirmation((), ()), state
    listed = {r.rid for r in inflight.requests}
    judged = set(ab.pending) if asked is None else set(asked)
    gone = tuple(rid for rid in ab.pending if rid not in listed and rid in judged)
    still = tuple(rid for rid in ab.pending if rid not in gone)
    overdue = tuple(rid for rid in still if rid in listed) \
        if now - ab.pending_since >= s.confirm_s and not ab.overdue_reported else ()
    return Confirmation(gone, overdue), state.evolve(pending=still, gone=(*ab.gone, *gone)[-RECENT:],
                                                     overdue_reported=ab.overdue_reported or bool(overdue))


def forget_reused(state: GuardState, inflight: InflightList) -> GuardState:
    """An aborted rid that was seen gone and is listed again is a new request under the same rid:
    no longer counted as aborted nor as judged at the last action."""
    if not state.aborts.gone or inflight.unavailable:
        return state
    back = set(state.aborts.gone) & {r.rid for r in inflight.requests}
    if not back:
        return state
    return state.evolve(aborted=tuple(r for r in state.aborts.aborted if r not in back),
                        gone=tuple(r for r in state.aborts.gone if r not in back),
                        acted_rids=tuple(r for r in state.action.acted_rids if r not in back))


def _queued_victims(st: GuardState, inflight: InflightList):
    """(rids to abort now, their reasons, the queue left, whether they are the queued ones)."""
    listed = {r.rid: r for r in inflight.requests}
    conflicts = charge.prefix_conflicts(inflight.requests)
    ready = [rid for rid in st.aborts.queued if rid in listed and rid not in conflicts]
    if ready:
        whys = [Why.GROWING if listed[rid].prefilling else Why.CANNOT_FIT for rid in ready]
        return ready, whys, tuple(rid for rid in st.aborts.queued if rid not in ready), True
    queued = tuple(rid for rid in st.aborts.queued if rid in listed)
    # A request whose rid starts with a queued one arrived after the abort that was to unblock it:
    # it goes first, by its own rid (one that is itself no other's prefix, longest first).
    rids = sorted({o for rid in queued for o in conflicts.get(rid, ()) if o not in conflicts},
                  key=lambda rid: (-len(rid), rid))
    return rids, [Why.UNBLOCKS] * len(rids), queued, False


def release_queued(s: GuardSettings, st: GuardState, inflight: InflightList, now: float,
                   node: str) -> tuple[Decision | None, GuardState]:
    """The aborts that waited for the requests their rid would also have ended: once those are
    gone, each one still listed is aborted by its own rid (if no other rid starts with it now)."""
    if not st.aborts.queued or st.aborts.pending or inflight.unavailable:
        return None, st
    rids, whys, queued, ready = _queued_victims(st, inflight)
    if not rids:
        return None, st.evolve(queued=queued)
    listed = {r.rid: r for r in inflight.requests}
    victims = tuple(charge.Victim(listed[rid], why, s.cost.held(listed[rid]) + s.cost.to_come(listed[rid]))
                    for rid, why in zip(rids, whys))
    if ready:
        reason = (f"aborting {', '.join(rids)} now that the requests its rid would also have ended are gone; "
                  + "; ".join(f"{v.request.rid} charged {gb(v.charged_bytes)}" for v in victims))
    else:
        reason = (f"aborting {', '.join(rids)} first: it arrived after the abort that was to let "
                  f"{', '.join(queued)} be aborted by its own rid, which would also end it")
    d = Decision(Kind.ABORT, node, reason, dict(st.action.acted_levels).get(node, 0), guard_bytes=s.guard_bytes,
                 basis=Basis.MODEL, victims=victims)
    return d, st.evolve(queued=queued, aborted=(*st.aborts.aborted, *rids)[-RECENT:], pending=tuple(rids),
                        pending_since=now, overdue_reported=False)


def arrived_growing(st: GuardState, inflight: InflightList) -> list[str]:
    """The requests growing now that were not in flight at the last action (nor aborted by it)."""
    if inflight.unavailable:
        return []
    before = set(st.action.acted_rids) | set(st.aborts.aborted)
    return [r.rid for r in charge.growing(inflight.requests) if r.rid not in before]


def arrived_since_hold(st: GuardState, inflight: InflightList) -> list[str]:
    held = set(st.trust.hold_rids)
    return [r.rid for r in inflight.requests if r.rid not in held] if not inflight.unavailable else []


def distrust(st: GuardState, inflight: InflightList) -> GuardState:
    """Memory fell below the hold's projection: the model is wrong, unless a request the projection
    did not cover arrived meanwhile (its memory took the level there: the model, asked again with
    it listed, is still to be trusted)."""
    if arrived_since_hold(st, inflight):
        return st.evolve(hold_low=None, hold_until=-math.inf)
    return st.evolve(model_failed=True)


def hold_broken(st: GuardState, a: Assessment, s: GuardSettings) -> bool:
    """Memory went below the lowest point the requests were projected to take it to: the cost
    model is wrong (by half the way to the guard, at most the hysteresis band; a projection within
    the agent's change threshold of the guard, once memory is that far below it)."""
    if st.trust.hold_low is None:
        return False
    above = max(0, st.trust.hold_low - s.guard_bytes)
    slack = max(min(s.hysteresis_bytes, above // 2), min(s.send_change_bytes, above))
    return a.level < st.trust.hold_low - slack


def decoding_only(inflight: InflightList, aborted: Iterable[str] = (), held: Iterable[str] = ()) -> bool:
    """Every request listed (but those aborted) decodes, by the scheduler's word, or waits where
    the ranks hold it back (`held`): none of them will allocate more."""
    gone, held = set(aborted), set(held)
    live = [r for r in inflight.requests if r.rid not in gone]
    return inflight.scheduler_view and bool(live) and any(r.state == DECODING for r in live) \
        and all(r.state == DECODING or (r.waiting and r.rid in held) for r in live)


def running_in_level(s: GuardSettings, a: Assessment, inflight: InflightList) -> bool:
    """Whether the level was sampled after the step the list shows running was launched: only
    rank 0's own node shares the clock the list says it in (CLOCK_MONOTONIC of one host)."""
    return bool(s.rank0_node) and a.node == s.rank0_node and inflight.step_launched_at is not None \
        and a.at >= inflight.step_launched_at
