"""The drain before a restart that can wait (`dsv41ctl restart --drain`, a configuration change).

Restarts are urgent (a rank died, a collective hung, the memory floor: what is in flight cannot
finish, the group is stopped at once) or not (an operator's `restart --drain`, a planned
configuration change). Before one that is not, rank 0 stops admitting new requests (POST
/dsv41/drain with the reason: they get a 503 naming it, dsv41/drain.py), the requests in flight
finish within DRAIN_TIMEOUT_S (GET /dsv41/inflight until it lists none), then the stop and the
bring-up go ahead as always.

The loop runs on the supervisor's thread through its interruptible `wait` and `call` (as a
bring-up step's StepContext does): a `dsv41ctl stop`, another restart or a shutdown preempts the
drain at once (Preempted), and a rank that exits or hangs meanwhile (`broken`) ends it, the
supervisor then taking the urgent path. A rank 0 that does not take the drain (an image without
the route, an HTTP error) is logged and the restart goes ahead without it: a drain never holds a
restart up beyond DRAIN_TIMEOUT_S.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from dsv41.drain import client_rids
from dsv41.inflight import InflightList
from dsv41.journal import EventLog

from .guard.engine import EngineError, EngineUnreachable

OPERATOR_REASON = "dsv41ctl restart --drain"  # what new requests are told during an operator's drained restart
POLL_S = 1.0  # how often the listing is read while draining
CUT_SHOWN = 20  # rids named in a timeout's event; the count says how many in all


class Engine(Protocol):
    def drain(self, reason: str) -> None: ...
    def undrain(self) -> None: ...
    def drain_state(self) -> dict: ...
    def inflight(self) -> InflightList: ...


def lift_stale(engine: Engine, log: EventLog, why: str) -> bool:
    """Lifts a drain no restart follows (a coordinator that ended during one left rank 0 refusing
    every new request); whether there was one. Best effort: a rank 0 that does not answer is left."""
    try:
        state = engine.drain_state()
        if not state.get("draining"):
            return False
        engine.undrain()
    except EngineError as exc:
        log.warning("drain_lift_failed", f"could not ask rank 0 whether it still drains ({exc})")
        return False
    log.warning("drain_lifted", f"rank 0 was still draining ({state.get('reason', '?')}, for "
                f"{float(state.get('since_s', 0.0)):.0f} s) and {why}: it admits new requests again",
                reason=str(state.get("reason", "")))
    return True


class Outcome(enum.StrEnum):
    SKIPPED = "skipped"  # DRAIN_TIMEOUT_S=0
    UNANSWERED = "unanswered"  # rank 0 did not take the drain: restart without it
    DONE = "done"  # nothing left in flight
    TIMEOUT = "timeout"  # DRAIN_TIMEOUT_S went by: what is left is cut by the stop
    LISTING_LOST = "listing_lost"  # rank 0 stopped answering the listing: nothing more to wait for
    BROKEN = "broken"  # a rank exited or hung meanwhile: the urgent path takes over


@dataclass(frozen=True)
class Drained:
    outcome: Outcome
    finished: int = 0  # requests seen in flight during the drain that ended
    seconds: float = 0.0
    left: tuple[str, ...] = ()  # rids still in flight when it ended

    @property
    def nothing_left(self) -> bool:
        """Whether the stop that follows can let rank 0 drain as usual (nothing is being cut)."""
        return not self.left


def verdict(listing: InflightList, elapsed_s: float, timeout_s: float, broken: bool) -> Outcome | None:
    """Whether the drain is over and how; None: go on waiting."""
    if broken:
        return Outcome.BROKEN
    if listing.unavailable:
        return Outcome.LISTING_LOST
    if not client_rids([r.rid for r in listing.requests]):
        return Outcome.DONE
    if elapsed_s >= timeout_s:
        return Outcome.TIMEOUT
    return None


def progress_detail(reason: str, in_flight: int, left_s: float) -> str:
    return (f"draining for a restart ({reason}): {in_flight} request{'s' if in_flight != 1 else ''} in flight, "
            f"new ones refused; restarting in at most {max(0.0, left_s):.0f} s")


class Drainer:
    """One drain of rank 0. `wait(seconds)` and `call(fn)` are the supervisor's (they may raise
    Preempted); `broken()` says whether the group broke meanwhile."""

    def __init__(self, engine: Engine, log: EventLog, *, wait: Callable[[float], None],
                 call: Callable[[Callable[[], Any]], Any], monotonic: Callable[[], float],
                 broken: Callable[[], bool], set_detail: Callable[[str], None] = lambda detail: None,
                 poll_s: float = POLL_S) -> None:
        self._engine = engine
        self._log = log
        self._wait, self._call, self._monotonic = wait, call, monotonic
        self._broken = broken
        self._set_detail = set_detail
        self._poll_s = poll_s

    def run(self, reason: str, timeout_s: float) -> Drained:
        if timeout_s <= 0:
            self._log.info("drain_skipped", f"restarting without a drain ({reason}): DRAIN_TIMEOUT_S=0",
                           reason=reason)
            return Drained(Outcome.SKIPPED)
        try:
            self._call(lambda: self._engine.drain(reason))
        except EngineUnreachable as exc:  # no HTTP server: nothing is served, so nothing to drain
            self._log.info("drain_skipped", f"restarting without a drain ({reason}): rank 0 does not answer "
                           f"({exc})", reason=reason)
            return Drained(Outcome.SKIPPED)
        except EngineError as exc:
            self._log.warning("drain_unavailable", f"rank 0 did not take the drain ({exc}); restarting without "
                              "one: what is in flight is cut", reason=reason)
            return Drained(Outcome.UNANSWERED)
        started = self._monotonic()
        listing = self._call(self._engine.inflight)
        seen = set(client_rids([r.rid for r in listing.requests]))
        self._log.info("drain_started", f"draining for a restart ({reason}): rank 0 refuses new requests; "
                       f"{len(seen)} in flight, waiting up to {timeout_s:g} s (DRAIN_TIMEOUT_S)",
                       reason=reason, in_flight=len(seen), timeout_s=timeout_s)
        while True:
            elapsed = self._monotonic() - started
            left = client_rids([r.rid for r in listing.requests]) if not listing.unavailable else ()
            seen.update(left)
            outcome = verdict(listing, elapsed, timeout_s, self._broken())
            if outcome is not None:
                return self._ended(Drained(outcome, len(seen - set(left)), round(elapsed, 3), left), reason,
                                   listing.unavailable)
            self._set_detail(progress_detail(reason, len(left), timeout_s - elapsed))
            self._wait(min(self._poll_s, max(0.0, timeout_s - elapsed)))
            listing = self._call(self._engine.inflight)

    def _ended(self, drained: Drained, reason: str, unavailable: str) -> Drained:
        fields = dict(reason=reason, finished=drained.finished, seconds=drained.seconds)
        if drained.outcome is Outcome.DONE:
            self._log.info("drain_done", f"drained for the restart ({reason}): {drained.finished} request(s) "
                           f"finished in {drained.seconds:.1f} s", **fields)
        elif drained.outcome is Outcome.TIMEOUT:
            shown = ", ".join(drained.left[:CUT_SHOWN]) + (" ..." if len(drained.left) > CUT_SHOWN else "")
            self._log.warning("drain_timeout", f"the drain for the restart ({reason}) ran out after "
                              f"{drained.seconds:.1f} s: {drained.finished} finished, {len(drained.left)} cut "
                              f"({shown})", **fields, cut=len(drained.left), rids=shown)
        elif drained.outcome is Outcome.LISTING_LOST:
            self._log.warning("drain_interrupted", f"the drain for the restart ({reason}) ends: rank 0's "
                              f"in-flight listing is gone ({unavailable}); restarting", **fields)
        else:
            self._log.warning("drain_interrupted", f"the drain for the restart ({reason}) ends: the group broke "
                              "meanwhile; recovering from that instead", **fields)
        return drained
