"""The guard's decision after a sample: one handler per phase over a frozen context, chosen from
a table (HANDLERS); `decide` is the entry. How and why each phase acts: docs/guard-internals.md.

No I/O and no clock: the caller passes the time, and the in-flight list only when a decision
answered Kind.NEED_INFLIGHT for it (the state unchanged), asked again with it."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from dsv41.inflight import InflightList

from . import account, charge, progress
from .aborts import (arrived_growing, arrived_since_hold, confirm, decoding_only, distrust, forget_reused,
                     hold_broken, release_queued, running_in_level)
from .kinds import Basis, Kind, Phase
from .settings import GuardSettings
from .state import RECENT, Decision, GuardState, NodeMark
from .trend import Assessment
from .wording import broken_text, danger_text, gb, skipped_text, victims_text

Outcome = tuple[Decision, GuardState]
PHASE_OF = {Kind.ABORT_ALL: Phase.ABORTED_ALL, Kind.STOP: Phase.STOPPED}


@dataclass(frozen=True)
class Context:
    """One decision's inputs: the settings, the state it was given, the node's assessment, the
    time, the in-flight list (None: not fetched yet), whether the cluster serves, every node's
    mark with this sample's, and the model's accounts of this node's last listing and this one."""
    s: GuardSettings
    given: GuardState
    a: Assessment
    now: float
    inflight: InflightList | None
    serving: bool
    marks: tuple[tuple[str, NodeMark], ...]
    accounted: tuple[account.Account | None, account.Account | None] | None = None

    @property
    def confirmed(self) -> bool:
        return dict(self.marks)[self.a.node].streak >= self.s.confirm_samples

    @property
    def fallback(self) -> Kind:
        """What is done when no request can be named: abort_all serving, else stop (abort_all
        during launch, health or smoke would only end the health or smoke request)."""
        return Kind.ABORT_ALL if self.serving else Kind.STOP

    @property
    def urgent(self) -> bool:
        """Memory runs out within the lead."""
        return self.a.exhaust_s is not None and self.a.exhaust_s <= self.s.lead_s

    @property
    def in_level(self) -> bool:
        return running_in_level(self.s, self.a, self.inflight)

    def listed(self) -> tuple[str, ...]:
        """The rids of the in-flight list this decision was given."""
        return tuple(r.rid for r in self.inflight.requests) if self.inflight is not None else ()

    def decision(self, kind: Kind, reason: str = "", **extra) -> Decision:
        a = self.a
        return Decision(kind, a.node, reason, a.level, a.slope, a.crossing_s, a.basis, self.s.guard_bytes, **extra)

    def none(self, st: GuardState) -> Outcome:
        return self.decision(Kind.NONE), st

    def need_inflight(self) -> Outcome:
        return self.decision(Kind.NEED_INFLIGHT), self.given

    def acted(self, base: GuardState, phase: Phase, **changes) -> GuardState:
        return base.evolve(phase=phase, acted_at=self.now, hold_low=None, hold_until=-math.inf,
                           acted_levels=tuple((n, m.level) for n, m in self.marks), **changes)

    def choose(self, st: GuardState) -> charge.Choice:
        return charge.choose(self.inflight, self.a.level, self.s.guard_bytes, self.s.cost,
                             exclude=st.aborts.aborted, running_in_level=self.in_level)


# -- the actions


def abort(c: Context, why: str, choice: charge.Choice, at: GuardState, base: GuardState,
          basis: Basis | None = None) -> Outcome:
    """Abort the choice's victims. `at` holds the aborts and looks so far; `base` the rest."""
    rids = tuple(v.request.rid for v in choice.victims)
    d = c.decision(Kind.ABORT, f"{why}; {victims_text(choice, c.s)}{skipped_text(choice)}", victims=choice.victims,
                   projected_low=choice.projected_low, projected_low_kept=choice.projected_low_keeping_all,
                   skipped=choice.skipped)
    if basis:
        # The requests' cost saw the crossing coming: when, at the rate memory falls now.
        falling = -c.a.slope if c.a.slope < 0 else 0.0
        d = replace(d, basis=basis, crossing_s=(c.a.level - c.s.guard_bytes) / falling if falling else None)
    ab = at.aborts
    return d, c.acted(base, Phase.ABORTED, aborted=(*ab.aborted, *rids)[-RECENT:], pending=(*ab.pending, *rids),
                      acted_rids=c.listed(), queued=tuple(r.rid for r in choice.then),
                      pending_since=c.now if not ab.pending else ab.pending_since, overdue_reported=False,
                      checked_lines=at.looks.checked_lines, no_scheduler_view=at.trust.no_scheduler_view)


