"""smoke: a real completion through rank 0 (19+23 must come back as 42, finish_reason stop); the
full smoke adds a JSON-schema answer, a tool call and one batch of MAX_RUNNING_REQUESTS. Then every
adapter the plan switches on must have reported installed (health.check_adapters)."""

from __future__ import annotations

from .. import serving
from .health import check_adapters
from ..state import Phase, Ranks
from .step import Step, StepContext


def run(ctx: StepContext, deadline: float) -> None:
    cfg = ctx.cfg
    result = ctx.call(lambda: serving.smoke(ctx.base_url, cfg.text("SERVED_MODEL_NAME"), cfg.flag("SMOKE_QUICK"),
                                            cfg.integer("MAX_RUNNING_REQUESTS"), timeout=deadline, api_key=ctx.api_key))
    if not result.ok:
        raise ctx.fail(ctx.head, result.detail)
    check_adapters(ctx, require_installed=True)


STEP = Step(Phase.SMOKE, "SMOKE_TIMEOUT_S", retryable=True, ranks=Ranks.STARTING, run=run,
            skip=lambda cfg: cfg.flag("SKIP_SMOKE"))
