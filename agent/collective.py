"""RunCollectiveTest: the collective bandwidth gate's job (adapter/collective_bench.py) as the
transient unit dsv41-collective-test.service, in the rank's own runtime (agent/rankjob.py)."""

from __future__ import annotations

from typing import Sequence

import grpc

from dsv41 import collective
from dsv41.v1 import agent_pb2 as pb

from . import rankjob
from .rankjob import MAX_TIMEOUT_S, JobRefused, RankJobRunner  # noqa: F401 - JobRefused: the job's refusal

JOB = rankjob.Job(unit="dsv41-collective-test.service", module="adapter.collective_bench",
                  what="collective bandwidth test", result_prefix=collective.RESULT_PREFIX,
                  off_switch="COLLECTIVE_GATE=0", event="collective_test")
UNIT = JOB.unit


def job_flags(spec: pb.CollectiveTestSpec) -> list[str]:
    return ["--master-addr", spec.master_addr, "--master-port", str(spec.master_port), "--rank", str(spec.rank.rank),
            "--nodes", ",".join(spec.nodes), "--backend", spec.backend, "--bytes", str(spec.message_bytes),
            "--iters", str(spec.iterations), "--warmup", str(spec.warmup_iterations),
            "--timeout-s", str(spec.timeout_s)]


def job_properties(launch, facts: dict[str, str], flags: Sequence[str], node: str, working_directory: str,
                   timeout_s: int) -> list[tuple[str, str, object]]:
    return rankjob.job_properties(JOB, launch, facts, flags, node, working_directory, timeout_s)


def result_pb(node: str, result: collective.Result, wall_s: float) -> pb.CollectiveTestResult:
    return pb.CollectiveTestResult(
        node=node, ok=True, backend=result.backend, transport=result.transport, wall_s=wall_s,
        figures=[pb.CollectiveTestFigure(group=f.group, nodes=list(f.nodes), message_bytes=f.nbytes,
                                         seconds=f.seconds, busbw_gbps=f.busbw_gbps) for f in result.figures])


def check_spec(spec: pb.CollectiveTestSpec, context) -> None:
    if spec.backend not in collective.BACKENDS:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"backend {spec.backend!r}: must be nccl or gloo")
    if not 2 <= len(spec.nodes) <= 64 or not 0 <= spec.rank.rank < len(spec.nodes):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "nodes: 2..64 names, this node's rank among them")
    if not 1 <= spec.master_port <= 65535 or not 1 <= spec.timeout_s <= MAX_TIMEOUT_S:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"master_port 1..65535 and timeout_s 1..{MAX_TIMEOUT_S} are required")
    if not 4 <= spec.message_bytes <= 1 << 32 or not 1 <= spec.iterations <= 1000 or spec.warmup_iterations > 100:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      "message_bytes 4..4 GiB, iterations 1..1000 and warmup_iterations 0..100")


class CollectiveTestRpcs:
    """RunCollectiveTest over the node's rank spec checks (rpc_rank.RankRpcs)."""

    def __init__(self, settings, systemd, events, rank, rank_rpcs, **runner_options):
        self._node = settings.node
        self._events = events
        self._runner = RankJobRunner(settings, systemd, events, rank, rank_rpcs, **runner_options)

    def RunCollectiveTest(self, request, context):
        check_spec(request, context)
        self._runner.refuse_while_rank_runs(JOB, context)
        self._events.info("collective_test_started", f"starting {UNIT}: {request.backend} all-reduce of "
                          f"{request.message_bytes} bytes among {len(request.nodes)} nodes", unit=UNIT,
                          backend=request.backend, message_bytes=request.message_bytes)
        run = self._runner.run(JOB, request.rank, job_flags(request), request.timeout_s, context)
        lines = run.lines
        try:
            result = collective.parse_result_line(lines)
        except (ValueError, KeyError, TypeError) as exc:
            result, lines = None, [*lines, f"unreadable result line: {exc}"]
        if result is not None:
            self._events.info("collective_test_done", f"{UNIT}: {collective.summary(result)}", unit=UNIT,
                              wall_s=round(run.wall_s, 2))
            return result_pb(self._node, result, run.wall_s)
        detail = rankjob.JobRun(lines, run.props, run.wall_s, False).failure(JOB)
        self._events.warning("collective_test_failed", detail, unit=UNIT)
        return pb.CollectiveTestResult(node=self._node, ok=False, detail=detail, wall_s=run.wall_s)