def fall_back(c: Context, reason: str, at: GuardState, **extra) -> Outcome:
    kind = c.fallback
    return c.decision(kind, reason, **extra), c.acted(at, PHASE_OF[kind])


def act(c: Context, why: str, at: GuardState) -> Outcome:
    """Abort the requests the fall is charged to; what cannot be named is aborted all or stopped."""
    if c.inflight.unavailable:
        return fall_back(c, f"{why}; cannot tell which request: {c.inflight.unavailable}", at,
                         unavailable=c.inflight.unavailable)
    if not c.inflight.requests:
        # Serving, abort_all of nothing is harmless where a stop would end the cluster on a
        # spurious fall; it escalates to a stop if memory keeps falling.
        return fall_back(c, f"{why}; nothing is in flight to abort", at)
    choice = c.choose(at)
    if not choice.needed:
        held = hold(c, why, choice, at)
        if held is not None:
            return held
        choice = charge.growing_choice(c.inflight, c.a.level, c.s.cost, exclude=at.aborts.aborted,
                                       running_in_level=c.in_level)
    if choice.victims:
        return abort(c, why, choice, at, at)
    kind = c.fallback
    cannot = "no request is prefilling" if not choice.skipped else "the request growing cannot be aborted " \
             "by its rid"
    return (c.decision(kind, f"{why}; {cannot}{skipped_text(choice)}", skipped=choice.skipped,
                       projected_low_kept=choice.projected_low_keeping_all),
            c.acted(at, PHASE_OF[kind], acted_rids=c.listed()))


def _ends_in_time(c: Context, at: GuardState) -> str | None:
    """Close to running out the model is not trusted, but the scheduler's progress is (a fall that
    is the end of a prefill stops with it), or the model just checked against the last fall:
    the words that say so, None when neither."""
    a, s = c.a, c.s
    end = progress.prefills_end(at.looks.sightings, c.inflight, c.now, 2 * s.interval_ms / 1000, at.aborts.aborted)
    if progress.ends_in_time(end, a.exhaust_s):
        return (f"; the prefills growing end in {end.seconds:.2f} s at the {end.tokens_per_s:.0f} "
                f"tokens/s seen, well before memory would run out ({a.exhaust_s:.2f} s at this rate)")
    if c.accounted is not None:
        checked, figures = account.explains(*c.accounted)
        if checked:
            return f"; {figures}, though memory would run out in {a.exhaust_s:.2f} s at this rate"
    return None


def hold(c: Context, why: str, choice: charge.Choice, at: GuardState) -> Outcome | None:
    """Keeping every request stays above the guard: hold when the model is believed, or when
    every request decodes or is held back (nothing allocates); None: act on what grows."""
    s, urgent, ends = c.s, c.urgent, ""
    if urgent and not at.trust.model_failed:
        found = _ends_in_time(c, at)
        if found is not None:
            urgent, ends = False, found
    believed = not at.trust.model_failed and not urgent
    # (the ranks' holds cost a replay of the allocator: asked only when the projection is not believed)
    idle = not believed and decoding_only(
        c.inflight, at.aborts.aborted,
        charge.held_back(c.inflight, c.a.level, s.cost, at.aborts.aborted, c.in_level))
    if not (s.cost.configured and c.inflight.scheduler_view and (believed or idle)):
        return None
    # The trend's line goes on past the end of a prefill; the scheduler knows where it ends.
    held = (f"the requests in flight are projected to take memory no lower than "
            f"{gb(choice.projected_low_keeping_all)}" if believed else
            f"every request in flight is decoding or held back by the ranks (nothing allocates), "
            f"{gb(c.a.level - s.guard_bytes)} above the guard")
    return (c.decision(Kind.HOLD, f"{why}; not acting: {held}{ends}{skipped_text(choice)}",
                       projected_low_kept=choice.projected_low_keeping_all, skipped=choice.skipped),
            at.evolve(hold_until=c.now + s.envelope_s, hold_low=choice.projected_low_keeping_all,
                      hold_rids=c.listed()))


