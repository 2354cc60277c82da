"""The memory guard's decision: samples and rank 0's in-flight requests in, an action out.

No I/O and no clock: the runner feeds samples and the time, and asks for the in-flight list only
when a decision needs a victim.

Two projections, both from the node's "available" bytes (the tighter of MemAvailable and the
node cgroup's headroom):
- the slope: a least-squares line through the last MEMORY_GUARD_WINDOW_SAMPLES samples, counted
  only for a sustained fall (each half of the window falls too: one allocation, a prefill chunk's
  transient, is a step in one half). A fall that has lasted tau seconds is projected
  min(tau, lead) ahead: a burst is not extrapolated a whole lead into the future.
- the lows: the minimum over each MEMORY_GUARD_ENVELOPE_S (at least one prefill chunk) and a line
  through the recent minima, projected lead + envelope ahead. A chunked prefill makes a sawtooth
  whose lows fall chunk by chunk; an abort only takes effect at the next chunk boundary, so the
  crossing must be seen coming from the lows, a chunk early.
A slope counts only when it is significantly below zero (slope + 3 standard errors < 0), so noise
around a level does not read as a fall; memory that sits below the guard without falling is not
acted on (nothing is running out).

The state machine: armed -> (danger on `confirm_samples` consecutive samples) abort the largest
prefill in flight, or abort_all when it cannot tell -> memory still falling (fallen by the
hysteresis band since the action, and the abort had `lead_s` to work) -> abort_all -> still
falling `stop_after_s` later -> stop the ranks. Either wait is cut short when memory would run
out within the lead. Re-armed when every node is back above the guard plus the hysteresis band,
or after `rearm_quiet_s` without danger (then the next action needs a further fall by the band,
so noise at the guard cannot flap).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable

# Decision kinds
NONE = "none"
NEED_INFLIGHT = "need_inflight"  # internal: ask again with rank 0's in-flight list
ABORT = "abort"
ABORT_ALL = "abort_all"
STOP = "stop"
REARM = "rearm"
ACTIONS = (ABORT, ABORT_ALL, STOP)

# State phases
ARMED = "armed"
ABORTED = "aborted"
ABORTED_ALL = "aborted_all"
STOPPED = "stopped"

MODES = ("act", "observe", "off")


@dataclass(frozen=True)
class GuardSettings:
    mode: str = "act"                     # act | observe (log what it would do) | off
    guard_bytes: int = 1_500_000_000      # keep at least this much available on every node
    interval_ms: int = 20                 # agent sampling period
    lead_s: float = 1.0                   # time an abort needs to take effect (HTTP + one prefill chunk)
    envelope_s: float = 1.0               # span over which a low is taken: at least one prefill chunk
    stop_after_s: float = 1.0             # after abort_all, memory still falling this long: stop the ranks
    hysteresis_bytes: int = 250_000_000   # re-arm above guard + this; escalate after falling this much more
    confirm_samples: int = 2              # consecutive samples in danger before acting
    window_s: float = 0.2                 # slope window (10 samples)
    envelope_points: int = 8              # lows (one per envelope span) in the lows' line
    significance: float = 3.0             # standard errors a slope must be below zero
    rearm_quiet_s: float = 10.0           # re-arm after this long without danger
    # The agent sends a sample only when available moved this much since the last one it sent, the
    # samples after it that a confirmation needs, and one every heartbeat: a quiet node costs one
    # gRPC message per heartbeat instead of one per sample (an isolated message costs milliseconds
    # of the agent's CPU, bench/agent_footprint). 0: every sample is sent.
    send_change_bytes: int = 4 << 20
    heartbeat_ms: int = 5000

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r}: must be one of {', '.join(MODES)}")
        if self.guard_bytes < 0 or self.hysteresis_bytes < 0:
            raise ValueError("guard_bytes and hysteresis_bytes must be zero or more")
        for name in ("lead_s", "envelope_s", "window_s", "interval_ms", "stop_after_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be more than zero")
        if self.confirm_samples < 1 or self.envelope_points < 4:
            raise ValueError("confirm_samples must be >= 1 and envelope_points >= 4")
        if self.send_change_bytes < 0 or self.heartbeat_ms < self.interval_ms:
            raise ValueError("send_change_bytes must be zero or more and heartbeat_ms at least interval_ms")

    def send_request(self) -> dict[str, int]:
        """What the agents are asked to send (WatchMemoryRequest's fields): every sample that moved
        send_change_bytes, followed by the samples a confirmation needs. No held-back samples before
        a change: they are flat, and a window holding a flat half is not a sustained fall anyway (the
        trace tests check the actions are the same as with every sample)."""
        if not self.send_change_bytes:
            return {"min_change_bytes": 0}
        return {"min_change_bytes": self.send_change_bytes, "heartbeat_ms": self.heartbeat_ms,
                "replay_samples": 0, "follow_samples": self.confirm_samples}


@dataclass(frozen=True)
class Fit:
    slope: float   # bytes per second
    se: float      # its standard error

    def falling(self, k: float) -> bool:
        return self.slope + k * self.se < 0


def fit_line(points: Iterable[tuple[float, float]]) -> Fit | None:
    """Least-squares slope and its standard error; None with fewer than 4 points or no time span."""
    pts = list(points)
    n = len(pts)
    if n < 4:
        return None
    mt = sum(t for t, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sxy = syy = 0.0
    for t, y in pts:
        dt, dy = t - mt, y - my
        sxx += dt * dt
        sxy += dt * dy
        syy += dy * dy
    if sxx <= 0:
        return None
    slope = sxy / sxx
    rss = max(0.0, syy - slope * sxy)
    return Fit(slope, math.sqrt(rss / (n - 2) / sxx))


def _half_slope(points: list[tuple[float, int]]) -> float:
    n = len(points)
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (y - my) for t, y in points) / sxx if sxx > 0 else 0.0


def _both_halves_fall(points: Iterable[tuple[float, int]], whole: float) -> bool:
    """A sustained fall, not one step: each half of the window falls at a quarter of the whole
    window's rate or more. One allocation (a prefill chunk's transient) is a step in one half and
    noise in the other."""
    pts = list(points)
    mid = (pts[0][0] + pts[-1][0]) / 2
    first = [x for x in pts if x[0] <= mid]
    second = [x for x in pts if x[0] > mid]
    if whole >= 0 or len(first) < 2 or len(second) < 2:
        return False
    return _half_slope(first) <= whole / 4 and _half_slope(second) <= whole / 4


@dataclass(frozen=True)
class Reading:
    """One node's trend after a sample. Times are the node's own clock."""
    at: float
    level: int                 # available bytes now
    slope: Fit | None          # over the slope window
    sustained: bool            # both halves of the window fall (a ramp, not one step)
    fall_s: float              # how long the slope has been negative (0: not falling)
    low: int                   # lowest available over the current and the last envelope span
    lows: Fit | None           # line through the recent lows


class Trend:
    """One node's recent samples, kept incrementally (a few dozen numbers; cheap at 40 samples/s)."""

    def __init__(self, settings: GuardSettings):
        self._s = settings
        self._recent: deque[tuple[float, int]] = deque()
        self._bin_end: float | None = None
        self._bin_min = 0
        self._last_low: int | None = None          # the last closed span's minimum
        # Lows of non-overlapping spans: overlapping ones would be correlated and make a slope
        # through them look more certain than it is.
        self._lows: deque[tuple[float, int]] = deque(maxlen=settings.envelope_points)
        self._lows_fit: Fit | None = None
        self._fall_start: float | None = None

    def add(self, at: float, available: int) -> Reading:
        s = self._s
        if self._recent and at <= self._recent[-1][0]:
            at = self._recent[-1][0] + 1e-6  # a clock that does not advance must not break the fit
        self._recent.append((at, available))
        while self._recent[0][0] < at - s.window_s:
            self._recent.popleft()
        slope = fit_line(self._recent)
        sustained = slope is not None and _both_halves_fall(self._recent, slope.slope)
        if slope is not None and slope.slope < 0:
            if self._fall_start is None:
                self._fall_start = self._recent[0][0]  # the fall began no later than the window's start
        else:
            self._fall_start = None
        fall_s = at - self._fall_start if self._fall_start is not None else 0.0
        self._add_to_span(at, available)
        low = self._bin_min if self._last_low is None else min(self._bin_min, self._last_low)
        return Reading(at, available, slope, sustained, fall_s, low, self._lows_fit)

    def forget_lows(self) -> None:
        """After a recovery the old lows describe a fall that is over: start the envelope afresh."""
        self._bin_end, self._last_low = None, None
        self._lows.clear()
        self._lows_fit = None

    def _add_to_span(self, at: float, available: int) -> None:
        width = self._s.envelope_s
        if self._bin_end is None:
            self._bin_end, self._bin_min = at + width, available
            return
        if at < self._bin_end:
            self._bin_min = min(self._bin_min, available)
            return
        self._last_low = self._bin_min
        self._lows.append((self._bin_end, self._bin_min))
        self._lows_fit = fit_line(self._lows)
        # after a gap the next span starts at this sample, not at a stale boundary
        self._bin_end = max(self._bin_end + width, at + width / 2)
        self._bin_min = available


