"""preflight: every agent answers (waiting for one that cannot be reached yet), runs the same
version and adapter files, the weights verify (SKIP_VERIFY=0), the plans render with the DSpark
tables every node agrees on, leftover ranks of another plan are stopped, each node has the memory
a rank needs and holds the same image."""

from __future__ import annotations

import os

from dsv41.v1 import agent_pb2 as pb

from .. import weights
from ..agents import AgentUnavailable
from ..parallel import on_each
from ..state import generation_of
from .images import image_problems
from .step import Step, StepContext
from .tables import render_plans

GIB = 1 << 30


def statuses_once_reachable(ctx: StepContext, deadline: float) -> dict[str, pb.NodeStatus]:
    """Every agent's status. An agent that cannot be reached yet (its node still booting, its
    network coming up, the agent restarting) is asked again each second until the deadline; any
    other answer, and a refused TLS handshake, is final at once."""
    end = ctx.monotonic() + deadline
    answers: dict[str, pb.NodeStatus] = {}
    waiting: set[str] = set()
    pending = list(ctx.clients)
    while pending:
        timeout = max(1.0, min(end - ctx.monotonic(), 10.0))

        results = ctx.call(lambda nodes=tuple(pending), timeout=timeout: on_each(
            lambda node: ctx.clients[node].status(timeout=timeout), nodes, catch=(AgentUnavailable,)))
        retry = []
        for node in pending:
            result = results[node]
            if not isinstance(result, AgentUnavailable):
                answers[node] = result
                continue
            exc = result
            if exc.code != "UNAVAILABLE" or exc.explained or ctx.monotonic() + 1.0 > end:
                final = exc.after_waiting(deadline) if node in waiting else exc
                raise ctx.fail(node, f"agent at {ctx.clients[node].target}: {final.code}: {final.details}")
            if node not in waiting:
                waiting.add(node)
                ctx.log.warning("agent_waiting", f"{node}: agent at {ctx.clients[node].target} not reachable yet, "
                                f"waiting up to {deadline:g} s: {exc.details}", node_name=node)
                ctx.set_detail(f"waiting for the agent on {node}: {exc.details}")
            retry.append(node)
        pending = retry
        if pending:
            ctx.wait(1.0)
    return {node: answers[node] for node in ctx.clients}


def run(ctx: StepContext, deadline: float) -> None:
    statuses = statuses_once_reachable(ctx, deadline)
    versions = {name: s.agent_version for name, s in statuses.items()}
    if len(set(versions.values())) > 1:
        raise ctx.fail(None, "agents run different versions: " + ", ".join(f"{n} {v}" for n, v in versions.items())
                       + "; upgrade every node to one version")
    digests = {name: s.adapter_digest for name, s in statuses.items()}
    if len(set(digests.values())) > 1:
        raise ctx.fail(None, "adapter files differ between nodes: " +
                       ", ".join(f"{n} {d[:12] or 'none'}" for n, d in digests.items()) +
                       "; install the same dsv41-adapter everywhere")
    cfg = ctx.cfg
    if not cfg["SKIP_VERIFY"]:
        ctx.set_detail(f"verifying the checkpoint in {cfg['MODEL_DIR']}")
        result = ctx.call(lambda: weights.verify(str(cfg["MODEL_DIR"]), int(cfg["EXPECTED_SHARDS"]),
                                                 os.path.join(ctx.state_dir, "weights-receipts.json")))
        if not result.ok:
            raise ctx.fail(ctx.head, f"weights: {result.detail}")
        ctx.log.info("weights_verified", f"weights: {result.detail}", hashed_bytes=result.hashed_bytes)
    ctx.bring.plans = render_plans(ctx, sync=True)
    plans = {p.node: p for p in ctx.bring.plans}
    need = float(cfg["RANK_MEMORY_GIB"]) * GIB
    stop_deadline = int(cfg["RANK_STOP_TIMEOUT_S"])
    for name, status in statuses.items():
        rank = status.rank
        running = rank.active_state in ("active", "activating")
        if running and rank.fingerprint != plans[name].fingerprint:
            ctx.log.warning("stale_rank", f"{name} runs plan {rank.fingerprint}, not {plans[name].fingerprint}:"
                            " stopping it before launch", node_name=name)
            ctx.ask(name, lambda c: c.stop_rank(stop_deadline), mutates=True)
            status = ctx.ask(name, lambda c: c.status())
        available = status.memory.available_bytes
        if not running and available < need:
            raise ctx.fail(name, f"{available / GIB:.1f} GiB available, a rank needs {need / GIB:.1f} GiB "
                                 "(RANK_MEMORY_GIB)")
    problems = image_problems({name: dict(s.images) for name, s in statuses.items()},
                              {name: p.rank_spec for name, p in plans.items()})
    if problems:
        node, reason = problems[0]
        raise ctx.fail(node, reason)
    ctx.bring.generation = generation_of(ctx.bring.plans)


STEP = Step("preflight", "PREFLIGHT_TIMEOUT_S", retryable=False, run=run)