# -- looks at the requests' cost before the trend's danger


def _early_lines(c: Context, at: GuardState) -> tuple[dict, int, bool]:
    """(each node's early-check line, this level's line, whether to look now)."""
    s, a = c.s, c.a
    line = s.line_of(a.level)
    lines = dict(at.looks.checked_lines)
    if a.node in lines and s.line_of(a.level - s.hysteresis_bytes) > lines[a.node]:
        # Memory came back a band and more above the last look: a fall from here is a new one,
        # looked at from its first line down.
        lines[a.node] = line
    if line >= lines.get(a.node, line) or (at.looks.found_nothing_at > c.now - s.envelope_s):
        lines[a.node] = min(line, lines.get(a.node, line))
        return lines, line, False
    return lines, line, True


def early(c: Context, at: GuardState) -> Outcome:
    """Memory falls, no crossing within the lead yet: when the requests' cost says the fall will
    go below the guard, act now. Looked at each time memory goes below a line it had not been
    below since the last look (by level, not time: held-back samples never change when)."""
    s, a, inflight = c.s, c.a, c.inflight
    if not s.cost.configured or at.trust.model_failed or at.trust.no_scheduler_view:
        return c.none(at)
    lines, line, look_now = _early_lines(c, at)
    if not look_now:
        return c.none(at.evolve(checked_lines=tuple(sorted(lines.items()))))
    if inflight is None:
        return c.need_inflight()
    _, confirmed = confirm(s, at, inflight, c.now)
    lines[a.node] = line
    looked = confirmed.evolve(checked_lines=tuple(sorted(lines.items())),
                              found_nothing_at=c.now if inflight.unavailable or not inflight.requests else -math.inf)
    if inflight.unavailable:
        return c.none(looked)
    if inflight.requests and not inflight.scheduler_view:
        return c.none(looked.evolve(no_scheduler_view=True))  # an older route: no early checks
    choice = c.choose(confirmed)
    # Below the guard already no abort keeps the projection above it: what grows is aborted when
    # it would take the node a further line down.
    deeper = a.level < s.guard_bytes and choice.projected_low_keeping_all < a.level - s.line_bytes \
        and all(v.why == "growing" for v in choice.victims)
    if not (choice.needed and (choice.explained or deeper) and choice.victims):
        return c.none(looked)
    why = (f"{a.node}: available {gb(a.level)} falling {max(0.0, -a.slope) / 1e9:.2f} GB/s, guard "
           f"{gb(s.guard_bytes)}: the requests in flight would take it to "
           f"{gb(choice.projected_low_keeping_all)}")
    return abort(c, why, choice, looked, at, basis=Basis.MODEL)


