"""The words of the guard's decisions (the reason each journal event carries)."""

from __future__ import annotations

from .charge import Choice
from .kinds import Basis, Why
from .settings import GuardSettings
from .state import GuardState
from .trend import Assessment


def gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB"


def victims_text(choice: Choice, s: GuardSettings) -> str:
    parts = []
    for v in choice.victims:
        r = v.request
        what = {Why.GROWING: f"{r.rid} is prefilling ({r.prefilled_tokens}/{r.prompt_tokens} tokens)",
                Why.CANNOT_FIT: f"{r.rid} waits with a {r.prompt_tokens}-token prompt whose projected peak "
                                f"{gb(v.charged_bytes)} cannot fit in what is left",
                Why.HOLDS: f"{r.rid} holds {gb(s.cost.held(r))}",
                Why.UNBLOCKS: f"{r.rid} first, so that the request whose rid it starts with can be aborted "
                              "by its own"}[v.why]
        parts.append(f"{what}, charged {gb(v.charged_bytes)}")
    keep = f"projected low {gb(choice.projected_low_keeping_all)} keeping every request, " \
           f"{gb(choice.projected_low)} without {'it' if len(choice.victims) == 1 else 'them'}"
    if not choice.explained:
        keep += " (the requests do not explain the whole fall: aborting what grows)"
    return f"{'; '.join(parts)}; {keep}"


def danger_text(a: Assessment, s: GuardSettings) -> str:
    what, level = ("available", a.level) if a.basis is Basis.SLOPE else ("lowest available", a.low)
    crossing = "already below" if a.crossing_s == 0 else f"predicted to cross in {a.crossing_s:.2f} s"
    return (f"{a.node}: {what} {gb(level)} falling {a.slope / 1e9:.2f} GB/s, guard {gb(s.guard_bytes)} "
            f"{crossing} (horizon {a.horizon_s:.2f} s, by the {a.basis or ''})")


def broken_text(st: GuardState, arrived: list[str]) -> str:
    text = f"; memory fell below the {gb(st.trust.hold_low)} the requests were projected to leave"
    return text + (f", with {', '.join(arrived[:3])} arrived since" if arrived else "")


def skipped_text(choice: Choice) -> str:
    return "".join(f"; not aborting {rid} alone: {text}" for rid, text in choice.skipped)

