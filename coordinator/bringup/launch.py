"""launch: the rank units start, workers first, then the head (rank 0 opens the rendezvous the
others wait for), each from its node's plan; with API_KEY_FILE the key reaches the head first."""

from __future__ import annotations

import os

from dsv41.v1 import agent_pb2 as pb

from .. import plan as plan_mod
from ..state import Phase, Ranks
from .step import Step, StepContext


def run(ctx: StepContext, deadline: float) -> None:
    generation = ctx.bring.generation
    if ctx.api_key:
        key = ctx.api_key.encode()
        ctx.ask(ctx.head, lambda c: c.put_file(os.path.basename(plan_mod.API_KEY_NODE_PATH), key, mode=0o600),
                mutates=True)
    for node_plan in sorted(ctx.bring.plans, key=lambda p: (p.rank == 0, p.rank)):
        reply = ctx.ask(node_plan.node, lambda c, p=node_plan: c.start_rank(p, generation, replace=True,
                                                                              timeout_s=int(deadline)),
                        mutates=True)
        ctx.bring.launched[node_plan.node] = reply.rank.invocation_id
        ctx.record_rank(node_plan.node, reply.rank)
        ctx.log.info("rank_launched", f"{node_plan.node}: rank {node_plan.rank} "
                     f"{pb.StartRankResponse.Outcome.Name(reply.outcome).lower()} (pid {reply.rank.main_pid})",
                     node_name=node_plan.node, rank=node_plan.rank, pid=reply.rank.main_pid,
                     invocation=reply.rank.invocation_id)


STEP = Step(Phase.LAUNCH, "LAUNCH_TIMEOUT_S", retryable=True, ranks=Ranks.STARTING, run=run)