def on_look(c: Context, st: GuardState) -> Outcome:
    """A fresh list between samples: a request that arrived and waits moves no memory, and once it
    starts its first step takes its share at once. When keeping it would take the node below the
    guard and aborting waiting requests alone keeps it above, they go before they start."""
    s, a, inflight = c.s, c.a, c.inflight
    waiting = tuple(r.rid for r in inflight.requests if r.waiting and r.rid not in st.aborts.aborted) \
        if inflight is not None and not inflight.unavailable else ()
    new = set(waiting) - set(st.looks.looked_waiting)
    at = st.evolve(looked_waiting=waiting)
    if not new or at.phase != Phase.ARMED or at.aborts.pending or at.aborts.queued or not s.cost.configured \
            or at.trust.model_failed or not inflight.scheduler_view:
        return c.none(at)
    if a.node == s.rank0_node and inflight.step_launched_at is not None and a.at < inflight.step_launched_at:
        # The sample came before the step now running was launched: it may hold the buffers of the
        # step before, which the projection would count again with this one. The next look.
        return c.none(at.evolve(looked_waiting=tuple(r for r in at.looks.looked_waiting if r not in new)))
    choice = c.choose(at)
    if not (choice.needed and choice.explained and choice.victims
            and all(v.request.waiting for v in choice.victims) and not choice.then):
        return c.none(at)
    why = (f"{a.node}: available {gb(a.level)}, guard {gb(s.guard_bytes)}: with "
           f"{', '.join(sorted(new))} arrived, the requests in flight would take it to "
           f"{gb(choice.projected_low_keeping_all)}")
    return abort(c, why, choice, at, st, basis=Basis.LOOK)


# -- the phases


def on_armed(c: Context, st: GuardState) -> Outcome:
    s, a = c.s, c.a
    armed_level = dict(st.samples.armed_levels).get(a.node)
    if armed_level is not None and a.level > armed_level - s.hysteresis_bytes:
        # Re-armed with memory still low: the trend acts again only after a band's further fall,
        # but what the requests' cost foresees is looked at as before.
        return early(c, st)
    if not c.confirmed:
        # Once the crossing is within the lead only an abort of what grows stops it in time: that
        # is the danger path's, after its confirmation.
        return early(c, st) if not a.danger else c.none(st)
    broke = hold_broken(st, a, s)
    if c.now < st.trust.hold_until and not broke:
        return c.none(st)
    if c.inflight is None:
        return c.need_inflight()
    why = danger_text(a, s) + (broken_text(st, arrived_since_hold(st, c.inflight)) if broke else "")
    if broke:
        st = distrust(st, c.inflight)
    _, st = confirm(s, st, c.inflight, c.now)
    return act(c, why, st)


def on_stopped(c: Context, st: GuardState) -> Outcome:
    return c.none(st)


def _look_next(s: GuardSettings, marks: tuple[tuple[str, NodeMark], ...]) -> tuple[tuple[str, int], ...]:
    """Early-check lines for a re-arm with memory still low: each node's next sample is looked at
    (near the guard one chunk can take it a line and more)."""
    return tuple((n, s.line_of(m.level) + 1) for n, m in marks)


def rearm(c: Context, st: GuardState, settle: bool) -> Outcome | None:
    """Armed again: every node back above guard + band; or (`settle`) the aborts took effect and
    no node was in danger for the settle time; or none for rearm_quiet_s."""
    s, marks, now = c.s, c.marks, c.now
    floor = s.guard_bytes + s.hysteresis_bytes
    if not st.aborts.pending and all(m.level >= floor and not m.danger for _, m in marks):
        return (c.decision(Kind.REARM, f"every node back above {gb(floor)} available"),
                st.evolve(phase=Phase.ARMED, armed_levels=(), hold_low=None, model_failed=False, checked_lines=(),
                          queued=()))
    levels_now = tuple((n, m.level) for n, m in marks)
    quiet = now - st.samples.last_danger_at
    since = now - st.action.acted_at
    if settle and not st.aborts.pending and quiet >= s.settle_s and since >= s.settle_s:
        # Memory stays low (the engine keeps what the aborted requests held): the next action
        # needs a further fall.
        return (c.decision(Kind.REARM, f"the aborts took effect and no node was in danger for {s.settle_s:g} s; "
                                       f"the next action needs a fall of {gb(s.hysteresis_bytes)}"),
                st.evolve(phase=Phase.ARMED, armed_levels=levels_now, checked_lines=_look_next(s, marks), queued=()))
    if quiet >= s.rearm_quiet_s and since >= s.rearm_quiet_s:
        return (c.decision(Kind.REARM, f"no node in danger for {s.rearm_quiet_s:g} s; the next action needs a "
                                       f"further fall of {gb(s.hysteresis_bytes)}"),
                st.evolve(phase=Phase.ARMED, armed_levels=levels_now, pending=(), overdue_reported=False,
                          checked_lines=_look_next(s, marks), queued=()))
    return None


