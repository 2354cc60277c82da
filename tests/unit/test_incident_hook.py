"""INCIDENT_HOOK runs: real executables (shell scripts) under the real subprocess machinery."""

import io
import json
import threading
import time

import pytest

from coordinator.hook import Alert, IncidentHook, iso_utc, run_once
from coordinator.runtime import Incident
from dsv41.journal import EventLog

pytestmark = pytest.mark.unit
ALERT = Alert("rank_exit", "spark3", "rank on spark3 died first: killed status 9", 1764612345.25)


def script(tmp_path, body: str, name: str = "hook"):
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def test_the_hook_gets_the_incident_in_its_environment_and_as_json_on_stdin(tmp_path):
    out = tmp_path / "out"
    path = script(tmp_path, f'env | grep ^DSV41_INCIDENT_ | sort > {out}.env\ncat > {out}.json\n')
    outcome = run_once(path, ALERT, 5.0, {"PATH": "/usr/bin:/bin"})
    assert outcome.ok and outcome.detail == "exit 0"
    env = dict(line.split("=", 1) for line in (tmp_path / "out.env").read_text().splitlines())
    assert env == {"DSV41_INCIDENT_KIND": "rank_exit", "DSV41_INCIDENT_NODE": "spark3",
                   "DSV41_INCIDENT_MESSAGE": ALERT.message, "DSV41_INCIDENT_AT": "2025-12-01T18:05:45.250+00:00",
                   "DSV41_INCIDENT_AT_UNIX_S": "1764612345.250000"}
    body = json.loads((tmp_path / "out.json").read_text())
    assert body == {"kind": "rank_exit", "node": "spark3", "message": ALERT.message,
                    "at": iso_utc(ALERT.at_unix_s), "at_unix_s": 1764612345.25}


def test_a_failing_hook_reports_its_status_and_what_it_said(tmp_path):
    outcome = run_once(script(tmp_path, "echo webhook refused >&2\nexit 3\n"), ALERT, 5.0, {})
    assert not outcome.ok and outcome.detail == "exit 3" and outcome.output == "webhook refused"


def test_a_hook_that_does_not_read_stdin_still_counts_by_its_exit(tmp_path):
    assert run_once(script(tmp_path, "exit 0\n"), ALERT, 5.0, {}).ok


def test_a_hanging_hook_and_its_children_are_killed_after_the_timeout(tmp_path):
    pidfile = tmp_path / "child"
    path = script(tmp_path, f"sleep 60 &\necho $! > {pidfile}\nsleep 60\n")
    started = time.monotonic()
    outcome = run_once(path, ALERT, 0.5, {"PATH": "/usr/bin:/bin"})
    assert time.monotonic() - started < 5.0
    assert not outcome.ok and outcome.detail == "killed after 0.5 s (INCIDENT_HOOK_TIMEOUT_S)"
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the hook's background child outlived the timeout"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_missing_executable_is_a_failure_not_an_exception(tmp_path):
    outcome = run_once(str(tmp_path / "gone"), ALERT, 1.0, {})
    assert not outcome.ok and outcome.detail.startswith("cannot run: ")


def _log():
    stream = io.StringIO()
    return EventLog("test", {}, stream=stream, use_journal=False), stream


def _wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_offer_never_blocks_and_a_full_queue_drops_with_a_warning(tmp_path):
    log, stream = _log()
    gate = threading.Event()

    def slow(path, alert, timeout, environ, started_pid):
        gate.wait(10)
        from coordinator.hook import Outcome
        return Outcome(True, "exit 0", 0.0)
    worker = IncidentHook("/hook", 1.0, log, environ={}, queue_max=2, runner=slow).start()
    incident = Incident(1.0, "spark2", "rank_exit", "gone")
    started = time.monotonic()
    offered = [worker.offer(incident) for _ in range(5)]  # one running, two queued, two dropped
    assert time.monotonic() - started < 0.5
    gate.set()
    assert offered.count(False) >= 2 and offered[0] is True
    assert stream.getvalue().count("DSV41_EVENT=incident_hook_dropped") == offered.count(False)
    _wait_for(lambda: stream.getvalue().count("DSV41_EVENT=incident_hook_done") == offered.count(True))
    worker.stop(2.0)


def test_each_outcome_is_one_journal_event_with_its_numbers(tmp_path):
    log, stream = _log()
    worker = IncidentHook(script(tmp_path, "echo no route >&2\nexit 7\n"), 5.0, log, environ={}).start()
    worker.offer(Incident(2.0, "spark1", "smoke_failed", "19+23 was not 42"))
    _wait_for(lambda: "incident_hook_failed" in stream.getvalue())
    line = stream.getvalue().strip().splitlines()[-1]
    assert line.startswith("<4>incident hook ") and "for smoke_failed on spark1 failed: exit 7" in line
    assert "it said: no route" in line
    assert "DSV41_OUTCOME=exit 7" in line and "DSV41_DURATION_S=" in line and "DSV41_NODE_NAME=spark1" in line
    worker.stop(2.0)


def test_stop_kills_a_hook_in_progress(tmp_path):
    log, stream = _log()
    pidfile = tmp_path / "pid"
    worker = IncidentHook(script(tmp_path, f"echo $$ > {pidfile}\nexec sleep 60\n"), 120.0, log,
                          environ={"PATH": "/usr/bin:/bin"}).start()
    worker.offer(Incident(2.0, "spark1", "rank_exit", "gone"))
    _wait_for(lambda: pidfile.exists() and pidfile.read_text().strip())
    pid = int(pidfile.read_text())
    worker.stop(5.0)
    _wait_for(lambda: not _alive(pid))
    assert "incident_hook_failed" in stream.getvalue() and "killed by signal 9" in stream.getvalue()


def test_the_hook_does_not_inherit_the_service_protocol_of_the_coordinator():
    env = ALERT.environment({"PATH": "/usr/bin", "NOTIFY_SOCKET": "/run/systemd/notify", "WATCHDOG_USEC": "30000000",
                             "WATCHDOG_PID": "1", "DSV41_INCIDENT_KIND": "stale"})
    assert env["PATH"] == "/usr/bin" and env["DSV41_INCIDENT_KIND"] == "rank_exit"
    assert not {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"} & set(env)
