"""One journal event per guard action, with the numbers that caused it (pure formatting)."""

from __future__ import annotations

from dataclasses import dataclass

from .policy import ABORT, ABORT_ALL, REARM, STOP, Decision

KINDS = {ABORT: "memory_abort", ABORT_ALL: "memory_abort_all", STOP: "memory_stop", REARM: "memory_guard_rearmed"}


@dataclass(frozen=True)
class Event:
    kind: str
    message: str
    priority: str
    fields: dict


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB"


def event_of(d: Decision, mode: str, outcome: str = "") -> Event:
    """`mode` act or observe (observe-only: the event says what the guard would have done);
    `outcome` a note on the execution ("" when it went through)."""
    observe = mode == "observe"
    kind = KINDS[d.kind] + ("_observed" if observe and d.kind != REARM else "")
    fields = {"node_name": d.node, "guard_mode": mode, "available_bytes": d.level,
              "slope_bytes_per_s": round(d.slope), "guard_bytes": d.guard_bytes, "basis": d.basis or None,
              "predicted_crossing_s": None if d.crossing_s is None else round(d.crossing_s, 3),
              "reason": d.reason}
    if d.victim is not None:
        fields.update(victim_rid=d.victim.rid, victim_prompt_tokens=d.victim.prompt_tokens,
                      victim_prefilled_tokens=d.victim.prefilled_tokens)
    if d.unavailable:
        fields["inflight_unavailable"] = d.unavailable
    if outcome:
        fields["outcome"] = outcome
    if d.kind == REARM:
        return Event(kind, f"memory guard re-armed: {d.reason}", "info", fields)
    verb = {ABORT: f"aborting request {d.victim.rid if d.victim else '?'}"
                   + (f" ({d.victim.prompt_tokens}-token prompt, {d.victim.prefilled_tokens} prefilled)"
                      if d.victim else ""),
            ABORT_ALL: "aborting all requests", STOP: "stopping the ranks"}[d.kind]
    if observe:
        verb = "observe-only, would be " + verb
    message = f"memory guard: {verb}: {d.reason}"
    if outcome:
        message += f" [{outcome}]"
    return Event(kind, message, "warning" if observe else ("crit" if d.kind == STOP else "err"), fields)
