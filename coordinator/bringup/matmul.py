"""preflight's matrix-product check: with PREFLIGHT_TFLOPS_MIN set, every node runs a short fixed
matrix product in the rank's runtime (agent RPC RunMatmulCheck, adapter/matmul_check.py) at once,
and preflight fails naming the slowest node below the floor. A GB10 latched in its slow state runs
every step at about two thirds of its speed with nothing else to show for it."""

from __future__ import annotations

from dsv41 import matmul
from dsv41.v1 import agent_pb2 as pb

from ..agents import rank_spec_pb
from .step import StepContext

ITERATIONS = 20  # bench/results/matmul_check-h100.txt: 20 products read within 1 % run to run


def result_of(reply: pb.MatmulCheckResult) -> matmul.MatmulResult:
    return matmul.MatmulResult(reply.tflops, reply.device, reply.dtype, reply.size, reply.iterations, reply.seconds)


def check(ctx: StepContext) -> None:
    floor = ctx.cfg.number("PREFLIGHT_TFLOPS_MIN")
    if floor <= 0:
        return
    timeout = ctx.cfg.integer("PREFLIGHT_TFLOPS_TIMEOUT_S")
    ctx.set_detail(f"matrix-product check on every node (floor {floor:g} TFLOPS)")
    specs = {p.node: pb.MatmulCheckSpec(rank=rank_spec_pb(p, ctx.bring.generation), iterations=ITERATIONS,
                                        timeout_s=timeout) for p in ctx.bring.plans}
    replies = ctx.each(lambda c: c.run_matmul_check(specs[c.node], timeout + 30), nodes=list(specs), mutates=True)
    for node, reply in replies.items():
        if not reply.ok:
            raise ctx.fail(node, f"matrix-product check: {reply.detail}")
    results = {node: result_of(reply) for node, reply in replies.items()}
    figures = ", ".join(f"{node} {r.tflops:.3g}" for node, r in results.items())
    ctx.log.info("matmul_checked", f"matrix-product check: {figures} TFLOPS (floor {floor:g})", figures=figures,
                 floor_tflops=floor, slowest_tflops=round(min(r.tflops for r in results.values()), 3))
    slow = matmul.below_floor(results, floor)
    if slow:
        node, result = slow[0]
        raise ctx.fail(node, matmul.describe(node, result, floor).removeprefix(f"{node}: "))
