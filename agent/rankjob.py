"""A short job in the rank's own runtime, as a transient unit beside no rank: the collective
bandwidth test (agent/collective.py) and the pre-launch matrix-product check (agent/matmul.py).

The unit is the rank's unit as the node's RankSpec builds it (rankspec.unit_properties: the same
Python or container image, binds, environment, the GID index the agent fills in, the sandbox),
with SGLang's entry replaced by the job's module and its own name, so what it measures is what the
rank will run on. It never runs beside the rank: the rank's ports and GPU are the rank's.
The model gateway's long-running unit (agent/gateway.py) is built by the same functions, with no
time limit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import grpc

from dsv41.v1 import agent_pb2 as pb

from .rankspec import CONTAINER_COMMAND, NO_FLOOR, SGLANG_ENTRY, USEC, RankLaunch, fill_env, unit_properties
from .systemd import UNIT_IFACE, SystemdError

SERVICE_IFACE = "org.freedesktop.systemd1.Service"
MAX_TIMEOUT_S = 600
LOG_TAIL = 12
# The adapters armed by this variable patch SGLang; the jobs import no SGLang.
_NOT_FOR_THE_JOB = ("DSV41_SOURCE",)


class JobRefused(ValueError):
    """The rank's runtime cannot run the job (the stand-in engine's, which has no torch)."""


@dataclass(frozen=True)
class Job:
    unit: str              # dsv41-collective-test.service
    module: str            # what `python3 -m` runs in place of SGLang
    what: str              # "collective bandwidth test", for the unit's description and the messages
    result_prefix: str     # the job's result line starts with it
    off_switch: str        # the cluster.env setting that leaves the job out (said when it cannot run)
    event: str             # its events' prefix: collective_test_started, _done, _failed, _deadline
    needs: str = "the rank's torch"  # what the job needs of the rank's runtime (said when it cannot run)

    @property
    def name(self) -> str:
        return self.unit.removesuffix(".service")


@dataclass(frozen=True)
class JobRun:
    lines: list[str]       # what the run wrote to the journal, oldest first
    props: dict            # the unit's last properties (Result "timeout" when stopped at the deadline)
    wall_s: float
    has_result: bool

    def failure(self, job: Job) -> str:
        how = f"result {self.props.get('Result', 'unknown')}, exit status {self.props.get('ExecMainStatus', '?')}"
        tail = " | ".join(line for line in self.lines[-LOG_TAIL:] if line.strip())
        return f"{job.unit} printed no result ({how}); last lines: {tail or f'none (journalctl -u {job.name})'}"


def job_argv(job: Job, launch: RankLaunch, flags: Sequence[str]) -> tuple[str, ...]:
    """The rank's argv with SGLang's entry (and its flags) replaced by the job's: the same Python,
    or the same `docker run ... IMAGE python3`."""
    argv = launch.argv
    if launch.runtime == "host":
        if tuple(argv[1:3]) != SGLANG_ENTRY:
            raise JobRefused(f"the rank runs {argv[0]}, not a Python with SGLang: the {job.what} needs "
                             f"{job.needs} (set {job.off_switch} for the stand-in engine)")
        return (argv[0], "-m", job.module, *flags)
    for i in range(len(argv) - len(CONTAINER_COMMAND) + 1):
        if tuple(argv[i:i + len(CONTAINER_COMMAND)]) == CONTAINER_COMMAND:
            return (*argv[:i], CONTAINER_COMMAND[0], "-m", job.module, *flags)
    raise JobRefused("the rank's container command is not `python3 -m sglang.launch_server`")


def job_properties(job: Job, launch: RankLaunch, facts: dict[str, str], flags: Sequence[str], node: str,
                   working_directory: str, timeout_s: int | None) -> list[tuple[str, str, object]]:
    """The job unit's properties: the rank unit's, with the job's argv, name and time limit (None:
    none, for a long-running unit), and no memory floor (the rank's floor guards the rank unit only)."""
    return job_unit_properties(job, replace(launch, argv=job_argv(job, launch, flags)), facts, node,
                               working_directory, timeout_s)


def job_unit_properties(job: Job, run: RankLaunch, facts: dict[str, str], node: str, working_directory: str,
                        timeout_s: int | None) -> list[tuple[str, str, object]]:
    """job_properties for a launch that already carries the job's argv (job_argv, or the gateway's own Python)."""
    run = replace(run, floor=NO_FLOOR)
    env = {k: v for k, v in fill_env(run, facts).items() if k not in _NOT_FOR_THE_JOB}
    own = {
        "Description": ("s", f"dsv41 {job.what}, rank {run.rank} ({run.runtime})"),
        "SyslogIdentifier": ("s", job.name),
        "LogExtraFields": ("aay", [f"DSV41_NODE={node}".encode(), f"DSV41_UNIT={job.name}".encode()]),
    }
    props = [(key, *own[key]) if key in own else (key, sig, value)
             for key, sig, value in unit_properties(run, env, node, working_directory)]
    if timeout_s is not None:
        # A bound on the job even if the agent that waits for it is gone.
        props.append(("RuntimeMaxUSec", "t", (timeout_s + 30) * USEC))
    return props


def read_invocation(invocation_id: str) -> list[str]:
    """The lines the job's run wrote to the journal (its stdout and stderr), oldest first."""
    from systemd import journal  # imported here: only the jobs need it

    reader = journal.Reader()
    try:
        reader.this_boot()
        reader.add_match(_SYSTEMD_INVOCATION_ID=invocation_id)
        return [str(entry.get("MESSAGE", "")) for entry in reader]
    finally:
        reader.close()


class RankJobRunner:
    """Runs one Job at a time per unit over the node's rank spec checks (rpc_rank.RankRpcs)."""

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

    def refuse_while_rank_runs(self, job: Job, context) -> None:
        if self._rank.status().running:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"the rank is running: the {job.what} needs its runtime's ports and its GPU; "
                          "stop the cluster first (dsv41ctl stop)")

    def run(self, job: Job, rank: pb.RankSpec, flags: Sequence[str], timeout_s: int, context) -> JobRun:
        """Starts the job's unit, waits until it ends (stopping it at `timeout_s`) and reads its lines."""
        launch = self._rank_rpcs.checked_launch(rank, context)
        facts = self._rank_rpcs.node_facts(launch, context)
        try:
            props = job_properties(job, launch, facts, flags, self._settings.node, self._settings.rank_cache_dir,
                                   timeout_s)
        except JobRefused as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        current = self._props(job)
        if current and current.get("ActiveState") in ("active", "activating", "deactivating"):
            context.abort(grpc.StatusCode.ABORTED, f"{job.unit} is already running (another {job.what})")
        self._systemd.reset_failed(job.unit)
        started = self._monotonic()
        try:
            started_job = self._systemd.start_transient(job.unit, props, 30.0)
        except SystemdError as exc:
            context.abort(grpc.StatusCode.INTERNAL, f"StartTransientUnit {job.unit}: {exc}")
        invocation, last = self._wait(job, started_job.result, started + timeout_s)
        lines = self._lines(job, invocation)
        self._systemd.reset_failed(job.unit)
        return JobRun(lines, last, self._monotonic() - started, any(job.result_prefix in line for line in lines))

    def _props(self, job: Job) -> dict | None:
        return self._systemd.properties(job.unit, (UNIT_IFACE, SERVICE_IFACE))

    def _wait(self, job: Job, job_result: str, deadline: float) -> tuple[str, dict]:
        """(invocation ID, the unit's last properties) once it has ended or been stopped at the deadline."""
        invocation, last = "", {}
        while True:
            props = self._props(job)
            if props:
                invocation = bytes(props.get("InvocationID", b"")).hex() or invocation
                last = props
            if not props or props.get("ActiveState") in ("inactive", "failed") or job_result != "done":
                return invocation, last
            if self._monotonic() >= deadline:
                self._events.warning(f"{job.event}_deadline",
                                     f"{job.unit} still running at its deadline: stopping it", unit=job.unit)
                self._systemd.stop(job.unit, 15.0)
                return invocation, {**last, "Result": "timeout"}
            self._sleep(0.25)

    def _lines(self, job: Job, invocation: str) -> list[str]:
        lines: list[str] = []
        for _ in range(12):  # journald may write the last lines a moment after the exit
            lines = self._read_lines(invocation) if invocation else []
            if any(job.result_prefix in line for line in lines):
                break
            self._sleep(0.25)
        return lines
