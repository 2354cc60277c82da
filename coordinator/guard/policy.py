"""The memory guard's policy: samples and rank 0's in-flight requests in, an action out.

Guard keeps each node's trend (trend.py) and the state (state.py); the decision after a sample is
phases.decide, one handler per phase. No I/O and no clock. How it works and why:
docs/guard-internals.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from dsv41.inflight import InflightList, InflightRequest

from .aborts import confirm, forget_reused, hold_broken, release_queued, running_in_level
from .kinds import ACTIONS, Basis, Kind, Phase, Why
from .phases import decide
from .settings import GuardSettings
from .state import Confirmation, Decision, GuardState, NodeMark
from .trend import Assessment, Fit, Reading, Trend, assess, fit_line

__all__ = ["ACTIONS", "Assessment", "Basis", "Confirmation", "Decision", "Fit", "Guard", "GuardSettings",
           "GuardState", "InflightList", "InflightRequest", "Kind", "NodeMark", "Phase", "Reading", "Trend", "Why",
           "assess", "confirm", "decide", "fit_line", "forget_reused", "hold_broken", "running_in_level"]


@dataclass
class Guard:
    """The policy with its per-node trends: feed samples, get decisions. Not thread-safe."""
    settings: GuardSettings
    state: GuardState = field(default_factory=GuardState)
    trends: dict = field(default_factory=dict)
    last: dict = field(default_factory=dict)  # node -> its last sample's Assessment

    def observe(self, node: str, at_node: float, available: int, now: float,
                inflight: Callable[[], InflightList], serving: bool = True) -> Decision:
        """`at_node` is the node's sample time (its own clock), `now` the caller's clock; `inflight`
        is called only when an action needs the list."""
        trend = self.trends.get(node)
        if trend is None:
            trend = self.trends[node] = Trend(self.settings)
        a = assess(node, trend.add(at_node, available), self.settings)
        self.last[node] = a
        d, st = decide(self.settings, self.state, a, now, serving=serving)
        if d.kind == Kind.NEED_INFLIGHT:
            d, st = decide(self.settings, self.state, a, now, inflight(), serving=serving)
        self.state = st
        if d.kind == Kind.REARM:
            for t in self.trends.values():
                t.forget_lows()
        return d

    def look(self, inflight: InflightList, now: float, serving: bool = True) -> Decision:
        """A fresh in-flight list between samples (the runner asks every LOOK_S while serving): a
        waiting request that arrived and cannot fit is aborted before it starts (decide's look),
        judged at rank 0's node's last sample (else the lowest node's)."""
        if not self.last:
            return Decision(Kind.NONE)
        # rank 0's node where it is known: its samples and the list share a clock
        a = self.last.get(self.settings.rank0_node) or min(self.last.values(), key=lambda x: x.level)
        d, self.state = decide(self.settings, self.state, a, now, inflight, serving=serving, looking=True)
        return d

    def note_listing(self, inflight: InflightList, now: float, node: str = "",
                     asked: Iterable[str] | None = None) -> tuple[Confirmation, Decision | None]:
        """A fresh in-flight list (the runner's check after an abort): what it confirms, and the
        abort that waited for it, if one can go now. `asked`: the rids pending when it was asked for."""
        seen, self.state = confirm(self.settings, self.state, inflight, now, asked)
        self.state = forget_reused(self.state, inflight)
        queued, self.state = release_queued(self.settings, self.state, inflight, now, node or self.acting_node())
        return seen, queued

    def acting_node(self) -> str:
        """The node the last action was about (the lowest when it was taken)."""
        levels = dict(self.state.action.acted_levels)
        return min(levels, key=levels.get) if levels else ""