@dataclass(frozen=True)
class Assessment:
    node: str
    level: int
    danger: bool
    low: int = 0                    # lowest available over the last envelope span
    basis: str = ""                 # "slope" | "lows": which projection saw the crossing
    slope: float = 0.0              # bytes/s of that projection (or of the slope when no danger)
    crossing_s: float | None = None  # predicted time to the guard; None: not falling
    horizon_s: float = 0.0          # how far ahead that projection looked
    exhaust_s: float | None = None  # predicted time until nothing is available


def assess(node: str, reading: Reading, s: GuardSettings) -> Assessment:
    g = s.guard_bytes
    candidates = []
    if reading.slope is not None and reading.sustained and reading.slope.falling(s.significance):
        horizon = min(s.lead_s, reading.fall_s)
        crossing = 0.0 if reading.level <= g else (reading.level - g) / -reading.slope.slope
        candidates.append((crossing, horizon, "slope", reading.slope.slope, reading.level))
    if reading.lows is not None and reading.lows.falling(s.significance):
        horizon = s.lead_s + s.envelope_s
        crossing = 0.0 if reading.low <= g else (reading.low - g) / -reading.lows.slope
        candidates.append((crossing, horizon, "lows", reading.lows.slope, reading.low))
    if not candidates:
        slope = reading.slope.slope if reading.slope is not None else 0.0
        return Assessment(node, reading.level, False, reading.low, slope=slope)
    dangerous = [c for c in candidates if c[0] <= c[1]]
    crossing, horizon, basis, slope, level = min(dangerous or candidates)
    return Assessment(node, reading.level, bool(dangerous), reading.low, basis, slope, crossing, horizon,
                      max(0, level) / -slope)


