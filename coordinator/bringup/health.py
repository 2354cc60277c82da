"""health: rank 0's /health answers 200 (SGLang's runs a one-token generation, so it proves the
TP group computes). A rank that exits meanwhile fails the step at once (the supervisor sees it)."""

from __future__ import annotations

from .. import serving
from .step import Step, StepContext

POLL_S = 0.2


def run(ctx: StepContext, deadline: float) -> None:
    end = ctx.monotonic() + deadline
    last = serving.CheckResult(False, "not asked yet")
    while ctx.monotonic() < end:
        timeout = min(serving.HEALTH_TIMEOUT_S, max(1.0, end - ctx.monotonic()))
        last = ctx.call(lambda: serving.health(ctx.base_url, timeout=timeout))
        if last.ok:
            return
        ctx.wait(POLL_S)
    raise ctx.fail(ctx.head, f"rank 0 not healthy after {deadline:g} s (last: {last.detail})")


STEP = Step("health", "HEALTH_TIMEOUT_S", retryable=True, run=run)
