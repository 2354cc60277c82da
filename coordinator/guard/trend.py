"""One node's memory trend: the line through its recent samples, the line through its recent lows,
and whether either crosses the guard within the horizon an action needs (docs/guard-internals.md).
Pure: samples in, readings and assessments out."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Iterable

from .kinds import Basis
from .settings import GuardSettings


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
        previous = self._recent[-1][1] if self._recent else None  # the last sample's level
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
        self._add_to_span(at, available, previous)
        low = self._bin_min if self._last_low is None else min(self._bin_min, self._last_low)
        return Reading(at, available, slope, sustained, fall_s, low, self._lows_fit)

    def forget_lows(self) -> None:
        """After a recovery the old lows describe a fall that is over: start the envelope afresh."""
        self._bin_end, self._last_low = None, None
        self._lows.clear()
        self._lows_fit = None

    def _add_to_span(self, at: float, available: int, previous: int | None) -> None:
        width = self._s.envelope_s
        if self._bin_end is None:
            self._bin_end, self._bin_min = at + width, available
            return
        if at < self._bin_end:
            self._bin_min = min(self._bin_min, available)
            return
        self._last_low = self._bin_min
        self._lows.append((self._bin_end, self._bin_min))
        if at >= self._bin_end + width and previous is not None:
            # A whole span without a sample: the agent sends one when memory moves by its change
            # threshold, so memory stayed at the last sample's level meanwhile. That level is the
            # low of the spans it held back (not the old minimum again, which would draw a fall
            # that is over through the gap).
            self._last_low = previous
            self._lows.append((at - width / 2, previous))
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
    basis: Basis | None = None      # which projection saw the crossing (slope or lows)
    slope: float = 0.0              # bytes/s of that projection (or of the slope when no danger)
    crossing_s: float | None = None  # predicted time to the guard; None: not falling
    horizon_s: float = 0.0          # how far ahead that projection looked
    exhaust_s: float | None = None  # predicted time until nothing is available
    at: float = 0.0                 # when `level` was sampled, on the node's clock


def assess(node: str, reading: Reading, s: GuardSettings) -> Assessment:
    """Danger: a projection crosses the guard within its horizon. Both projections look as far
    ahead as an action needs, lead + envelope (the slope only as far as its fall has lasted), and
    further by the samples the guard waits for to confirm a danger (confirm_samples - 1 intervals)
    and the interval to the next sample: the action then comes on the last sample before the
    crossing is a horizon away, not that many samples after it."""
    g = s.guard_bytes
    candidates = []
    if reading.slope is not None and reading.sustained and reading.slope.falling(s.significance):
        horizon = min(s.lead_s + s.envelope_s, reading.fall_s) + s.reach_s
        crossing = 0.0 if reading.level <= g else (reading.level - g) / -reading.slope.slope
        candidates.append((crossing, horizon, Basis.SLOPE, reading.slope.slope, reading.level))
    if reading.lows is not None and reading.lows.falling(s.significance):
        horizon = s.lead_s + s.envelope_s + s.reach_s
        crossing = 0.0 if reading.low <= g else (reading.low - g) / -reading.lows.slope
        candidates.append((crossing, horizon, Basis.LOWS, reading.lows.slope, reading.low))
    if not candidates:
        slope = reading.slope.slope if reading.slope is not None else 0.0
        return Assessment(node, reading.level, False, reading.low, slope=slope, at=reading.at)
    dangerous = [c for c in candidates if c[0] <= c[1]]
    crossing, horizon, basis, slope, level = min(dangerous or candidates)
    return Assessment(node, reading.level, bool(dangerous), reading.low, basis, slope, crossing, horizon,
                      max(0, level) / -slope, reading.at)