def _fell(c: Context, st: GuardState) -> int | None:
    """The node's level at the last action when memory has fallen a band below it since, on a
    confirmed danger; else None."""
    acted_level = dict(st.action.acted_levels).get(c.a.node)
    if c.confirmed and acted_level is not None and c.a.level <= acted_level - c.s.hysteresis_bytes:
        return acted_level
    return None


def escalate_aborted(c: Context, st: GuardState, acted_level: int) -> Outcome | None:
    """Memory kept falling a lead after the aborts: the next request growing is aborted, or all
    when a victim is still listed (a repeated abort would be dropped)."""
    s, a, now = c.s, c.a, c.now
    since = now - st.action.acted_at
    if not (since >= s.lead_s or c.urgent):
        return None
    broke = hold_broken(st, a, s)
    if now < st.trust.hold_until and not broke:
        return c.none(st)
    if c.inflight is None:
        return c.need_inflight()
    kept_falling = (f"memory kept falling {since:.2f} s after aborting {', '.join(st.aborts.aborted[-3:]) or '?'} "
                    f"({gb(acted_level)} -> {gb(a.level)}); {danger_text(a, s)}")
    if broke:
        st = distrust(st, c.inflight)
    since_sent = now - st.aborts.pending_since
    seen, st = confirm(s, st, c.inflight, now)
    still = list(st.aborts.pending) + list(seen.still)
    if still:
        # The victim still runs a lead after its abort: the abort did not work (or is a chunk late).
        # Another request cannot be growing meanwhile: one is chunk-prefilled at a time.
        return (c.decision(c.fallback, f"{kept_falling}; the abort of {', '.join(still)} has not taken effect "
                                       f"after {since_sent:.2f} s (a repeated abort is dropped)"),
                c.acted(st, PHASE_OF[c.fallback], pending=(), acted_rids=c.listed()))
    return act(c, kept_falling, st)  # another request is growing now (the next one in line)


def escalate_aborted_all(c: Context, st: GuardState, acted_level: int) -> Outcome | None:
    """Memory kept falling stop_after_s after abort_all: stop the ranks, unless a request that
    arrived since grows (a new fall with a name: aborted by its rid)."""
    s, a, now = c.s, c.a, c.now
    since = now - st.action.acted_at
    if not (since >= s.stop_after_s or c.urgent):
        return None
    if c.inflight is None and s.cost.configured and not st.trust.no_scheduler_view:
        return c.need_inflight()
    new = arrived_growing(st, c.inflight) if c.inflight is not None else []
    fell = f"({gb(acted_level)} -> {gb(a.level)}); {danger_text(a, s)}"
    if new:
        return act(c, f"memory kept falling {since:.2f} s after abort_all {fell}; {', '.join(new[:3])} arrived "
                      "after it and grows", st)
    return c.decision(Kind.STOP, f"memory kept falling {since:.2f} s after abort_all {fell}"), \
        c.acted(st, Phase.STOPPED)


def check_lines(c: Context, st: GuardState) -> Outcome:
    """After the aborts took effect, before the re-arm: the list is looked at each time memory
    falls to a line it was not on, and a request that was not in flight at the last abort and
    grows is a new fall, acted on at once (the requests that were, the last decision judged)."""
    s, a = c.s, c.a
    if st.phase not in (Phase.ABORTED, Phase.ABORTED_ALL) or st.aborts.pending or st.aborts.queued \
            or not s.cost.configured or st.trust.no_scheduler_view:
        return c.none(st)
    line = s.line_of(a.level)
    lines = dict(st.looks.checked_lines)
    known = lines.get(a.node)
    if known is None or line >= known + 2:
        lines[a.node] = line  # (back up two bands: the next fall from here is looked at a band down)
        return c.none(st.evolve(checked_lines=tuple(sorted(lines.items()))))
    if line >= known:
        return c.none(st)
    if c.inflight is None:
        return c.need_inflight()
    lines[a.node] = line
    st = st.evolve(checked_lines=tuple(sorted(lines.items())))
    new = arrived_growing(st, c.inflight)
    if not new:
        return c.none(st)
    falling = danger_text(a, s) if a.danger else f"{a.node}: available {gb(a.level)} falling"
    return act(c, f"{falling}; {', '.join(new[:3])} arrived after the last abort and grows", st)