@dataclass(frozen=True)
class InflightRequest:
    rid: str
    prompt_tokens: int
    prefilled_tokens: int
    age_s: float = 0.0

    @property
    def prefilling(self) -> bool:
        return self.prefilled_tokens < self.prompt_tokens


@dataclass(frozen=True)
class InflightList:
    requests: tuple[InflightRequest, ...] = ()
    unavailable: str = ""   # why there is no list (route missing, rank 0 not answering); "" when there is


def choose_victim(inflight: InflightList, exclude: Iterable[str] = ()) -> InflightRequest | None:
    """The largest prefill in flight (most prompt tokens, then most still to prefill, then the
    youngest); None when nothing is prefilling or the list is unavailable."""
    skip = set(exclude)
    prefilling = [r for r in inflight.requests if r.prefilling and r.rid not in skip]
    if inflight.unavailable or not prefilling:
        return None
    return max(prefilling, key=lambda r: (r.prompt_tokens, r.prompt_tokens - r.prefilled_tokens, -r.age_s))


@dataclass(frozen=True)
class NodeMark:
    streak: int = 0        # consecutive samples in danger
    level: int = 0
    danger: bool = False


@dataclass(frozen=True)
class GuardState:
    phase: str = ARMED
    acted_at: float = -math.inf
    acted_levels: tuple[tuple[str, int], ...] = ()   # every node's level when the last action was taken
    aborted: tuple[str, ...] = ()                    # rids aborted (the last 32)
    marks: tuple[tuple[str, NodeMark], ...] = ()
    last_danger_at: float = -math.inf
    # Levels at a re-arm that came from quiet rather than recovery (memory still low): the next
    # action then needs a further fall by the hysteresis band, so noise at the guard cannot flap.
    armed_levels: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Decision:
    kind: str
    node: str = ""
    reason: str = ""
    level: int = 0
    slope: float = 0.0
    crossing_s: float | None = None
    basis: str = ""
    guard_bytes: int = 0
    victim: InflightRequest | None = None
    unavailable: str = ""   # why there was no in-flight list, when that decided abort_all


