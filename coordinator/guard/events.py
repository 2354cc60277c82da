"""One journal event per guard action, with the numbers that caused it (pure formatting).

An abort of several requests is one memory_abort event per request, each with that request's
numbers and why it was charged; the decision's numbers (available, slope, projection) are in
every one of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .charge import Victim
from .kinds import Kind, Why
from .state import Decision

KINDS = {Kind.ABORT: "memory_abort", Kind.ABORT_ALL: "memory_abort_all", Kind.STOP: "memory_stop",
         Kind.REARM: "memory_guard_rearmed", Kind.HOLD: "memory_guard_held"}
WHY = {Why.GROWING: "prefilling", Why.CANNOT_FIT: "cannot fit", Why.HOLDS: "holds memory",
       Why.UNBLOCKS: "first, for the request whose rid it starts with"}


@dataclass(frozen=True)
class Event:
    kind: str
    message: str
    priority: str
    fields: dict


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB"


def _fields(d: Decision, mode: str, outcome: str) -> dict:
    fields = {"node_name": d.node, "guard_mode": mode, "available_bytes": d.level,
              "slope_bytes_per_s": round(d.slope), "guard_bytes": d.guard_bytes, "basis": d.basis or None,
              "predicted_crossing_s": None if d.crossing_s is None else round(d.crossing_s, 3),
              "projected_low_bytes": d.projected_low, "projected_low_kept_bytes": d.projected_low_kept,
              "reason": d.reason}
    if d.skipped:
        fields["skipped_rids"] = ",".join(rid for rid, _ in d.skipped)
    if d.unavailable:
        fields["inflight_unavailable"] = d.unavailable
    if outcome:
        fields["outcome"] = outcome
    return fields


def _victim_fields(v: Victim) -> dict:
    r = v.request
    return {"victim_rid": r.rid, "victim_prompt_tokens": r.prompt_tokens, "victim_prefilled_tokens": r.prefilled_tokens,
            "victim_state": r.state, "victim_why": v.why, "victim_charged_bytes": v.charged_bytes}


def events_of(d: Decision, mode: str, outcome: str = "") -> list[Event]:
    """The decision's events: one per aborted request, else one. `mode` act or observe
    (observe-only: the event says what the guard would have done); `outcome` a note on the
    execution ("" when it went through)."""
    observe = mode == "observe"
    fields = _fields(d, mode, outcome)
    if d.kind == Kind.REARM:
        return [Event(KINDS[Kind.REARM], f"memory guard re-armed: {d.reason}", "info", fields)]
    if d.kind == Kind.HOLD:
        return [Event(KINDS[Kind.HOLD], f"memory guard holds: {d.reason}", "info", fields)]
    kind = KINDS[d.kind] + ("_observed" if observe else "")
    priority = "warning" if observe else ("crit" if d.kind == Kind.STOP else "err")
    prefix = "observe-only, would be " if observe else ""
    suffix = f" [{outcome}]" if outcome else ""
    if d.kind == Kind.ABORT and d.victims:
        out = []
        for v in d.victims:
            r = v.request
            verb = (f"{prefix}aborting request {r.rid} ({r.prompt_tokens}-token prompt, {r.prefilled_tokens} prefilled, "
                    f"{WHY[v.why]}, charged {_gb(v.charged_bytes)})")
            out.append(Event(kind, f"memory guard: {verb}: {d.reason}{suffix}", priority, {**fields, **_victim_fields(v)}))
        return out
    verb = {Kind.ABORT: "aborting request ?", Kind.ABORT_ALL: "aborting all requests",
            Kind.STOP: "stopping the ranks"}[d.kind]
    return [Event(kind, f"memory guard: {prefix}{verb}: {d.reason}{suffix}", priority, fields)]


def event_of(d: Decision, mode: str, outcome: str = "") -> Event:
    """The decision's first event (one victim's, for an abort)."""
    return events_of(d, mode, outcome)[0]


def confirmation_events(node: str, gone: tuple[str, ...], still: tuple[str, ...], since_s: float) -> list[Event]:
    """What the in-flight list said of the aborts sent: gone (they took effect) or still there
    past the deadline (they did not; a repeat would be dropped)."""
    out = [Event("memory_abort_confirmed", f"memory guard: request {rid} is gone {since_s * 1000:.0f} ms after its "
                 "abort", "info", {"node_name": node, "victim_rid": rid, "confirmed_after_ms": round(since_s * 1000)})
           for rid in gone]
    out += [Event("memory_abort_unconfirmed", f"memory guard: request {rid} is still in flight {since_s:.2f} s after "
                  "its abort; a repeated abort of it would be dropped, the guard escalates if memory keeps falling",
                  "warning", {"node_name": node, "victim_rid": rid, "unconfirmed_after_ms": round(since_s * 1000)})
            for rid in still]
    return out
