"""fabric: on every node the HCAs are present and ACTIVE over Ethernet with a RoCE v2 GID for the
node's fabric address, the netdevs are up with the expected MTU and address, and every peer
answers on every rail (the agents check; the report is kept for `dsv41ctl status`)."""

from __future__ import annotations

from ..state import Phase, Ranks
from .step import Step, StepContext


def run(ctx: StepContext, deadline: float) -> None:
    plans = {p.node: p for p in ctx.bring.plans}
    reports = ctx.each(lambda c: c.check_fabric(plans[c.node], deadline))
    ctx.bring.fabric = reports
    for node, report in reports.items():
        if not report.ok:
            failed = [f"{c.name}: {c.detail}" for c in report.checks if not c.ok]
            raise ctx.fail(node, "; ".join(failed) or "fabric check failed")


STEP = Step(Phase.FABRIC, "FABRIC_TIMEOUT_S", retryable=False, ranks=Ranks.NONE, run=run)
