"""health: rank 0's /health answers 200 (SGLang's runs a one-token generation, so it proves the
TP group computes), and no rank's output says an adapter stayed out (the step fails with the
adapter's own line; smoke then also requires every adapter the plan switches on to have reported
installed). A rank that exits meanwhile fails the step at once (the supervisor sees it)."""

from __future__ import annotations

from dsv41 import rankadapters
from dsv41.adapterlog import AdapterReport, read_report

from .. import serving
from ..plan import NodePlan
from ..state import Phase, Ranks
from .step import Step, StepContext

POLL_S = 0.2
RANK_UNIT = "dsv41-rank.service"
JOURNAL_LINES = 10_000  # the agent's most; a rank logs a few hundred lines before it serves


def run(ctx: StepContext, deadline: float) -> None:
    end = ctx.monotonic() + deadline
    last = serving.CheckResult(False, "not asked yet")
    while ctx.monotonic() < end:
        timeout = min(serving.HEALTH_TIMEOUT_S, max(1.0, end - ctx.monotonic()))
        last = ctx.call(lambda: serving.health(ctx.base_url, timeout=timeout))
        if last.ok:
            check_adapters(ctx, require_installed=False)
            return
        ctx.wait(POLL_S)
    raise ctx.fail(ctx.head, f"rank 0 not healthy after {deadline:g} s (last: {last.detail})")


def enabled_adapters(plan: NodePlan) -> frozenset[str]:
    """The adapters the node's rank environment switches on, as the rank itself decides."""
    return rankadapters.switched_on(plan.rank_spec.env)


def adapter_problem(plan: NodePlan, report: AdapterReport, require_installed: bool = True) -> str | None:
    """Why the node's rank does not run with its adapters, or None. An adapter installs when SGLang
    imports the module it patches, some only once a chat has been served: `require_installed` (after
    the smoke's completion) also wants every enabled adapter installed on rank 0's node, which runs
    every kind of SGLang process (the other nodes' ranks run a subset)."""
    if report.left_out:
        return "adapter not in effect: " + "; ".join(report.left_out)
    missing = sorted(enabled_adapters(plan) - report.installed) if plan.rank == 0 and require_installed else []
    if missing:
        return (f"adapters switched on but never reported installed: {', '.join(missing)} (installed: "
                f"{', '.join(sorted(report.installed)) or 'none'}); the rank's PYTHONPATH must start with the "
                "dsv41-adapter package's directory and DSV41_SOURCE must be set")
    return None


def check_adapters(ctx: StepContext, require_installed: bool) -> None:
    if ctx.cfg.text("RANK_ENGINE") == "sim":
        return  # the stand-in runs no adapter code: it is its own stand-in for what they do

    def report(client) -> AdapterReport:
        since = client.status().rank.active_since_unix_s
        return read_report(line.message for line in client.recent_journal(JOURNAL_LINES, (RANK_UNIT,))
                           if line.at_unix_s >= since)

    for node, found in ctx.each(report).items():
        problem = adapter_problem(ctx.bring.plan(node), found, require_installed)
        if problem:
            raise ctx.fail(node, problem)


STEP = Step(Phase.HEALTH, "HEALTH_TIMEOUT_S", retryable=True, ranks=Ranks.STARTING, run=run)
