"""Whether the coordinator's SIGTERM is an operator's stop (stop the cluster) or the stop half of a
restart (leave the ranks serving; the next coordinator re-adopts them).

systemd keeps the job it runs for the unit until the unit is inactive, and a restart job keeps the
type "restart" through its stop half (it becomes a start only once the stop is done), so the
unit's job, read when SIGTERM arrives, tells `systemctl stop`, system shutdown and the package's
removal (a "stop" job) from `systemctl restart`, `try-restart` and a package upgrade (a "restart"
job). A SIGTERM that comes without a job (`kill`, `systemctl kill`) or a query that fails is not
taken as a request for an outage: the ranks are left serving and the log says how to stop them.
A coordinator that is not a systemd service (run by hand, or by a test harness) stops the cluster
on SIGTERM or SIGINT as before: nothing would restart it to re-adopt the ranks.

The systemd side is read with busctl (systemd's own tool, so present wherever systemd is) over the
system bus: Manager.GetUnitByPID(our PID) -> the unit's Job property -> the job's JobType. The unit
is ordered After=dbus.service so that the bus is still there when a system shutdown stops it.
"""

from __future__ import annotations

import enum
import json
import os
import subprocess
from dataclasses import dataclass
from typing import Callable, Mapping

SYSTEMD = "org.freedesktop.systemd1"
MANAGER_PATH = "/org/freedesktop/systemd1"
QUERY_TIMEOUT_S = 2.0  # each busctl call; three at most, well inside TimeoutStopSec

# systemd's job types (job_type_to_string) that end with the unit running again.
RESTART_JOBS = frozenset({"restart", "try-restart", "reload-or-start", "reload-or-restart"})
START_JOBS = frozenset({"start", "verify-active", "verify-started"})
STOP_JOBS = frozenset({"stop"})


class StopAction(enum.Enum):
    STOP_CLUSTER = "stop_cluster"
    KEEP_RANKS = "keep_ranks"


@dataclass(frozen=True)
class StopDecision:
    action: StopAction
    job_type: str | None  # systemd's job type for the unit, None when there was none or it is unknown
    reason: str
    certain: bool  # False when no job, or systemd could not be asked: the safe side was taken

    @property
    def stop_cluster(self) -> bool:
        return self.action is StopAction.STOP_CLUSTER


HOW_TO_STOP = "`systemctl stop dsv41-coordinator` or `dsv41ctl stop` stops the cluster"


def decide(job_type: str | None, query_error: str | None = None, service: bool = True) -> StopDecision:
    """The decision for a SIGTERM that came while systemd ran `job_type` for the coordinator's unit
    (None: no job, or `query_error` says why it is not known). Not a systemd `service` (run from a
    terminal or a test harness): nothing would restart it, so SIGTERM or Ctrl-C is the stop."""
    if not service:
        return StopDecision(StopAction.STOP_CLUSTER, None, "not running as a systemd service: a signal is "
                            "the operator's stop", True)
    if job_type in STOP_JOBS:
        return StopDecision(StopAction.STOP_CLUSTER, job_type, "systemd is stopping the unit (systemctl stop, "
                            "system shutdown or package removal)", True)
    if job_type in RESTART_JOBS:
        return StopDecision(StopAction.KEEP_RANKS, job_type, f"the stop half of a {job_type} of the unit: the next "
                            "coordinator re-adopts the ranks", True)
    if job_type in START_JOBS:
        return StopDecision(StopAction.KEEP_RANKS, job_type, f"a {job_type} of the unit is queued: the next "
                            "coordinator re-adopts the ranks", True)
    if job_type is not None:
        why = f"systemd's job for the unit is {job_type!r}, which is neither a stop nor a restart"
    elif query_error is not None:
        why = f"cannot ask systemd which job stops the unit ({query_error})"
    else:
        why = "SIGTERM came from outside systemd (no job for the unit)"
    return StopDecision(StopAction.KEEP_RANKS, job_type, f"{why}; the ranks are left serving, since no outage "
                        f"was asked for; {HOW_TO_STOP}", False)


class QueryFailed(Exception):
    pass


# runner(argv, timeout_s) -> stdout; raises subprocess.SubprocessError or OSError on failure.
Runner = Callable[[list[str], float], str]


def run_command(argv: list[str], timeout_s: float) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise QueryFailed(f"exit status {done.returncode}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


@dataclass(frozen=True)
class JobAnswer:
    job_type: str | None
    error: str | None = None


class SystemdJobQuery:
    """Asks systemd, through busctl, which job it runs for the unit that holds `pid`."""

    def __init__(self, runner: Runner = run_command, pid: int | None = None, timeout_s: float = QUERY_TIMEOUT_S,
                 busctl: str = "busctl", environ: Mapping[str, str] | None = None):
        self._runner = runner
        # systemd gives every service it starts INVOCATION_ID; a coordinator run by hand has none.
        self._service = "INVOCATION_ID" in (os.environ if environ is None else environ)
        self._pid = os.getpid() if pid is None else pid
        self._timeout_s = timeout_s
        self._busctl = busctl

    def _busctl_json(self, what: str, *args: str) -> object:
        """The "data" of busctl's JSON reply; QueryFailed naming `what` was asked."""
        argv = [self._busctl, "--system", "--json=short", f"--timeout={self._timeout_s:g}", *args]
        try:
            out = self._runner(argv, self._timeout_s + 1.0)
        except subprocess.TimeoutExpired:
            raise QueryFailed(f"busctl {what} timed out after {self._timeout_s + 1.0:g} s") from None
        except QueryFailed as exc:
            raise QueryFailed(f"busctl {what}: {exc}") from None
        except (OSError, subprocess.SubprocessError) as exc:
            raise QueryFailed(f"busctl {what}: {exc}") from None
        try:
            return json.loads(out)["data"]
        except (ValueError, KeyError, TypeError):
            raise QueryFailed(f"busctl {what}: unexpected output {out.strip()[:200]!r}") from None

    def job_type(self) -> JobAnswer:
        """The job type, None when the unit has no job; an error text when systemd cannot be asked."""
        try:
            unit = self._busctl_json("GetUnitByPID", "call", SYSTEMD, MANAGER_PATH, f"{SYSTEMD}.Manager",
                                     "GetUnitByPID", "u", str(self._pid))
            unit_path = unit[0] if isinstance(unit, list) else unit
            job = self._busctl_json("Unit.Job", "get-property", SYSTEMD, str(unit_path), f"{SYSTEMD}.Unit", "Job")
            job_id, job_path = job
            if not job_id:
                return JobAnswer(None)
            job_type = self._busctl_json("Job.JobType", "get-property", SYSTEMD, str(job_path), f"{SYSTEMD}.Job",
                                         "JobType")
            return JobAnswer(str(job_type))
        except QueryFailed as exc:
            return JobAnswer(None, str(exc))
        except (ValueError, TypeError, IndexError):
            return JobAnswer(None, "busctl: unexpected reply shape")

    def decision(self) -> StopDecision:
        if not self._service:
            return decide(None, service=False)
        answer = self.job_type()
        return decide(answer.job_type, answer.error)
