"""RunCollectiveTest: the collective bandwidth gate's job (adapter/collective_bench.py) as the
transient unit dsv41-collective-test.service, in the rank's own runtime.

The unit is the rank's unit as the node's RankSpec builds it (rankspec.unit_properties: the same
Python or container image, binds, environment, the GID index the agent fills in, the sandbox),
with SGLang's entry replaced by the job's and its own name, so the figures are those of the path
the rank will use. It never runs beside the rank: the rendezvous port and the GPU are the rank's.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Sequence

import grpc

from dsv41 import collective
from dsv41.v1 import agent_pb2 as pb

from .rankspec import CONTAINER_COMMAND, NO_FLOOR, SGLANG_ENTRY, USEC, RankLaunch, fill_env, unit_properties
from .systemd import UNIT_IFACE, SystemdError

UNIT = "dsv41-collective-test.service"
SERVICE_IFACE = "org.freedesktop.systemd1.Service"
JOB_MODULE = "adapter.collective_bench"
MAX_TIMEOUT_S = 600
LOG_TAIL = 12
# The adapters armed by this variable patch SGLang; the job imports no SGLang.
_NOT_FOR_THE_JOB = ("DSV41_SOURCE",)


class JobRefused(ValueError):
    """The rank's runtime cannot run the job (the stand-in engine's, which has no torch)."""


def job_flags(spec: pb.CollectiveTestSpec) -> list[str]:
    return ["--master-addr", spec.master_addr, "--master-port", str(spec.master_port), "--rank", str(spec.rank.rank),
            "--nodes", ",".join(spec.nodes), "--backend", spec.backend, "--bytes", str(spec.message_bytes),
            "--iters", str(spec.iterations), "--warmup", str(spec.warmup_iterations),
            "--timeout-s", str(spec.timeout_s)]


def job_argv(launch: RankLaunch, flags: Sequence[str]) -> tuple[str, ...]:
    """The rank's argv with SGLang's entry (and its flags) replaced by the job's: the same Python,
    or the same `docker run ... IMAGE python3`."""
    argv = launch.argv
    if launch.runtime == "host":
        if tuple(argv[1:3]) != SGLANG_ENTRY:
            raise JobRefused(f"the rank runs {argv[0]}, not a Python with SGLang: the job needs the rank's torch "
                             "(set COLLECTIVE_GATE=0 for the stand-in engine)")
        return (argv[0], "-m", JOB_MODULE, *flags)
    for i in range(len(argv) - len(CONTAINER_COMMAND) + 1):
        if tuple(argv[i:i + len(CONTAINER_COMMAND)]) == CONTAINER_COMMAND:
            return (*argv[:i], CONTAINER_COMMAND[0], "-m", JOB_MODULE, *flags)
    raise JobRefused("the rank's container command is not `python3 -m sglang.launch_server`")


def job_properties(launch: RankLaunch, facts: dict[str, str], flags: Sequence[str], node: str,
                   working_directory: str, timeout_s: int) -> list[tuple[str, str, object]]:
    """The job unit's properties: the rank unit's, with the job's argv, name and time limit, and
    no memory floor (the rank's floor guards the rank unit only)."""
    job = replace(launch, argv=job_argv(launch, flags), floor=NO_FLOOR)
    env = {k: v for k, v in fill_env(launch, facts).items() if k not in _NOT_FOR_THE_JOB}
    own = {
        "Description": ("s", f"dsv41 collective bandwidth test, rank {launch.rank} ({launch.runtime})"),
        "SyslogIdentifier": ("s", "dsv41-collective-test"),
        "LogExtraFields": ("aay", [f"DSV41_NODE={node}".encode(), b"DSV41_UNIT=dsv41-collective-test"]),
    }
    props = [(key, *own[key]) if key in own else (key, sig, value)
             for key, sig, value in unit_properties(job, env, node, working_directory)]
    # A bound on the job even if the agent that waits for it is gone.
    props.append(("RuntimeMaxUSec", "t", (timeout_s + 30) * USEC))
    return props


def result_pb(node: str, result: collective.Result, wall_s: float) -> pb.CollectiveTestResult:
    return pb.CollectiveTestResult(
        node=node, ok=True, backend=result.backend, transport=result.transport, wall_s=wall_s,
        figures=[pb.CollectiveTestFigure(group=f.group, nodes=list(f.nodes), message_bytes=f.nbytes,
                                         seconds=f.seconds, busbw_gbps=f.busbw_gbps) for f in result.figures])


def read_invocation(invocation_id: str) -> list[str]:
    """The lines the job's run wrote to the journal (its stdout and stderr), oldest first."""
    from systemd import journal  # imported here: only this RPC needs it

    reader = journal.Reader()
    try:
        reader.this_boot()
        reader.add_match(_SYSTEMD_INVOCATION_ID=invocation_id)
        return [str(entry.get("MESSAGE", "")) for entry in reader]
    finally:
        reader.close()


class CollectiveTestRpcs:
    """RunCollectiveTest over the node's rank spec checks (rpc_rank.RankRpcs)."""

    def __init__(self, settings, systemd, events, rank, rank_rpcs,
                 read_lines: Callable[[str], list[str]] = read_invocation,
                 monotonic: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        self._settings = settings
        self._systemd = systemd
        self._events = events
        self._rank = rank
        self._rank_rpcs = rank_rpcs
        self._read_lines = read_lines
        self._monotonic = monotonic
        self._sleep = sleep

    def _props(self) -> dict | None:
        return self._systemd.properties(UNIT, (UNIT_IFACE, SERVICE_IFACE))

    def _check(self, spec: pb.CollectiveTestSpec, context) -> None:
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
        if self._rank.status().running:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "the rank is running: the collective test needs its rendezvous port and its GPU; "
                          "stop the cluster first (dsv41ctl stop)")

    def RunCollectiveTest(self, request, context):
        self._check(request, context)
        launch = self._rank_rpcs.checked_launch(request.rank, context)
        facts = self._rank_rpcs.node_facts(launch, context)
        try:
            props = job_properties(launch, facts, job_flags(request), self._settings.node,
                                   self._settings.rank_cache_dir, request.timeout_s)
        except JobRefused as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        current = self._props()
        if current and current.get("ActiveState") in ("active", "activating", "deactivating"):
            context.abort(grpc.StatusCode.ABORTED, f"{UNIT} is already running (another test)")
        self._systemd.reset_failed(UNIT)
        started = self._monotonic()
        try:
            job = self._systemd.start_transient(UNIT, props, 30.0)
        except SystemdError as exc:
            context.abort(grpc.StatusCode.INTERNAL, f"StartTransientUnit {UNIT}: {exc}")
        self._events.info("collective_test_started", f"started {UNIT}: {request.backend} all-reduce of "
                          f"{request.message_bytes} bytes among {len(request.nodes)} nodes", unit=UNIT,
                          backend=request.backend, message_bytes=request.message_bytes)
        invocation, props_at_end = self._wait(job.result, started + request.timeout_s)
        return self._outcome(invocation, props_at_end, self._monotonic() - started)

    def _wait(self, job_result: str, deadline: float) -> tuple[str, dict]:
        """(invocation ID, the unit's last properties) once it has ended or been stopped at the deadline."""
        invocation, last = "", {}
        while True:
            props = self._props()
            if props:
                invocation = bytes(props.get("InvocationID", b"")).hex() or invocation
                last = props
            if not props or props.get("ActiveState") in ("inactive", "failed") or job_result != "done":
                return invocation, last
            if self._monotonic() >= deadline:
                self._events.warning("collective_test_deadline", f"{UNIT} still running at its deadline: stopping it",
                                     unit=UNIT)
                self._systemd.stop(UNIT, 15.0)
                return invocation, {**last, "Result": "timeout"}
            self._sleep(0.25)

    def _outcome(self, invocation: str, props: dict, wall_s: float) -> pb.CollectiveTestResult:
        node = self._settings.node
        lines: list[str] = []
        for _ in range(12):  # journald may write the last lines a moment after the exit
            lines = self._read_lines(invocation) if invocation else []
            if any(collective.RESULT_PREFIX in line for line in lines):
                break
            self._sleep(0.25)
        try:
            result = collective.parse_result_line(lines)
        except (ValueError, KeyError, TypeError) as exc:
            result, lines = None, [*lines, f"unreadable result line: {exc}"]
        self._systemd.reset_failed(UNIT)
        if result is not None:
            self._events.info("collective_test_done", f"{UNIT}: {collective.summary(result)}", unit=UNIT,
                              wall_s=round(wall_s, 2))
            return result_pb(node, result, wall_s)
        how = f"result {props.get('Result', 'unknown')}, exit status {props.get('ExecMainStatus', '?')}"
        tail = " | ".join(line for line in lines[-LOG_TAIL:] if line.strip())
        detail = f"{UNIT} printed no result ({how}); last lines: {tail or 'none (journalctl -u dsv41-collective-test)'}"
        self._events.warning("collective_test_failed", detail, unit=UNIT)
        return pb.CollectiveTestResult(node=node, ok=False, detail=detail, wall_s=wall_s)
