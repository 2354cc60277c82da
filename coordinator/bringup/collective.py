"""collective: every node runs a short all-reduce in the rank's own runtime (agent RPC
RunCollectiveTest, adapter/collective_bench.py) at once; the bus bandwidth of each pair of nodes
and of the whole group must reach the floors, and with NCCL over RoCE the transport NCCL chose
must be NET/IB. A link that is up with zero error counters can still run at a fraction of its
speed: the fabric step, which sends no traffic, cannot see it. COLLECTIVE_GATE=0 skips it, with a
warning at each bring-up."""

from __future__ import annotations

import time

from dsv41 import collective
from dsv41.v1 import agent_pb2 as pb

from ..agents import rank_spec_pb
from ..config import ClusterConfig
from ..plan import NodePlan
from ..state import Phase, Ranks
from .step import Step, StepContext, StepFailed


def backend(cfg: ClusterConfig) -> str:
    """COLLECTIVE_BACKEND, with auto resolved: gloo for CPU ranks (the demo, CI), NCCL for GPUs."""
    chosen = cfg.text("COLLECTIVE_BACKEND")
    if chosen != "auto":
        return chosen
    return "gloo" if cfg.text("RANK_DEVICE") == "cpu" else "nccl"


def floors(cfg: ClusterConfig) -> collective.Floors:
    # NCCL must take the RoCE path unless NCCL_IB_DISABLE=1 asked for sockets.
    transport = "NET/IB" if backend(cfg) == "nccl" and not cfg.flag("NCCL_IB_DISABLE") else ""
    return collective.Floors(cfg.number("COLLECTIVE_PAIR_MIN_GBPS"), cfg.number("COLLECTIVE_GROUP_MIN_GBPS"),
                             transport)


def test_spec(cfg: ClusterConfig, plan: NodePlan, plans: list[NodePlan], generation: str,
              timeout_s: int) -> pb.CollectiveTestSpec:
    """One node's job: its rank spec, the rendezvous at the head's fabric address on the rank's
    dist-init port (free before launch), the nodes in rank order."""
    return pb.CollectiveTestSpec(
        rank=rank_spec_pb(plan, generation), master_addr=cfg.text("HEAD_IP"), master_port=cfg.integer("DIST_PORT"),
        nodes=[p.node for p in sorted(plans, key=lambda p: p.rank)], backend=backend(cfg),
        message_bytes=cfg.integer("COLLECTIVE_BYTES"), iterations=cfg.integer("COLLECTIVE_ITERATIONS"),
        warmup_iterations=3, timeout_s=timeout_s)


def result_of(reply: pb.CollectiveTestResult) -> collective.Result:
    return collective.Result(reply.backend, reply.transport, tuple(
        collective.Figure(f.group, tuple(f.nodes), f.message_bytes, f.seconds, f.busbw_gbps) for f in reply.figures))


def report(cfg: ClusterConfig, replies: dict[str, pb.CollectiveTestResult], verdict: collective.Verdict,
           at_unix_s: float) -> pb.CollectiveTestReport:
    head = next(iter(replies.values()))
    f = floors(cfg)
    return pb.CollectiveTestReport(at_unix_s=at_unix_s, ok=verdict.ok, reason=verdict.reason, backend=head.backend,
                                   transports={n: r.transport for n, r in replies.items()},
                                   figures=list(head.figures), pair_floor_gbps=f.pair_gbps,
                                   group_floor_gbps=f.group_gbps)


def measure(ctx: StepContext, deadline: float) -> tuple[pb.CollectiveTestReport, collective.Verdict]:
    """Runs the job on every node at once and judges the figures (every node reports the same
    figures, each the slowest node's time; the transport is each node's own)."""
    plans = sorted(ctx.bring.plans, key=lambda p: p.rank)
    timeout = max(10, int(deadline) - 5)
    specs = {p.node: test_spec(ctx.cfg, p, plans, ctx.bring.generation, timeout) for p in plans}
    replies = ctx.each(lambda c: c.run_collective_test(specs[c.node], timeout + 30), nodes=list(specs),
                       mutates=True)
    for node, reply in replies.items():
        if not reply.ok:
            raise ctx.fail(node, reply.detail)
    verdicts = [collective.judge(result_of(r), floors(ctx.cfg)) for r in replies.values()]
    verdict = next((v for v in verdicts if not v.ok), verdicts[0])
    if not verdict.ok and not verdict.slowest and floors(ctx.cfg).transport:
        bad = [n for n, r in replies.items() if r.transport != floors(ctx.cfg).transport]
        verdict = collective.Verdict(False, f"{', '.join(bad)}: {verdict.reason}")
    return report(ctx.cfg, replies, verdict, time.time()), verdict


def run(ctx: StepContext, deadline: float) -> None:
    if len(ctx.bring.plans) < 2:  # a group of one node (GROUPS): no link between its ranks
        ctx.log.info("collective_single_node", "the group has one node: no link to measure")
        return
    ctx.set_detail(f"{backend(ctx.cfg)} all-reduce among {len(ctx.bring.plans)} nodes")
    result, verdict = measure(ctx, deadline)
    ctx.bring.collective = result
    figures = ", ".join(f"{f.group} {f.busbw_gbps:.2f} GB/s" for f in result.figures)
    transports = ",".join(sorted(set(result.transports.values()) - {""}))
    ctx.log.info("collective_measured", f"collective ({result.backend}{' via ' + transports if transports else ''}): "
                 f"{figures}", backend=result.backend, transport=transports or None, figures=figures,
                 slowest_pair_gbps=round(min((f.busbw_gbps for f in result.figures if f.group != collective.GROUP),
                                             default=0.0), 3))
    if not verdict.ok:
        raise ctx.fail(None, verdict.reason)


def on_demand(ctx: StepContext, deadline: float) -> tuple[bool, str]:
    """`dsv41ctl fabric test`: the step's measurement and decision, whatever COLLECTIVE_GATE says;
    (passed, the figures or the failure)."""
    try:
        run(ctx, deadline)
    except StepFailed as exc:
        return False, str(exc)
    report = ctx.bring.collective
    if report is None:
        return True, "the group has one node: no link to measure"
    return True, "passed: " + ", ".join(f"{f.group} {f.busbw_gbps:.2f} GB/s" for f in report.figures)


def skip(cfg: ClusterConfig) -> bool:
    return not cfg.flag("COLLECTIVE_GATE")


STEP = Step(Phase.COLLECTIVE, "COLLECTIVE_TIMEOUT_S", retryable=False, ranks=Ranks.NONE, run=run, skip=skip,
            skip_warning=("collective_gate_off", "the collective bandwidth gate is off (COLLECTIVE_GATE=0): the "
                          "links' bandwidth was not measured before launch"))
