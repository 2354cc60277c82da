"""share: the head exports the weights over NFS; every worker mounts them over its ConnectX
address, and the step ends when every mount is healthy (config.json and the shards visible)."""

from __future__ import annotations

from dsv41.v1 import agent_pb2 as pb

from ..state import Phase, Ranks
from .step import Step, StepContext

POLL_S = 0.5


def run(ctx: StepContext, deadline: float) -> None:
    if not ctx.cfg.flag("NFS_SHARE"):
        return
    head = ctx.head
    head_plan = ctx.bring.plan(head)
    state = ctx.ask(head, lambda c: c.ensure_export(head_plan, deadline), mutates=True)
    if not state.exported:
        raise ctx.fail(head, f"export of {head_plan.export.path} failed: {state.detail}")
    end = ctx.monotonic() + deadline
    workers = [n for n in ctx.clients if n != head]
    for node in workers:
        node_plan = ctx.bring.plan(node)
        ctx.ask(node, lambda c, p=node_plan: c.ensure_mount(p, deadline), mutates=True)
    pending = set(workers)
    last: dict[str, pb.MountState] = {}
    while pending:
        for node in sorted(pending):
            last[node] = ctx.ask(node, lambda c: c.get_mount())
            if last[node].state == pb.MountState.HEALTHY:
                pending.discard(node)
        if not pending:
            break
        if ctx.monotonic() > end:
            node = sorted(pending)[0]
            mount = ctx.bring.plan(node).mount
            raise ctx.fail(node, f"mount of {mount.what} at {mount.where} is "
                                 f"{pb.MountState.State.Name(last[node].state).lower()}: {last[node].detail}")
        ctx.wait(POLL_S)


STEP = Step(Phase.SHARE, "SHARE_TIMEOUT_S", retryable=False, ranks=Ranks.NONE, run=run)