def _after_action(c: Context, st: GuardState, settle: bool,
                  escalate: Callable[[Context, GuardState, int], Outcome | None]) -> Outcome:
    found = rearm(c, st, settle)
    if found is not None:
        return found
    acted_level = _fell(c, st)
    if acted_level is not None:
        found = escalate(c, st, acted_level)
        if found is not None:
            return found
    return check_lines(c, st)


def on_aborted(c: Context, st: GuardState) -> Outcome:
    if st.aborts.queued and not st.aborts.pending:
        if c.inflight is None:
            return c.need_inflight()
        queued, st = release_queued(c.s, st, c.inflight, c.now, c.a.node)
        if queued is not None:
            return queued, st
    return _after_action(c, st, True, escalate_aborted)


def on_aborted_all(c: Context, st: GuardState) -> Outcome:
    return _after_action(c, st, False, escalate_aborted_all)


HANDLERS: dict[Phase, Callable[[Context, GuardState], Outcome]] = {
    Phase.ARMED: on_armed, Phase.ABORTED: on_aborted, Phase.ABORTED_ALL: on_aborted_all, Phase.STOPPED: on_stopped,
}


def _noted(s: GuardSettings, state: GuardState, a: Assessment, now: float, inflight: InflightList | None,
           looking: bool) -> tuple[GuardState, tuple[tuple[str, NodeMark], ...], tuple | None]:
    """The state with this sample noted (a look notes none), the marks, and the model's accounts."""
    marks = dict(state.samples.marks)
    prev = marks.get(a.node, NodeMark())
    marks[a.node] = prev if looking else NodeMark(prev.streak + 1 if a.danger else 0, a.level, a.danger)
    armed_levels = dict(state.samples.armed_levels)
    if a.node in armed_levels:
        armed_levels[a.node] = max(armed_levels[a.node], a.level)
    st = state.evolve(marks=tuple(sorted(marks.items())), armed_levels=tuple(sorted(armed_levels.items())),
                      last_danger_at=now if a.danger and not looking else state.samples.last_danger_at)
    accounted = None
    if inflight is not None and not looking:  # (a look changes nothing of what samples judge by)
        st = forget_reused(st, inflight).evolve(sightings=progress.track(st.looks.sightings, inflight, now))
        if s.cost.configured:
            mine = account.account(a.node, now, a.level, inflight, s.cost, running_in_level(s, a, inflight))
            accounted = (next((x for x in st.looks.accounts if x.node == a.node), None), mine)
            st = st.evolve(accounts=tuple(x for x in st.looks.accounts if x.node != a.node) + ((mine,) if mine else ()))
    if st.trust.hold_low is not None and not a.danger and now >= st.trust.hold_until:
        st = st.evolve(hold_low=None)  # the fall it was about is over
    return st, tuple(sorted(marks.items())), accounted


def decide(s: GuardSettings, state: GuardState, a: Assessment, now: float,
           inflight: InflightList | None = None, serving: bool = True,
           looking: bool = False) -> Outcome:
    """The next action after one node's sample. `inflight` None: not fetched yet (an action that
    needs it answers Kind.NEED_INFLIGHT with the state unchanged). `serving` False during launch,
    health and smoke: what cannot be aborted is stopped. `looking`: not a new sample but a look at
    a fresh list with the node's last one (Guard.look)."""
    st, marks, accounted = _noted(s, state, a, now, inflight, looking)
    c = Context(s, state, a, now, inflight, serving, marks, accounted)
    if looking:
        return on_look(c, st)
    return HANDLERS[st.phase](c, st)
