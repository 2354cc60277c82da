"""pack: the packed Engram shards are complete for this TP size on every node that reads them
(OFFLOAD_MODE=nvme), or the pack job runs (SKIP_PREPARE=0) and the step waits for it."""

from __future__ import annotations

from dsv41.v1 import agent_pb2 as pb

from ..packcheck import partition_problems
from ..packstate import incomplete
from ..state import Phase, Ranks
from .step import Step, StepContext

POLL_S = 2.0


def check_partition(ctx: StepContext, states: dict[str, pb.PackState]) -> None:
    """Every row of each table in exactly one rank's shard: ranks whose shards overlap or leave a gap
    would all-reduce wrong Engram rows without any error."""
    problems = partition_problems(states)
    if problems:
        first = problems[0].node
        raise ctx.fail(first, "; ".join(f"layer {p.layer}: {p.message}" if p.node == first else str(p)
                                        for p in problems))


def run(ctx: StepContext, deadline: float) -> None:
    todo = {p.node: p for p in ctx.bring.plans if p.pack.required}
    if not todo:
        return
    states = {node: ctx.ask(node, lambda c, p=p: c.pack_state(p)) for node, p in todo.items()}
    missing = {node: incomplete(state) for node, state in states.items() if incomplete(state)}
    if not missing:
        check_partition(ctx, states)
        return
    node, layers = next(iter(missing.items()))
    if not todo[node].pack.run_if_missing:
        what = ", ".join(f"layer {l.layer} rank {l.rank}: {l.state}" + (f" ({l.detail})" if l.detail else "")
                         for l in layers)
        raise ctx.fail(node, f"packed Engram shards not complete ({what}); run `dsv41ctl pack` or set SKIP_PREPARE=0")
    for node in missing:
        ctx.ask(node, lambda c, p=todo[node]: c.start_pack(p), mutates=True)
    end = ctx.monotonic() + deadline
    while missing:
        if ctx.monotonic() > end:
            raise ctx.fail(sorted(missing)[0], f"pack not complete after {deadline:g} s")
        ctx.wait(POLL_S)
        for node in list(missing):
            state = ctx.ask(node, lambda c, p=todo[node]: c.pack_state(p))
            bad = incomplete(state)
            if not bad:
                del missing[node]
                states[node] = state
            elif not state.running:
                raise ctx.fail(node, f"pack job ended with {bad[0].state}: {bad[0].detail or state.status_text}")
    check_partition(ctx, states)


STEP = Step(Phase.PACK, "PACK_TIMEOUT_S", retryable=False, ranks=Ranks.NONE, run=run)
