"""coordinator.stopjob: which SIGTERM stops the cluster, and the busctl query over outputs recorded
from systemd 252 (Debian 12) in a booted node."""

import subprocess

import pytest

from coordinator.stopjob import QueryFailed, StopAction, SystemdJobQuery, decide, run_command

pytestmark = pytest.mark.unit

# Recorded: `busctl --system --json=short --timeout=2 ...` in a booted testbed node (systemd 252).
RECORDED_UNIT_BY_PID = '{"type":"o","data":["/org/freedesktop/systemd1/unit/dsv41_2dcoordinator_2eservice"]}\n'
RECORDED_JOB = '{"type":"(uo)","data":[80,"/org/freedesktop/systemd1/job/80"]}\n'
RECORDED_NO_JOB = '{"type":"(uo)","data":[0,"/"]}\n'
RECORDED_JOB_TYPE = '{"type":"s","data":"%s"}\n'
RECORDED_NO_BUS = "Call failed: Transport endpoint is not connected\n"  # dbus already stopped
SERVICE = {"INVOCATION_ID": "0123456789abcdef0123456789abcdef"}  # what systemd gives every service
RECORDED_UNKNOWN_JOB = ("Failed to get property JobType on interface org.freedesktop.systemd1.Job: "
                        "Unknown object '/org/freedesktop/systemd1/job/80'.\n")


@pytest.mark.parametrize("job_type", ["stop"])
def test_a_stop_job_stops_the_cluster(job_type):
    decision = decide(job_type)
    assert decision.action is StopAction.STOP_CLUSTER and decision.stop_cluster and decision.certain
    assert "systemctl stop" in decision.reason


@pytest.mark.parametrize("job_type", ["restart", "try-restart", "reload-or-start", "reload-or-restart"])
def test_the_stop_half_of_a_restart_keeps_the_ranks(job_type):
    decision = decide(job_type)
    assert decision.action is StopAction.KEEP_RANKS and not decision.stop_cluster and decision.certain
    assert job_type in decision.reason and "re-adopts" in decision.reason


def test_a_start_queued_behind_the_stop_keeps_the_ranks():
    decision = decide("start")
    assert not decision.stop_cluster and decision.certain


@pytest.mark.parametrize("job_type, error, says", [
    (None, None, "SIGTERM came from outside systemd"),
    (None, "busctl GetUnitByPID: timed out", "cannot ask systemd which job stops the unit (busctl GetUnitByPID"),
    ("reload", None, "'reload', which is neither a stop nor a restart"),
])
def test_an_unknown_cause_keeps_the_ranks_and_says_how_to_stop_them(job_type, error, says):
    decision = decide(job_type, error)
    assert not decision.stop_cluster and not decision.certain
    assert says in decision.reason
    assert "dsv41ctl stop" in decision.reason and "systemctl stop dsv41-coordinator" in decision.reason


class Recorded:
    """A busctl runner that answers each call from recorded outputs, in order; keeps the argv."""

    def __init__(self, *replies):
        self.replies = list(replies)
        self.calls: list[tuple[list[str], float]] = []

    def __call__(self, argv, timeout_s):
        self.calls.append((argv, timeout_s))
        reply = self.replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        return reply


def test_the_query_follows_the_unit_of_our_pid_to_its_job_type():
    runner = Recorded(RECORDED_UNIT_BY_PID, RECORDED_JOB, RECORDED_JOB_TYPE % "restart")
    answer = SystemdJobQuery(runner, pid=4242, timeout_s=2.0).job_type()
    assert answer.job_type == "restart" and answer.error is None
    (first, t1), (second, _), (third, _) = runner.calls
    assert first[:4] == ["busctl", "--system", "--json=short", "--timeout=2"]
    assert first[-3:] == ["GetUnitByPID", "u", "4242"] and t1 == 3.0
    assert "/org/freedesktop/systemd1/unit/dsv41_2dcoordinator_2eservice" in second and second[-1] == "Job"
    assert "/org/freedesktop/systemd1/job/80" in third and third[-1] == "JobType"


