"""The guard's state and its decisions: small frozen records (docs/guard-internals.md says what
each part is for)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from dsv41.inflight import InflightRequest

from . import account, progress
from .charge import Victim
from .kinds import Basis, Kind, Phase

RECENT = 32  # rids kept in the aborted and gone lists


@dataclass(frozen=True)
class NodeMark:
    streak: int = 0        # consecutive samples in danger
    level: int = 0
    danger: bool = False


@dataclass(frozen=True)
class Samples:
    """What the nodes' samples said."""
    marks: tuple[tuple[str, NodeMark], ...] = ()
    last_danger_at: float = -math.inf
    # After a re-arm with memory still low, each node's highest level since: the trend acts again
    # only after a fall of the hysteresis band from it.
    armed_levels: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class LastAction:
    acted_at: float = -math.inf
    acted_levels: tuple[tuple[str, int], ...] = ()   # every node's level then
    acted_rids: tuple[str, ...] = ()                 # the requests in flight then


@dataclass(frozen=True)
class Aborts:
    """The aborts sent and what the listings since said of them."""
    aborted: tuple[str, ...] = ()        # rids aborted (the last RECENT)
    pending: tuple[str, ...] = ()        # aborted rids the in-flight list still showed
    pending_since: float = -math.inf
    overdue_reported: bool = False       # a pending abort past confirm_s was reported
    # Aborted rids seen gone (the last RECENT): one listed again is a new request reusing the rid.
    gone: tuple[str, ...] = ()
    # Victims whose rid is a prefix of another victim's: aborted once those are confirmed gone.
    queued: tuple[str, ...] = ()


@dataclass(frozen=True)
class Trust:
    """How far the requests' cost model is trusted."""
    # A hold: the model projected the lowest point ahead at hold_low (above the guard) until
    # hold_until; memory falling below it by the band means the model is wrong.
    hold_until: float = -math.inf
    hold_low: int | None = None
    hold_rids: tuple[str, ...] = ()      # the requests the hold's projection covered
    model_failed: bool = False           # not trusted again until the guard re-arms
    no_scheduler_view: bool = False      # the route said nothing of what requests do


@dataclass(frozen=True)
class Looks:
    """What the early check and the looks between samples last saw."""
    # Per node, the lowest line (GuardSettings.line_of) memory was at when the requests were last
    # looked at while it fell.
    checked_lines: tuple[tuple[str, int], ...] = ()
    found_nothing_at: float = -math.inf  # when the last early look found no request
    looked_waiting: tuple[str, ...] = ()  # the waiting requests the last look found
    # Each request prefilling when last listed, first seen then (progress.py): its speed.
    sightings: tuple[progress.Sighting, ...] = ()
    # Per node, the model's account of the last listing given with a sample (account.py).
    accounts: tuple[account.Account, ...] = ()


_PARTS = {"samples": Samples, "action": LastAction, "aborts": Aborts, "trust": Trust, "looks": Looks}
_OWNER = {f.name: part for part, cls in _PARTS.items() for f in fields(cls)}


@dataclass(frozen=True)
class GuardState:
    phase: Phase = Phase.ARMED
    samples: Samples = Samples()
    action: LastAction = LastAction()
    aborts: Aborts = Aborts()
    trust: Trust = Trust()
    looks: Looks = Looks()

    def evolve(self, **changes: object) -> GuardState:
        """A copy with these fields changed, each in the part that holds it (`phase` at the top)."""
        top = {k: changes.pop(k) for k in [k for k in changes if k == "phase"]}
        by_part: dict[str, dict] = {}
        for name, value in changes.items():
            by_part.setdefault(_OWNER[name], {})[name] = value
        return replace(self, **top, **{part: replace(getattr(self, part), **c) for part, c in by_part.items()})

    @classmethod
    def of(cls, **changes: object) -> GuardState:
        """A fresh state with these fields set (tests, benches)."""
        return cls().evolve(**changes)


@dataclass(frozen=True)
class Decision:
    kind: Kind
    node: str = ""
    reason: str = ""
    level: int = 0
    slope: float = 0.0
    crossing_s: float | None = None
    basis: Basis | None = None
    guard_bytes: int = 0
    victims: tuple[Victim, ...] = ()
    unavailable: str = ""   # why there was no in-flight list, when that decided the action
    projected_low: int | None = None        # with the victims aborted (the model's lowest point ahead)
    projected_low_kept: int | None = None   # keeping every request
    skipped: tuple[tuple[str, str], ...] = ()  # rids not aborted by their rid, and why

    @property
    def victim(self) -> InflightRequest | None:
        return self.victims[0].request if self.victims else None


@dataclass(frozen=True)
class Confirmation:
    """What a fresh in-flight list says of the aborts sent."""
    gone: tuple[str, ...]        # no longer listed: the abort took effect
    still: tuple[str, ...]       # still listed past the deadline: it did not (a repeat would be dropped)
