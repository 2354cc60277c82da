"""RunMatmulCheck: the pre-launch matrix-product check (adapter/matmul_check.py) as the transient
unit dsv41-matmul-check.service, in the rank's own runtime (agent/rankjob.py)."""

from __future__ import annotations

import grpc

from dsv41 import matmul
from dsv41.v1 import agent_pb2 as pb

from . import rankjob
from .rankjob import MAX_TIMEOUT_S, RankJobRunner

JOB = rankjob.Job(unit="dsv41-matmul-check.service", module="adapter.matmul_check",
                  what="matrix-product check", result_prefix=matmul.PREFIX.strip(),
                  off_switch="PREFLIGHT_TFLOPS_MIN=0", event="matmul_check")
MAX_SIZE = 32768


def job_flags(spec: pb.MatmulCheckSpec) -> list[str]:
    return ["--size", str(spec.size), "--iterations", str(spec.iterations)]


def check_spec(spec: pb.MatmulCheckSpec, context) -> None:
    if spec.size > MAX_SIZE or not 1 <= spec.iterations <= 10000 or not 1 <= spec.timeout_s <= MAX_TIMEOUT_S:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"size 0..{MAX_SIZE} (0: the job's), iterations 1..10000 and timeout_s 1..{MAX_TIMEOUT_S}")


class MatmulCheckRpcs:
    """RunMatmulCheck over the node's rank spec checks (rpc_rank.RankRpcs)."""

    def __init__(self, settings, systemd, events, rank, rank_rpcs, **runner_options):
        self._node = settings.node
        self._events = events
        self._runner = RankJobRunner(settings, systemd, events, rank, rank_rpcs, **runner_options)

    def RunMatmulCheck(self, request, context):
        check_spec(request, context)
        self._runner.refuse_while_rank_runs(JOB, context)
        run = self._runner.run(JOB, request.rank, job_flags(request), request.timeout_s, context)
        detail = ""
        if run.has_result:
            try:
                r = matmul.parse_result("\n".join(run.lines))
            except ValueError as exc:
                detail = f"{JOB.unit}: {exc}"
            else:
                self._events.info("matmul_check_done", f"{JOB.unit}: {r.tflops:.1f} TFLOPS on {r.device} "
                                  f"({r.dtype} {r.size}³ x {r.iterations} in {r.seconds:.3f} s)", unit=JOB.unit,
                                  tflops=r.tflops, wall_s=round(run.wall_s, 2))
                return pb.MatmulCheckResult(node=self._node, ok=True, tflops=r.tflops, device=r.device, dtype=r.dtype,
                                            size=r.size, iterations=r.iterations, seconds=r.seconds,
                                            wall_s=run.wall_s)
        detail = detail or run.failure(JOB)
        self._events.warning("matmul_check_failed", detail, unit=JOB.unit)
        return pb.MatmulCheckResult(node=self._node, ok=False, detail=detail, wall_s=run.wall_s)
