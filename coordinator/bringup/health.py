"""health: rank 0's /health answers 200 (SGLang's runs a one-token generation, so it proves the
TP group computes), and every rank's adapters are in effect: a rank whose output says an adapter
stayed out, or whose node 0 lacks an adapter the plan switches on, fails the step with the
adapter's own line. A rank that exits meanwhile fails the step at once (the supervisor sees it)."""

from __future__ import annotations

import io

from adapter.boot import build_specs
from adapter.log import AdapterLog, AdapterReport, read_report

from .. import serving
from ..plan import NodePlan
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
            check_adapters(ctx)
            return
        ctx.wait(POLL_S)
    raise ctx.fail(ctx.head, f"rank 0 not healthy after {deadline:g} s (last: {last.detail})")


def enabled_adapters(plan: NodePlan) -> frozenset[str]:
    """The adapters the node's rank environment switches on, as the rank itself decides."""
    return frozenset(spec.name for spec in build_specs(plan.rank_spec.env, AdapterLog(io.StringIO())))


def adapter_problem(plan: NodePlan, report: AdapterReport) -> str | None:
    """Why the node's rank does not run with its adapters, or None. Rank 0's node runs every kind of
    SGLang process, so every enabled adapter installs there; the other nodes' ranks run a subset."""
    if report.left_out:
        return "adapter not in effect: " + "; ".join(report.left_out)
    missing = sorted(enabled_adapters(plan) - report.installed) if plan.rank == 0 else []
    if missing:
        return (f"adapters switched on but never reported installed: {', '.join(missing)} (installed: "
                f"{', '.join(sorted(report.installed)) or 'none'}); the rank's PYTHONPATH must start with the "
                "dsv41-adapter package's directory and DSV41_SOURCE must be set")
    return None


def check_adapters(ctx: StepContext) -> None:
    if ctx.cfg["RANK_ENGINE"] == "sim":
        return  # the stand-in runs no adapter code: it is its own stand-in for what they do

    def report(client) -> AdapterReport:
        since = client.status().rank.active_since_unix_s
        return read_report(line.message for line in client.read_journal(JOURNAL_LINES, False, (RANK_UNIT,))
                           if line.at_unix_s >= since)

    for node, found in ctx.each(report).items():
        problem = adapter_problem(ctx.bring.plan(node), found)
        if problem:
            raise ctx.fail(node, problem)


STEP = Step("health", "HEALTH_TIMEOUT_S", retryable=True, run=run)
