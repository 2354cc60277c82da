"""Which journal events move which counters (pure): the runtime and the guard already log every
bring-up step, restart attempt and guard action as a structured event, so the metrics read those
instead of reaching into the supervisor."""

from __future__ import annotations

from dataclasses import dataclass

# Guard events (coordinator/guard/events.py KINDS) -> the action label; `_observed` is what the guard
# would have done with MEMORY_GUARD=observe.
GUARD_ACTIONS = {"memory_abort": "abort", "memory_abort_all": "abort_all", "memory_stop": "stop"}
HOOK_OUTCOMES = {"incident_hook_done": "ok", "incident_hook_failed": "failed", "incident_hook_dropped": "dropped"}


@dataclass(frozen=True)
class Count:
    """Add `amount` to counter `family` at `labels`."""
    family: str
    labels: tuple[tuple[str, str], ...] = ()
    amount: float = 1.0


@dataclass(frozen=True)
class Observe:
    """Add `value` to histogram `family` at `labels`."""
    family: str
    labels: tuple[tuple[str, str], ...]
    value: float


def updates_of(kind: str, fields: dict[str, str]) -> list[Count | Observe]:
    """The metric updates one event makes (fields as EventLog wrote them: DSV41_* text)."""
    if kind == "step_done":
        step, duration = fields.get("DSV41_STEP", ""), _number(fields.get("DSV41_DURATION_S"))
        return [Observe("dsv41_bringup_step_seconds", (("step", step),), duration)] if step and duration is not None \
            else []
    if kind == "restart_attempt":
        return [Count("dsv41_restarts")]
    base = kind.removesuffix("_observed")
    if base in GUARD_ACTIONS:
        action = GUARD_ACTIONS[base] + ("_observed" if kind != base else "")
        return [Count("dsv41_guard_actions", (("action", action),))]
    if kind in HOOK_OUTCOMES:
        return [Count("dsv41_incident_hook_runs", (("outcome", HOOK_OUTCOMES[kind]),))]
    return []


def _number(text: str | None) -> float | None:
    try:
        value = float(text) if text is not None else None
    except ValueError:
        return None
    return value if value is not None and value >= 0 and value == value else None
