"""The memory guard's decision: samples and rank 0's in-flight requests in, an action out.

No I/O and no clock: the runner feeds samples and the time, and asks for the in-flight list only
when a decision needs a victim.

Two projections, both from the node's "available" bytes (the tighter of MemAvailable and the
node cgroup's headroom):
- the slope: a least-squares line through the last MEMORY_GUARD_WINDOW_SAMPLES samples, counted
  only for a sustained fall (each half of the window falls too: one allocation, a prefill chunk's
  transient, is a step in one half). A fall that has lasted tau seconds is projected
  min(tau, lead + envelope) ahead: a burst is not extrapolated further than it has lasted, and a
  steady fall is seen as far ahead as by the lows (the line goes through the sawtooth's middle,
  whose lows come a chunk earlier), whether or not the lows' line is significant yet.
- the lows: the minimum over each MEMORY_GUARD_ENVELOPE_S (at least one prefill chunk) and a line
  through the recent minima, projected lead + envelope ahead. A chunked prefill makes a sawtooth
  whose lows fall chunk by chunk; an abort only takes effect at the next chunk boundary, so the
  crossing must be seen coming from the lows, a chunk early.
Both look further by the samples a confirmation waits for (confirm_samples - 1 intervals) and one
interval more, so the confirmed action comes on the last sample before the crossing is that far
ahead, not a confirmation (or the next sample's interval) later.
A slope counts only when it is significantly below zero (slope + 3 standard errors < 0), so noise
around a level does not read as a fall; memory that sits below the guard without falling is not
acted on (nothing is running out).

The state machine: armed -> (danger on `confirm_samples` consecutive samples, or earlier when
the requests' cost says those in flight will take the node below the guard) abort the fewest
requests that keep the projected low above it (charge.choose: by exact rid; one whose rid is a
prefix of another's waits until those are gone), or abort_all when none can be named -> memory
still falling (fallen by the hysteresis band since the action, and the abort had `lead_s` to
work): the next request growing is aborted, abort_all if the victim is still listed -> still
falling `stop_after_s` after an abort_all with no request named -> stop the ranks. Either wait is
cut short when memory would run out within the lead. A danger the requests' cost says ends above
the guard is held, except when memory would run out within the lead: the model may be wrong and
there is no time left to find out, so the request growing is aborted, unless the listings show
its prefill and those queued behind it ending in well under that time at the speed it was seen
prefilling, with no prefix-cache hit waiting (progress.py), or the fall since the last
listing is what the model charges the steps in between (account.py). After an action a request that
arrives and grows is aborted by its rid. Re-armed when every node is back above the guard plus the hysteresis
band, after the aborts were confirmed and the settle time passed, or after `rearm_quiet_s`
without danger; re-armed with memory still low (the allocator keeps what the victims held), the
trend acts again only after a further fall by the band (noise at the guard cannot flap), while the
requests' cost is looked at on lines a quarter band apart.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable

from . import account, charge, progress
from .charge import CostModel, InflightList, InflightRequest, Victim

# Decision kinds
NONE = "none"
NEED_INFLIGHT = "need_inflight"  # internal: ask again with rank 0's in-flight list
ABORT = "abort"
ABORT_ALL = "abort_all"
STOP = "stop"
REARM = "rearm"
HOLD = "hold"  # danger by the trend, but the requests' cost says the fall ends above the guard
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
    # What a request costs each rank (charge.CostModel): the victims are chosen by it.
    cost: CostModel = field(default_factory=CostModel)
    # The node rank 0 runs on (the head): its samples and rank 0's scheduler share a clock.
    rank0_node: str = ""
    # The longest prompt the ranks take (CONTEXT_LENGTH; 0: not known): the KV pool's check (poolfit).
    context_tokens: int = 0

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

    @property
    def confirm_s(self) -> float:
        """How long an aborted request may still be listed: the abort ends it at the next chunk
        boundary (within the lead), and the list is a sample late."""
        return self.lead_s + self.envelope_s

    @property
    def reach_s(self) -> float:
        """How much further ahead than an action needs a projection looks: the time the samples
        after the first one in danger take to confirm it, and one interval more. The next sample
        comes an interval later, so the action comes on the last sample before the crossing is an
        action's time ahead, not up to an interval after it."""
        return self.confirm_samples * self.interval_ms / 1000

    @property
    def line_bytes(self) -> int:
        """The early check's finest spacing: a quarter band (the lines below guard + band)."""
        return max(1, max(4 << 20, self.hysteresis_bytes) // 4)

    def line_of(self, level: int) -> int:
        """Which of the early check's lines a level is on: a hysteresis band apart (4 MiB at least),
        a quarter band apart below guard + band. Lines a band apart put the first one below a
        level within a band of the guard at the guard itself: memory left there after an abort (the
        allocator keeps it) would be looked at again only once the next prompt had taken it below."""
        band = max(4 << 20, self.hysteresis_bytes)
        above = level - self.guard_bytes
        return 4 * (above // band) if above >= band else above // self.line_bytes

    @property
    def settle_s(self) -> float:
        """Quiet after confirmed aborts before the guard is armed again."""
        return self.lead_s + self.envelope_s

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
    basis: str = ""                 # "slope" | "lows": which projection saw the crossing
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
        candidates.append((crossing, horizon, "slope", reading.slope.slope, reading.level))
    if reading.lows is not None and reading.lows.falling(s.significance):
        horizon = s.lead_s + s.envelope_s + s.reach_s
        crossing = 0.0 if reading.low <= g else (reading.low - g) / -reading.lows.slope
        candidates.append((crossing, horizon, "lows", reading.lows.slope, reading.low))
    if not candidates:
        slope = reading.slope.slope if reading.slope is not None else 0.0
        return Assessment(node, reading.level, False, reading.low, slope=slope, at=reading.at)
    dangerous = [c for c in candidates if c[0] <= c[1]]
    crossing, horizon, basis, slope, level = min(dangerous or candidates)
    return Assessment(node, reading.level, bool(dangerous), reading.low, basis, slope, crossing, horizon,
                      max(0, level) / -slope, reading.at)


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
    # After a re-arm with memory still low (the aborted requests' memory stays with the engine's
    # allocator) each node's highest level since: the next action needs a fall of the hysteresis
    # band from it, so noise at the guard cannot flap, while memory that came back and falls
    # again (the next long prompt) is acted on.
    armed_levels: tuple[tuple[str, int], ...] = ()
    pending: tuple[str, ...] = ()                    # aborted rids the in-flight list still showed
    # Aborted rids a listing showed gone (the last 32): one listed again is a new request that
    # reuses the rid (a client may choose it), not the one aborted.
    gone: tuple[str, ...] = ()
    pending_since: float = -math.inf
    overdue_reported: bool = False                   # a pending abort past confirm_s was reported
    # Victims whose rid is a prefix of another victim's: aborted once those are confirmed gone.
    queued: tuple[str, ...] = ()
    # A hold: the model projected the lowest point ahead at hold_low (above the guard) until
    # hold_until; memory falling below it by the band means the model is wrong, and then it is not
    # trusted again until the guard re-arms.
    hold_until: float = -math.inf
    hold_low: int | None = None
    hold_rids: tuple[str, ...] = ()                  # the requests in flight the hold's projection covered
    acted_rids: tuple[str, ...] = ()                 # the requests in flight at the last abort
    model_failed: bool = False
    # Per node, the lowest line (GuardSettings.line_of) memory was at when the requests were last
    # looked at while it fell (the early check).
    checked_lines: tuple[tuple[str, int], ...] = ()
    no_scheduler_view: bool = False                  # the route said nothing of what requests do
    found_nothing_at: float = -math.inf              # when the last early look found no request
    # Each request prefilling when last listed, first seen then (progress.track): how fast the
    # scheduler prefills it, whatever the cost model says.
    sightings: tuple[progress.Sighting, ...] = ()
    # Per node, the model's account of the last listing given with a sample (account.py): the
    # next one's tells whether the fall in between is what the model charges.
    accounts: tuple[account.Account, ...] = ()
    # The waiting requests the last look found (look): a look is taken when others wait.
    looked_waiting: tuple[str, ...] = ()


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


def confirm(s: GuardSettings, state: GuardState, inflight: InflightList, now: float,
            asked: Iterable[str] | None = None) -> tuple[Confirmation, GuardState]:
    """Checks the aborts sent against a fresh listing. An abort takes effect at the next chunk
    boundary, so a victim may be listed for up to a chunk; still listed past confirm_s it did not
    take effect (reported once), and it stays pending: the guard does not re-arm over it.
    `asked`: the rids pending when the listing was asked for (None: all); a victim chosen while it
    was on its way may have arrived after it, and its absence there says nothing."""
    if not state.pending or inflight.unavailable:
        return Confirmation((), ()), state
    listed = {r.rid for r in inflight.requests}
    judged = set(state.pending) if asked is None else set(asked)
    gone = tuple(rid for rid in state.pending if rid not in listed and rid in judged)
    still = tuple(rid for rid in state.pending if rid not in gone)
    overdue = tuple(rid for rid in still if rid in listed) \
        if now - state.pending_since >= s.confirm_s and not state.overdue_reported else ()
    return Confirmation(gone, overdue), replace(state, pending=still, gone=(*state.gone, *gone)[-32:],
                                                overdue_reported=state.overdue_reported or bool(overdue))


def forget_reused(state: GuardState, inflight: InflightList) -> GuardState:
    """An aborted rid that was seen gone and is listed again is a new request under the same rid:
    no longer counted as aborted (its memory given back) nor as judged at the last action."""
    if not state.gone or inflight.unavailable:
        return state
    back = set(state.gone) & {r.rid for r in inflight.requests}
    if not back:
        return state
    return replace(state, aborted=tuple(r for r in state.aborted if r not in back),
                   gone=tuple(r for r in state.gone if r not in back),
                   acted_rids=tuple(r for r in state.acted_rids if r not in back))


def decoding_only(inflight: InflightList, aborted: Iterable[str] = (), held: Iterable[str] = ()) -> bool:
    """Every request listed (but those aborted) decodes, by the scheduler's word, or waits where
    the ranks hold it back (`held`: their admission gate, KV pool slots): none of them will
    allocate more (their prefill is done, or cannot start until memory or slots come back)."""
    gone, held = set(aborted), set(held)
    live = [r for r in inflight.requests if r.rid not in gone]
    return inflight.scheduler_view and bool(live) and any(r.state == charge.DECODING for r in live) \
        and all(r.state == charge.DECODING or (r.waiting and r.rid in held) for r in live)


def running_in_level(s: GuardSettings, a: Assessment, inflight: InflightList) -> bool:
    """Whether the level was sampled after the step the list shows running was launched: only
    rank 0's own node shares the clock the list says it in (CLOCK_MONOTONIC of one host)."""
    return bool(s.rank0_node) and a.node == s.rank0_node and inflight.step_launched_at is not None \
        and a.at >= inflight.step_launched_at


def decide(s: GuardSettings, state: GuardState, a: Assessment, now: float,
           inflight: InflightList | None = None, serving: bool = True,
           looking: bool = False) -> tuple[Decision, GuardState]:
    """The next action after one node's sample. `inflight` None means not fetched yet: an action
    that needs the list then answers NEED_INFLIGHT with the state unchanged, and the caller asks
    again with it. `serving` False during launch, health and smoke: what cannot be aborted is
    stopped (abort_all there would only end the health or smoke request). `looking`: not a new
    sample but a look at a fresh list with the node's last one (Guard.look): only a waiting
    request that cannot fit is acted on."""
    marks = dict(state.marks)
    prev = marks.get(a.node, NodeMark())
    mark = prev if looking else NodeMark(prev.streak + 1 if a.danger else 0, a.level, a.danger)
    marks[a.node] = mark
    armed_levels = dict(state.armed_levels)
    if a.node in armed_levels:
        armed_levels[a.node] = max(armed_levels[a.node], a.level)
    st = replace(state, marks=tuple(sorted(marks.items())), armed_levels=tuple(sorted(armed_levels.items())),
                 last_danger_at=now if a.danger and not looking else state.last_danger_at)
    accounted = None  # (the node's last account, this listing's)
    if inflight is not None and not looking:  # (a look changes nothing of what samples judge by)
        st = replace(forget_reused(st, inflight), sightings=progress.track(st.sightings, inflight, now))
        if s.cost.configured:
            mine = account.account(a.node, now, a.level, inflight, s.cost, running_in_level(s, a, inflight))
            accounted = (next((x for x in st.accounts if x.node == a.node), None), mine)
            st = replace(st, accounts=tuple(x for x in st.accounts if x.node != a.node) + ((mine,) if mine else ()))
    confirmed = mark.streak >= s.confirm_samples
    fallback = ABORT_ALL if serving else STOP

    def listed() -> tuple[str, ...]:
        """The rids of the in-flight list this decision was given."""
        return tuple(r.rid for r in inflight.requests) if inflight is not None else ()

    def decision(kind: str, reason: str = "", **extra) -> Decision:
        return Decision(kind, a.node, reason, a.level, a.slope, a.crossing_s, a.basis, s.guard_bytes, **extra)

    if st.hold_low is not None and not a.danger and now >= st.hold_until:
        st = replace(st, hold_low=None)  # the fall it was about is over

    def acted(phase: str, **changes) -> GuardState:
        return replace(st, phase=phase, acted_at=now, hold_low=None, hold_until=-math.inf,
                       acted_levels=tuple((n, m.level) for n, m in sorted(marks.items())), **changes)

    def abort(why: str, choice: charge.Choice, at: GuardState, basis: str = "") -> tuple[Decision, GuardState]:
        rids = tuple(v.request.rid for v in choice.victims)
        text = _victims_text(choice, s) + "".join(f"; not aborting {rid} alone: {t}" for rid, t in choice.skipped)
        d = decision(ABORT, f"{why}; {text}", victims=choice.victims, projected_low=choice.projected_low,
                     projected_low_kept=choice.projected_low_keeping_all, skipped=choice.skipped)
        if basis:
            # The requests' cost saw the crossing coming: when, at the rate memory falls now.
            falling = -a.slope if a.slope < 0 else 0.0
            d = replace(d, basis=basis, crossing_s=(a.level - s.guard_bytes) / falling if falling else None)
        return d, acted(ABORTED, aborted=(*at.aborted, *rids)[-32:], pending=(*at.pending, *rids), acted_rids=listed(),
                        queued=tuple(r.rid for r in choice.then),
                        pending_since=now if not at.pending else at.pending_since, overdue_reported=False,
                        checked_lines=at.checked_lines, no_scheduler_view=at.no_scheduler_view)

    def act(why: str, at: GuardState) -> tuple[Decision, GuardState]:
        """Abort the requests the fall is charged to; what cannot be named is aborted all or stopped."""
        if inflight.unavailable:
            kind = fallback
            return (decision(kind, f"{why}; cannot tell which request: {inflight.unavailable}",
                             unavailable=inflight.unavailable), acted(_PHASE_OF[kind]))
        if not inflight.requests:
            # Serving, abort_all of nothing is harmless where a stop would end the cluster on a
            # spurious fall (noise at the guard); it escalates to a stop if memory keeps falling.
            kind = fallback
            return decision(kind, f"{why}; nothing is in flight to abort"), acted(_PHASE_OF[kind])
        choice = charge.choose(inflight, a.level, s.guard_bytes, s.cost, exclude=at.aborted,
                               running_in_level=running_in_level(s, a, inflight))
        skipped = "".join(f"; not aborting {rid} alone: {text}" for rid, text in choice.skipped)
        if not choice.needed:
            urgent = a.exhaust_s is not None and a.exhaust_s <= s.lead_s
            ends = ""
            if urgent and not at.model_failed:
                # Close to running out, the model is not trusted, but the scheduler's progress is:
                # a fall that is the end of a prefill stops with it.
                end = progress.prefills_end(at.sightings, inflight, now, 2 * s.interval_ms / 1000, at.aborted)
                if progress.ends_in_time(end, a.exhaust_s):
                    urgent = False
                    ends = (f"; the prefills growing end in {end.seconds:.2f} s at the {end.tokens_per_s:.0f} "
                            f"tokens/s seen, well before memory would run out ({a.exhaust_s:.2f} s at this rate)")
                elif accounted is not None:
                    # or the model has just been checked: the fall since the last listing is what it
                    # charges the steps in between
                    checked, figures = account.explains(*accounted)
                    if checked:
                        urgent = False
                        ends = f"; {figures}, though memory would run out in {a.exhaust_s:.2f} s at this rate"
            believed = not at.model_failed and not urgent
            # When every request decodes, neither urgency nor a model that erred before is a reason
            # to act: nothing of theirs allocates more, and an abort_all would free nothing (the
            # allocator keeps what they hold). The trend is then the end of a prefill that is over,
            # or memory someone else takes, which the fallback below the guard and the node's floor
            # answer.
            # (the ranks' holds cost a replay of the allocator: asked only when the projection is not believed)
            idle = not believed and decoding_only(
                inflight, at.aborted,
                charge.held_back(inflight, a.level, s.cost, at.aborted, running_in_level(s, a, inflight)))
            if s.cost.configured and inflight.scheduler_view and (believed or idle):
                # The trend's line goes on past the end of a prefill; the scheduler knows where it ends.
                held = (f"the requests in flight are projected to take memory no lower than "
                        f"{_gb(choice.projected_low_keeping_all)}" if believed else
                        f"every request in flight is decoding or held back by the ranks (nothing allocates), "
                        f"{_gb(a.level - s.guard_bytes)} above the guard")
                return (decision(HOLD, f"{why}; not acting: {held}{ends}{skipped}",
                                 projected_low_kept=choice.projected_low_keeping_all, skipped=choice.skipped),
                        replace(at, hold_until=now + s.envelope_s, hold_low=choice.projected_low_keeping_all,
                                hold_rids=listed()))
            choice = charge.growing_choice(inflight, a.level, s.cost, exclude=at.aborted,
                                           running_in_level=running_in_level(s, a, inflight))
        if choice.victims:
            return abort(why, choice, at)
        kind = fallback
        cannot = "no request is prefilling" if not choice.skipped else "the request growing cannot be aborted " \
                 "by its rid"
        return (decision(kind, f"{why}; {cannot}{skipped}", skipped=choice.skipped,
                         projected_low_kept=choice.projected_low_keeping_all),
                acted(_PHASE_OF[kind], acted_rids=listed()))

    def early(at: GuardState) -> tuple[Decision, GuardState]:
        """Memory falls, no crossing within the lead yet: when the requests' cost says the fall
        will go below the guard, act now; the requests that do not fit are known already."""
        if not s.cost.configured or at.model_failed or at.no_scheduler_view:
            return decision(NONE), at
        # Looked at each time memory goes below a line it had not been below since the last look
        # (lines a band apart): by level, not time or trend, so the samples an agent holds back
        # never make the guard look sooner or later than the fall itself does. A look that found
        # nothing in flight (a model load) is not repeated within an envelope.
        line = s.line_of(a.level)
        lines = dict(at.checked_lines)
        if a.node in lines and s.line_of(a.level - s.hysteresis_bytes) > lines[a.node]:
            # Memory came back a band and more above the last look (a request ended, a hook gave
            # its buffers back): a fall from here is a new one, looked at from its first line
            # down, not only once it goes below where the last one was looked at.
            lines[a.node] = line
        if line >= lines.get(a.node, line) or (at.found_nothing_at > now - s.envelope_s):
            lines[a.node] = min(line, lines.get(a.node, line))
            return decision(NONE), replace(at, checked_lines=tuple(sorted(lines.items())))
        if inflight is None:
            return decision(NEED_INFLIGHT), state
        _, at = confirm(s, at, inflight, now)
        lines[a.node] = line
        looked = replace(at, checked_lines=tuple(sorted(lines.items())),
                         found_nothing_at=now if inflight.unavailable or not inflight.requests else -math.inf)
        if inflight.unavailable:
            return decision(NONE), looked
        if inflight.requests and not inflight.scheduler_view:
            return decision(NONE), replace(looked, no_scheduler_view=True)  # an older route: no early checks
        choice = charge.choose(inflight, a.level, s.guard_bytes, s.cost, exclude=at.aborted,
                               running_in_level=running_in_level(s, a, inflight))
        # Below the guard already (re-armed there: the allocator keeps what the victims held) no
        # abort can keep the projection above it; the requests growing are then aborted when they
        # would take the node a further line down, not a band later by the trend.
        deeper = a.level < s.guard_bytes and choice.projected_low_keeping_all < a.level - s.line_bytes \
            and all(v.why == "growing" for v in choice.victims)
        if not (choice.needed and (choice.explained or deeper) and choice.victims):
            return decision(NONE), looked
        why = (f"{a.node}: available {_gb(a.level)} falling {max(0.0, -a.slope) / 1e9:.2f} GB/s, guard "
               f"{_gb(s.guard_bytes)}: the requests in flight would take it to "
               f"{_gb(choice.projected_low_keeping_all)}")
        return abort(why, choice, looked, basis="model")

    def look(at: GuardState) -> tuple[Decision, GuardState]:
        """A request arrived that waits (for a step, for slots, for the admission gate): memory has
        not moved for it, so no fall makes the guard look, and once it starts its first step takes
        its share at once. When keeping it would take the node below the guard and aborting the
        waiting requests alone keeps it above, they go before they start."""
        waiting = tuple(r.rid for r in inflight.requests if r.waiting and r.rid not in at.aborted) \
            if inflight is not None and not inflight.unavailable else ()
        new = set(waiting) - set(at.looked_waiting)
        at = replace(at, looked_waiting=waiting)
        if not new or at.phase != ARMED or at.pending or at.queued or not s.cost.configured or at.model_failed \
                or not inflight.scheduler_view:
            return decision(NONE), at
        if a.node == s.rank0_node and inflight.step_launched_at is not None and a.at < inflight.step_launched_at:
            # The sample came before the step now running was launched: it may hold the buffers of
            # the step before, which the projection would count again with this one. The next look.
            return decision(NONE), replace(at, looked_waiting=tuple(r for r in at.looked_waiting if r not in new))
        choice = charge.choose(inflight, a.level, s.guard_bytes, s.cost, exclude=at.aborted,
                               running_in_level=running_in_level(s, a, inflight))
        if not (choice.needed and choice.explained and choice.victims
                and all(v.request.waiting for v in choice.victims) and not choice.then):
            return decision(NONE), at
        why = (f"{a.node}: available {_gb(a.level)}, guard {_gb(s.guard_bytes)}: with "
               f"{', '.join(sorted(new))} arrived, the requests in flight would take it to "
               f"{_gb(choice.projected_low_keeping_all)}")
        return abort(why, choice, at, basis="look")

    if looking:
        return look(st)
    if st.phase == STOPPED:
        return decision(NONE), st
    if st.phase == ARMED:
        armed_level = armed_levels.get(a.node)
        if armed_level is not None and a.level > armed_level - s.hysteresis_bytes:
            # Re-armed with memory still low (the allocator keeps what the aborted requests held):
            # the trend acts again only after a band's further fall (noise at the guard can look like
            # a fall for a window), but what the requests' cost foresees is looked at as before:
            # waiting a band for it too would take each next action a band lower (the trend's danger
            # is not acted on here, so it does not stand in the early look's way either).
            return early(st)
        if not confirmed:
            # Once the crossing is within the lead only an abort of what grows stops it in time:
            # that is the danger path's, after its confirmation.
            return early(st) if not a.danger else (decision(NONE), st)
        broke = _hold_broken(st, a, s)
        if now < st.hold_until and not broke:
            return decision(NONE), st
        if inflight is None:
            return decision(NEED_INFLIGHT), state
        why = _why(a, s) + (_broken_why(st, inflight) if broke else "")
        if broke:
            st = _distrust(st, inflight)
        _, st = confirm(s, st, inflight, now)
        return act(why, st)

    # after an action: the aborts that had to wait for others, re-arm, wait, or act again
    if st.queued and not st.pending and st.phase == ABORTED:
        if inflight is None:
            return decision(NEED_INFLIGHT), state
        queued, st = release_queued(s, st, inflight, now, a.node)
        if queued is not None:
            return queued, st
        # nothing to release now: the re-arm and escalation below still apply
    floor = s.guard_bytes + s.hysteresis_bytes
    if not st.pending and all(m.level >= floor and not m.danger for m in marks.values()):
        return (decision(REARM, f"every node back above {_gb(floor)} available"),
                replace(st, phase=ARMED, armed_levels=(), hold_low=None, model_failed=False, checked_lines=(),
                        queued=()))
    levels_now = tuple((n, m.level) for n, m in sorted(marks.items()))
    quiet = now - st.last_danger_at
    if st.phase == ABORTED and not st.pending and quiet >= s.settle_s and now - st.acted_at >= s.settle_s:
        # The aborts were seen to take effect and memory stopped falling; it stays low (the engine
        # keeps what the aborted requests held), so the next action needs a further fall.
        return (decision(REARM, f"the aborts took effect and no node was in danger for {s.settle_s:g} s; the next "
                                f"action needs a fall of {_gb(s.hysteresis_bytes)}"),
                replace(st, phase=ARMED, armed_levels=levels_now, checked_lines=_look_next(s, marks), queued=()))
    if quiet >= s.rearm_quiet_s and now - st.acted_at >= s.rearm_quiet_s:
        return (decision(REARM, f"no node in danger for {s.rearm_quiet_s:g} s; the next action needs a further "
                                f"fall of {_gb(s.hysteresis_bytes)}"),
                replace(st, phase=ARMED, armed_levels=levels_now, pending=(), overdue_reported=False,
                        checked_lines=_look_next(s, marks), queued=()))
    acted_level = dict(st.acted_levels).get(a.node)
    fell = acted_level is not None and a.level <= acted_level - s.hysteresis_bytes
    if confirmed and fell:
        since = now - st.acted_at
        # Waiting for the last action to work makes no sense once memory runs out within the lead.
        urgent = a.exhaust_s is not None and a.exhaust_s <= s.lead_s
        kept_falling = (f"memory kept falling {since:.2f} s after aborting {', '.join(st.aborted[-3:]) or '?'} "
                        f"({_gb(acted_level)} -> {_gb(a.level)}); {_why(a, s)}")
        if st.phase == ABORTED and (since >= s.lead_s or urgent):
            broke = _hold_broken(st, a, s)
            if now < st.hold_until and not broke:
                return decision(NONE), st
            if inflight is None:
                return decision(NEED_INFLIGHT), state
            if broke:
                st = _distrust(st, inflight)
            since_sent = now - st.pending_since
            seen, st = confirm(s, st, inflight, now)
            still = list(st.pending) + list(seen.still)
            if still:
                # A lead after the abort its victim still runs: the abort did not work (or is a chunk
                # late), and sending it again would be dropped. Another request cannot be growing
                # meanwhile: one is chunk-prefilled at a time.
                return (decision(fallback, f"{kept_falling}; the abort of {', '.join(still)} has not taken effect "
                                           f"after {since_sent:.2f} s (a repeated abort is dropped)"),
                        acted(_PHASE_OF[fallback], pending=(), acted_rids=listed()))
            # Another request is growing now (the next one in line, once the victim was gone).
            return act(kept_falling, st)
        if st.phase == ABORTED_ALL and (since >= s.stop_after_s or urgent):
            # abort_all ended what was in flight then; a request that arrived since and grows is a
            # new fall with a name: aborted by its rid, not the cluster stopped for it.
            if inflight is None and s.cost.configured and not st.no_scheduler_view:
                return decision(NEED_INFLIGHT), state
            new = _arrived_growing(st, inflight) if inflight is not None else []
            if new:
                return act(f"memory kept falling {since:.2f} s after abort_all ({_gb(acted_level)} -> "
                           f"{_gb(a.level)}); {_why(a, s)}; {', '.join(new[:3])} arrived after it and grows", st)
            return (decision(STOP, f"memory kept falling {since:.2f} s after abort_all "
                                   f"({_gb(acted_level)} -> {_gb(a.level)}); {_why(a, s)}"),
                    acted(STOPPED))
    if st.phase in (ABORTED, ABORTED_ALL) and not st.pending and not st.queued and s.cost.configured \
            and not st.no_scheduler_view:
        # The aborts took effect, and the guard is not re-armed yet (memory has not come back, or
        # the lows still hold the fall's minimum). The escalation above waits for a further fall
        # of the band below the level at the action: a prompt that arrived since would take that
        # from a node already near the guard. So the list is looked at each time memory falls to
        # a line it was not on (a band apart), and a request that was not in flight at the last
        # abort growing is a new fall: acted on at once. The requests that were, the last
        # decision has judged.
        line = s.line_of(a.level)
        lines = dict(st.checked_lines)
        known = lines.get(a.node)
        if known is None or line >= known + 2:
            lines[a.node] = line  # (back up two bands: the next fall from here is looked at a band down)
            return decision(NONE), replace(st, checked_lines=tuple(sorted(lines.items())))
        if line < known:
            if inflight is None:
                return decision(NEED_INFLIGHT), state
            lines[a.node] = line
            st = replace(st, checked_lines=tuple(sorted(lines.items())))
            new = _arrived_growing(st, inflight)
            if new:
                return act(f"{_why(a, s) if a.danger else f'{a.node}: available {_gb(a.level)} falling'}; "
                           f"{', '.join(new[:3])} arrived after the last abort and grows", st)
    return decision(NONE), st


_PHASE_OF = {ABORT_ALL: ABORTED_ALL, STOP: STOPPED}


def _look_next(s: GuardSettings, marks: dict) -> tuple[tuple[str, int], ...]:
    """Early-check lines for a re-arm with memory still low: each node's next sample is looked at.
    A request that arrived since the last look (memory steady, so no line was crossed) would
    otherwise be judged only once it has taken the node a line down, and near the guard one chunk
    can take it a line and more."""
    return tuple((n, s.line_of(m.level) + 1) for n, m in sorted(marks.items()))


def release_queued(s: GuardSettings, st: GuardState, inflight: InflightList, now: float,
                   node: str) -> tuple[Decision | None, GuardState]:
    """The aborts that waited for the requests their rid would also have ended: once those are
    gone, each one still listed is aborted by its own rid (if no other rid starts with it now)."""
    if not st.queued or st.pending or inflight.unavailable:
        return None, st
    listed = {r.rid: r for r in inflight.requests}
    conflicts = charge.prefix_conflicts(inflight.requests)
    ready = [rid for rid in st.queued if rid in listed and rid not in conflicts]
    if ready:
        rids, queued = ready, tuple(rid for rid in st.queued if rid not in ready)
        whys = ["growing" if listed[rid].prefilling else "cannot_fit" for rid in ready]
    else:
        queued = tuple(rid for rid in st.queued if rid in listed)
        # A request whose rid starts with a queued one arrived after the abort that was to unblock
        # it: it goes first, by its own rid (one that is itself no other's prefix, longest first),
        # or the queued victim could never be aborted.
        rids = sorted({o for rid in queued for o in conflicts.get(rid, ()) if o not in conflicts},
                      key=lambda rid: (-len(rid), rid))
        if not rids:
            return None, replace(st, queued=queued)
        whys = ["unblocks"] * len(rids)
    victims = tuple(charge.Victim(listed[rid], why, s.cost.held(listed[rid]) + s.cost.to_come(listed[rid]))
                    for rid, why in zip(rids, whys))
    if ready:
        reason = (f"aborting {', '.join(ready)} now that the requests its rid would also have ended are gone; "
                  + "; ".join(f"{v.request.rid} charged {_gb(v.charged_bytes)}" for v in victims))
    else:
        reason = (f"aborting {', '.join(rids)} first: it arrived after the abort that was to let "
                  f"{', '.join(queued)} be aborted by its own rid, which would also end it")
    d = Decision(ABORT, node, reason, dict(st.acted_levels).get(node, 0), guard_bytes=s.guard_bytes, basis="model",
                 victims=victims)
    return d, replace(st, queued=queued, aborted=(*st.aborted, *rids)[-32:], pending=tuple(rids), pending_since=now,
                      overdue_reported=False)


def _arrived_growing(st: GuardState, inflight: InflightList) -> list[str]:
    """The requests growing now that were not in flight at the last action (nor aborted by it)."""
    if inflight.unavailable:
        return []
    before = set(st.acted_rids) | set(st.aborted)
    return [r.rid for r in charge.growing(inflight.requests) if r.rid not in before]


def _arrived_since_hold(st: GuardState, inflight: InflightList) -> list[str]:
    held = set(st.hold_rids)
    return [r.rid for r in inflight.requests if r.rid not in held] if not inflight.unavailable else []


def _distrust(st: GuardState, inflight: InflightList) -> GuardState:
    """Memory fell below the hold's projection: the model is wrong, unless a request the projection
    did not cover arrived meanwhile (its memory is what took the level there: the model, asked
    again with it listed, is still to be trusted)."""
    if _arrived_since_hold(st, inflight):
        return replace(st, hold_low=None, hold_until=-math.inf)
    return replace(st, model_failed=True)


def _broken_why(st: GuardState, inflight: InflightList) -> str:
    text = f"; memory fell below the {_gb(st.hold_low)} the requests were projected to leave"
    arrived = _arrived_since_hold(st, inflight)
    return text + (f", with {', '.join(arrived[:3])} arrived since" if arrived else "")


def _hold_broken(st: GuardState, a: Assessment, s: GuardSettings) -> bool:
    """Memory went below the lowest point the requests were projected to take it to: the cost
    model is wrong (half the way to the guard, at most the hysteresis band; a projection within
    a sample's resolution of the guard, the agent's change threshold, is wrong once memory is
    below the guard or that far below it, not by a sample's worth)."""
    if st.hold_low is None:
        return False
    above = max(0, st.hold_low - s.guard_bytes)
    slack = max(min(s.hysteresis_bytes, above // 2), min(s.send_change_bytes, above))
    return a.level < st.hold_low - slack


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB"


def _victims_text(choice: charge.Choice, s: GuardSettings) -> str:
    parts = []
    for v in choice.victims:
        r = v.request
        what = {"growing": f"{r.rid} is prefilling ({r.prefilled_tokens}/{r.prompt_tokens} tokens)",
                "cannot_fit": f"{r.rid} waits with a {r.prompt_tokens}-token prompt whose projected peak "
                              f"{_gb(v.charged_bytes)} cannot fit in what is left",
                "holds": f"{r.rid} holds {_gb(s.cost.held(r))}",
                "unblocks": f"{r.rid} first, so that the request whose rid it starts with can be aborted "
                            "by its own"}[v.why]
        parts.append(f"{what}, charged {_gb(v.charged_bytes)}")
    keep = f"projected low {_gb(choice.projected_low_keeping_all)} keeping every request, " \
           f"{_gb(choice.projected_low)} without {'it' if len(choice.victims) == 1 else 'them'}"
    if not choice.explained:
        keep += " (the requests do not explain the whole fall: aborting what grows)"
    return f"{'; '.join(parts)}; {keep}"


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
        if d.kind == NEED_INFLIGHT:
            d, st = decide(self.settings, self.state, a, now, inflight(), serving=serving)
        self.state = st
        if d.kind == REARM:
            for t in self.trends.values():
                t.forget_lows()
        return d

    def look(self, inflight: InflightList, now: float, serving: bool = True) -> Decision:
        """A fresh in-flight list between samples (the runner asks every LOOK_S while serving): a
        waiting request that arrived and cannot fit is aborted before it starts (decide's look),
        judged at rank 0's node's last sample (else the lowest node's)."""
        if not self.last:
            return Decision(NONE)
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
        levels = dict(self.state.acted_levels)
        return min(levels, key=levels.get) if levels else ""
