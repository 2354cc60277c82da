"""preflight: every agent answers (waiting for one that cannot be reached yet), runs the same
version and adapter files, the weights verify (SKIP_VERIFY=0), the plans render with the DSpark
tables every node agrees on, leftover ranks of another plan are stopped, each node has the memory
a rank needs and holds the same image; with PREFLIGHT_TFLOPS_MIN, every GPU reaches its floor (matmul.py)."""

from __future__ import annotations

import os

from dsv41.v1 import agent_pb2 as pb

from .. import weights
from ..agents import AgentUnavailable
from ..parallel import on_each
from ..state import generation_of
from .matmul import check as check_tflops
from .images import image_problems
from ..state import Phase, Ranks
from .step import Step, StepContext
from .tables import render_plans

GIB = 1 << 30


STATUS_TIMEOUT_S = 10.0


def statuses(ctx: StepContext) -> dict[str, pb.NodeStatus]:
    """Every agent's status. Agents that cannot be reached (a node booting, powered off or cut off,
    an agent restarting) fail the step with `unreachable`: the supervisor waits for them (phase
    `waiting`) and runs the bring-up again. Any other answer, a refused TLS handshake included, is
    final."""
    timeout = min(STATUS_TIMEOUT_S, ctx.cfg.number("NODE_LEASE_S"))
    nodes = list(ctx.clients)
    results = ctx.call(lambda: on_each(lambda node: ctx.clients[node].status(timeout=timeout), nodes,
                                       catch=(AgentUnavailable,)))
    away = []
    for node in nodes:
        result = results[node]
        if not isinstance(result, AgentUnavailable):
            continue
        if result.unreachable:
            away.append((node, result))
            continue
        raise ctx.fail(node, f"agent at {ctx.clients[node].target}: {result.meaning()}")
    if away:
        node, exc = away[0]
        raise ctx.fail_unreachable(tuple(n for n, _ in away),
                                   f"agent at {ctx.clients[node].target} {exc.meaning(exc.waited_s or timeout)}")
    return {node: results[node] for node in nodes}


def run(ctx: StepContext, deadline: float) -> None:
    statuses_by_node = statuses(ctx)
    versions = {name: s.agent_version for name, s in statuses_by_node.items()}
    if len(set(versions.values())) > 1:
        raise ctx.fail(None, "agents run different versions: " + ", ".join(f"{n} {v}" for n, v in versions.items())
                       + "; upgrade every node to one version")
    digests = {name: s.adapter_digest for name, s in statuses_by_node.items()}
    if len(set(digests.values())) > 1:
        raise ctx.fail(None, "adapter files differ between nodes: " +
                       ", ".join(f"{n} {d[:12] or 'none'}" for n, d in digests.items()) +
                       "; install the same dsv41-adapter everywhere")
    cfg = ctx.cfg
    if not cfg.flag("SKIP_VERIFY"):
        ctx.set_detail(f"verifying the checkpoint in {cfg.text('MODEL_DIR')}")
        result = ctx.call(lambda: weights.verify(cfg.text("MODEL_DIR"), cfg.integer("EXPECTED_SHARDS"),
                                                 os.path.join(ctx.state_dir, "weights-receipts.json")))
        if not result.ok:
            raise ctx.fail(ctx.head, f"weights: {result.detail}")
        ctx.log.info("weights_verified", f"weights: {result.detail}", hashed_bytes=result.hashed_bytes)
    ctx.bring.plans = render_plans(ctx, sync=True)
    plans = {p.node: p for p in ctx.bring.plans}
    need = cfg.number("RANK_MEMORY_GIB") * GIB
    stop_deadline = cfg.integer("RANK_STOP_TIMEOUT_S")
    for name, status in statuses_by_node.items():
        rank = status.rank
        running = rank.active_state in ("active", "activating")
        if running:
            # A bring-up starts a new group: a rank still running (another plan's, or one of a group
            # that broke while its node was unreachable) would never join it.
            what = (f"plan {rank.fingerprint}, not {plans[name].fingerprint}" if rank.fingerprint != plans[name].fingerprint
                    else f"a rank of an earlier group (plan {rank.fingerprint})")
            ctx.log.warning("stale_rank", f"{name} runs {what}: stopping it before launch", node_name=name)
            ctx.ask(name, lambda c: c.stop_rank(stop_deadline), mutates=True)
            status = ctx.ask(name, lambda c: c.status())
        available = status.memory.available_bytes
        if not running and available < need:
            raise ctx.fail(name, f"{available / GIB:.1f} GiB available, a rank needs {need / GIB:.1f} GiB "
                                 "(RANK_MEMORY_GIB)")
    problems = image_problems({name: dict(s.images) for name, s in statuses_by_node.items()},
                              {name: p.rank_spec for name, p in plans.items()})
    if problems:
        node, reason = problems[0]
        raise ctx.fail(node, reason)
    ctx.bring.generation = generation_of(ctx.bring.plans)
    check_tflops(ctx)


STEP = Step(Phase.PREFLIGHT, "PREFLIGHT_TIMEOUT_S", retryable=False, ranks=Ranks.NONE, run=run)