def decide(s: GuardSettings, state: GuardState, a: Assessment, now: float,
           inflight: InflightList | None = None) -> tuple[Decision, GuardState]:
    """The next action after one node's sample. `inflight` None means not fetched yet: an action
    that needs a victim then answers NEED_INFLIGHT with the state unchanged, and the caller asks
    again with the list."""
    marks = dict(state.marks)
    prev = marks.get(a.node, NodeMark())
    mark = NodeMark(prev.streak + 1 if a.danger else 0, a.level, a.danger)
    marks[a.node] = mark
    st = replace(state, marks=tuple(sorted(marks.items())),
                 last_danger_at=now if a.danger else state.last_danger_at)
    confirmed = mark.streak >= s.confirm_samples

    def decision(kind: str, reason: str = "", **extra) -> Decision:
        return Decision(kind, a.node, reason, a.level, a.slope, a.crossing_s, a.basis, s.guard_bytes, **extra)

    def acted(phase: str, **changes) -> GuardState:
        return replace(st, phase=phase, acted_at=now,
                       acted_levels=tuple((n, m.level) for n, m in sorted(marks.items())), **changes)

    if st.phase == STOPPED:
        return decision(NONE), st
    if st.phase == ARMED:
        armed_level = dict(st.armed_levels).get(a.node)
        if not confirmed or (armed_level is not None and a.level > armed_level - s.hysteresis_bytes):
            return decision(NONE), st
        if inflight is None:
            return decision(NEED_INFLIGHT), state
        victim = choose_victim(inflight, st.aborted)
        why = _why(a, s)
        if victim is not None:
            return (decision(ABORT, why, victim=victim),
                    acted(ABORTED, aborted=(*st.aborted, victim.rid)[-32:]))
        cannot = inflight.unavailable or "no request is prefilling"
        return (decision(ABORT_ALL, f"{why}; cannot tell which request: {cannot}", unavailable=inflight.unavailable),
                acted(ABORTED_ALL))

    # after an action: re-arm, wait, or escalate
    floor = s.guard_bytes + s.hysteresis_bytes
    if all(m.level >= floor and not m.danger for m in marks.values()):
        return (decision(REARM, f"every node back above {_gb(floor)} available"),
                replace(st, phase=ARMED, armed_levels=()))
    if now - st.last_danger_at >= s.rearm_quiet_s and now - st.acted_at >= s.rearm_quiet_s:
        return (decision(REARM, f"no node in danger for {s.rearm_quiet_s:g} s; the next action needs a further "
                                f"fall of {_gb(s.hysteresis_bytes)}"),
                replace(st, phase=ARMED, armed_levels=tuple((n, m.level) for n, m in sorted(marks.items()))))
    acted_level = dict(st.acted_levels).get(a.node)
    fell = acted_level is not None and a.level <= acted_level - s.hysteresis_bytes
    if confirmed and fell:
        since = now - st.acted_at
        # Waiting for the last action to work makes no sense once memory runs out within the lead.
        urgent = a.exhaust_s is not None and a.exhaust_s <= s.lead_s
        if st.phase == ABORTED and (since >= s.lead_s or urgent):
            victim = st.aborted[-1] if st.aborted else "?"
            return (decision(ABORT_ALL, f"memory kept falling {since:.2f} s after aborting {victim} "
                                        f"({_gb(acted_level)} -> {_gb(a.level)}); {_why(a, s)}"),
                    acted(ABORTED_ALL))
        if st.phase == ABORTED_ALL and (since >= s.stop_after_s or urgent):
            return (decision(STOP, f"memory kept falling {since:.2f} s after abort_all "
                                   f"({_gb(acted_level)} -> {_gb(a.level)}); {_why(a, s)}"),
                    acted(STOPPED))
    return decision(NONE), st


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB"


def _why(a: Assessment, s: GuardSettings) -> str:
    what, level = ("available", a.level) if a.basis == "slope" else ("lowest available", a.low)
    crossing = "already below" if a.crossing_s == 0 else f"predicted to cross in {a.crossing_s:.2f} s"
    return (f"{a.node}: {what} {_gb(level)} falling {a.slope / 1e9:.2f} GB/s, guard {_gb(s.guard_bytes)} "
            f"{crossing} (horizon {a.horizon_s:.2f} s, by the {a.basis})")


@dataclass
class Guard:
    """The policy with its per-node trends: feed samples, get decisions. Not thread-safe."""
    settings: GuardSettings
    state: GuardState = field(default_factory=GuardState)
    trends: dict = field(default_factory=dict)

    def observe(self, node: str, at_node: float, available: int, now: float,
                inflight: Callable[[], InflightList]) -> Decision:
        """`at_node` is the node's sample time (its own clock), `now` the caller's clock; `inflight`
        is called only when an action needs the victim."""
        trend = self.trends.get(node)
        if trend is None:
            trend = self.trends[node] = Trend(self.settings)
        a = assess(node, trend.add(at_node, available), self.settings)
        d, st = decide(self.settings, self.state, a, now)
        if d.kind == NEED_INFLIGHT:
            d, st = decide(self.settings, self.state, a, now, inflight())
        self.state = st
        if d.kind == REARM:
            for t in self.trends.values():
                t.forget_lows()
        return d