def test_a_stop_job_read_from_systemd_decides_a_stop():
    runner = Recorded(RECORDED_UNIT_BY_PID, RECORDED_JOB, RECORDED_JOB_TYPE % "stop")
    assert SystemdJobQuery(runner, pid=1, environ=SERVICE).decision().stop_cluster


def test_a_coordinator_that_is_not_a_systemd_service_stops_the_cluster_without_asking():
    runner = Recorded()
    decision = SystemdJobQuery(runner, pid=1, environ={"PATH": "/usr/bin"}).decision()
    assert decision.stop_cluster and decision.certain and "not running as a systemd service" in decision.reason
    assert runner.calls == []


def test_no_job_is_none_without_an_error_and_asks_no_further():
    runner = Recorded(RECORDED_UNIT_BY_PID, RECORDED_NO_JOB)
    answer = SystemdJobQuery(runner, pid=1).job_type()
    assert answer.job_type is None and answer.error is None and len(runner.calls) == 2


@pytest.mark.parametrize("replies, says", [
    ((QueryFailed("exit status 1: " + RECORDED_NO_BUS.strip()),),
     "busctl GetUnitByPID: exit status 1: Call failed: Transport endpoint is not connected"),
    ((subprocess.TimeoutExpired(["busctl"], 3.0),), "busctl GetUnitByPID timed out after 3 s"),
    ((FileNotFoundError(2, "No such file or directory"),), "busctl GetUnitByPID: [Errno 2]"),
    ((RECORDED_UNIT_BY_PID, RECORDED_JOB, QueryFailed("exit status 1: " + RECORDED_UNKNOWN_JOB.strip())),
     "busctl Job.JobType: exit status 1: Failed to get property JobType"),
    (("not json\n",), "busctl GetUnitByPID: unexpected output 'not json'"),
    ((RECORDED_UNIT_BY_PID, '{"type":"(uo)","data":[80]}\n'), "unexpected reply shape"),
])
def test_a_failed_query_is_unknown_with_its_reason_and_keeps_the_ranks(replies, says):
    answer = SystemdJobQuery(Recorded(*replies), pid=1).job_type()
    assert answer.job_type is None and says in answer.error
    decision = SystemdJobQuery(Recorded(*replies), pid=1, environ=SERVICE).decision()
    assert not decision.stop_cluster and not decision.certain and says in decision.reason


def test_run_command_returns_stdout_and_raises_on_failure_and_timeout():
    assert run_command(["sh", "-c", "echo out"], 5.0) == "out\n"
    with pytest.raises(QueryFailed, match="exit status 3: bad"):
        run_command(["sh", "-c", "echo bad >&2; exit 3"], 5.0)
    with pytest.raises(subprocess.TimeoutExpired):
        run_command(["sleep", "5"], 0.2)


class Notes:
    def __init__(self):
        self.lines: list[str] = []

    def status(self, text):
        self.lines.append(text)


@pytest.mark.parametrize("job_type, priority, status, says", [
    ("stop", "<6>", "stopping the cluster: rank 0 first, then the workers", "stopping the cluster: systemd is stopping"),
    ("restart", "<6>", "exiting; the ranks are left serving for the next coordinator", "exiting, ranks left serving"),
    (None, "<4>", "exiting; the ranks are left serving (SIGTERM without a stop job)", "`dsv41ctl stop` stops the cluster"),
])
def test_the_stopping_event_and_status_line_say_whether_the_ranks_are_kept(job_type, priority, status, says):
    import io

    from coordinator.daemon import log_stopping
    from dsv41.journal import EventLog
    stream, notes = io.StringIO(), Notes()
    log_stopping(EventLog("dsv41-coordinator", {}, stream=stream, use_journal=False), notes, decide(job_type))
    line = stream.getvalue()
    assert notes.lines == [status]
    assert line.startswith(priority) and says in line and "DSV41_EVENT=coordinator_stopping" in line
    assert f"DSV41_JOB_TYPE={job_type or 'none'}" in line
    assert f"DSV41_RANKS_KEPT={'no' if job_type == 'stop' else 'yes'}" in line
