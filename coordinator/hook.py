"""INCIDENT_HOOK: an operator's executable run once per incident, e.g. to post to a webhook.

The runtime's incident listener only puts the incident on a bounded queue; one worker thread runs
the hook, so a slow or hanging hook never delays the supervisor. Each run gets the incident in its
environment and as JSON on stdin, is killed (its whole process group) after the timeout, and its
outcome is one journal event. A full queue drops the incident with a warning instead of growing.
"""

from __future__ import annotations

import datetime
import json
import os
import queue
import signal
import stat
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping

from dsv41.journal import EventLog

QUEUE_MAX = 64
OUTPUT_MAX = 4096  # bytes of the hook's output kept for the journal event


@dataclass(frozen=True)
class Alert:
    """What a hook is told about one incident."""
    kind: str
    node: str
    message: str
    at_unix_s: float

    def payload(self) -> dict[str, object]:
        return {"kind": self.kind, "node": self.node, "message": self.message, "at": iso_utc(self.at_unix_s),
                "at_unix_s": round(self.at_unix_s, 6)}

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        # The coordinator's own service protocol stays its own: a hook must not notify systemd for it.
        env = {k: v for k, v in base.items() if not k.startswith(("DSV41_INCIDENT_", "NOTIFY_", "WATCHDOG_", "LISTEN_"))}
        env.update({"DSV41_INCIDENT_KIND": self.kind, "DSV41_INCIDENT_NODE": self.node,
                    "DSV41_INCIDENT_MESSAGE": self.message, "DSV41_INCIDENT_AT": iso_utc(self.at_unix_s),
                    "DSV41_INCIDENT_AT_UNIX_S": f"{self.at_unix_s:.6f}"})
        return env


def iso_utc(at_unix_s: float) -> str:
    return datetime.datetime.fromtimestamp(at_unix_s, datetime.timezone.utc).isoformat(timespec="milliseconds")


def file_problem(path: str, stat_fn: Callable[[str], os.stat_result] = os.stat) -> str | None:
    """What makes `path` unfit as a hook the coordinator (root) runs, or None. Root runs it, so only
    root may be able to change it."""
    try:
        st = stat_fn(path)
    except FileNotFoundError:
        return "no such file"
    except OSError as exc:
        return f"cannot stat it: {exc.strerror}"
    if not stat.S_ISREG(st.st_mode):
        return "must be a regular file (an executable)"
    if not st.st_mode & stat.S_IXUSR:
        return f"is not executable (mode {stat.S_IMODE(st.st_mode):04o}): chmod 755 it"
    if st.st_uid != 0:
        return f"is owned by uid {st.st_uid}: the coordinator runs it as root, so it must be owned by root"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"is writable by group or other (mode {stat.S_IMODE(st.st_mode):04o}): the coordinator runs it as "
                "root; chmod go-w it")
    return None


@dataclass(frozen=True)
class Outcome:
    ok: bool
    detail: str       # "exit 0", "exit 3", "killed after 10 s", "cannot run: ..."
    seconds: float
    output: str = ""  # the start of what it printed (stdout and stderr)


def run_once(path: str, alert: Alert, timeout_s: float, environ: Mapping[str, str],
             monotonic: Callable[[], float] = time.monotonic,
             started_pid: Callable[[int | None], None] = lambda pid: None) -> Outcome:
    """Runs the hook for one alert, waits at most timeout_s, kills its process group after that.
    `started_pid(pid)` is told the hook's process group while it runs, and None after."""
    started = monotonic()
    try:
        proc = subprocess.Popen([path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=alert.environment(environ), cwd="/", start_new_session=True, close_fds=True)
    except OSError as exc:
        return Outcome(False, f"cannot run: {exc.strerror or exc}", monotonic() - started)
    started_pid(proc.pid)
    try:
        return _wait(proc, alert, timeout_s, monotonic, started)
    finally:
        started_pid(None)


def _wait(proc: subprocess.Popen, alert: Alert, timeout_s: float, monotonic: Callable[[], float],
          started: float) -> Outcome:
    body = (json.dumps(alert.payload(), sort_keys=True) + "\n").encode()
    try:
        out, _ = proc.communicate(body, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        out, _ = proc.communicate()
        return Outcome(False, f"killed after {timeout_s:g} s (INCIDENT_HOOK_TIMEOUT_S)", monotonic() - started,
                       _text(out))
    except BrokenPipeError:  # it exited without reading stdin: its exit status still says how it went
        proc.wait()
        out = b""
    _kill_group(proc.pid)  # anything it left running in the background goes too
    code = proc.returncode
    detail = f"exit {code}" if code >= 0 else f"killed by signal {-code}"
    return Outcome(code == 0, detail, monotonic() - started, _text(out))


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _text(out: bytes | None) -> str:
    return (out or b"")[:OUTPUT_MAX].decode("utf-8", "replace").strip()


class IncidentHook:
    """Runs `path` for every incident offered, one at a time, in its own thread."""

    def __init__(self, path: str, timeout_s: float, log: EventLog, environ: Mapping[str, str] | None = None,
                 queue_max: int = QUEUE_MAX, runner: Callable[..., Outcome] = run_once):
        self.path = path
        self._timeout = timeout_s
        self._log = log
        self._environ = dict(os.environ if environ is None else environ)
        self._queue: queue.Queue = queue.Queue(maxsize=queue_max)
        self._runner = runner
        self._thread = threading.Thread(target=self._work, name="incident-hook", daemon=True)
        self._stopping = threading.Event()
        self._running: int | None = None  # process group of the run in progress

    def start(self) -> "IncidentHook":
        self._thread.start()
        return self

    def offer(self, incident) -> bool:
        """The runtime's incident listener (any object with at_unix_s, node, kind, message): never blocks."""
        alert = Alert(incident.kind, incident.node, incident.message, incident.at_unix_s)
        try:
            self._queue.put_nowait(alert)
            return True
        except queue.Full:
            self._log.warning("incident_hook_dropped", f"incident hook: {self._queue.maxsize} incidents are waiting "
                              f"for {self.path}; not running it for {alert.kind} on {alert.node}",
                              incident=alert.kind, node_name=alert.node, hook=self.path)
            return False

    def stop(self, wait_s: float = 0.0) -> None:
        """Ends the worker and kills a run in progress (a coordinator that exits leaves no hook behind)."""
        self._stopping.set()
        running = self._running
        if running is not None:
            _kill_group(running)
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        if wait_s:
            self._thread.join(wait_s)

    def _work(self) -> None:
        while not self._stopping.is_set():
            alert = self._queue.get()
            if alert is None:
                break
            try:
                outcome = self._runner(self.path, alert, self._timeout, self._environ,
                                       started_pid=lambda pid: setattr(self, "_running", pid))
            except Exception as exc:  # the worker must outlive anything one run throws
                outcome = Outcome(False, f"cannot run: {exc!r}", 0.0)
            self._report(alert, outcome)

    def _report(self, alert: Alert, outcome: Outcome) -> None:
        fields = dict(incident=alert.kind, node_name=alert.node, hook=self.path, outcome=outcome.detail,
                      duration_s=round(outcome.seconds, 3))
        if outcome.ok:
            self._log.info("incident_hook_done", f"incident hook {self.path} for {alert.kind} on {alert.node}: "
                           f"{outcome.detail} in {outcome.seconds:.2f} s", **fields)
        else:
            said = f"; it said: {outcome.output[:500]}" if outcome.output else ""
            self._log.warning("incident_hook_failed", f"incident hook {self.path} for {alert.kind} on {alert.node} "
                              f"failed: {outcome.detail} after {outcome.seconds:.2f} s{said}",
                              output=outcome.output[:OUTPUT_MAX] or None, **fields)
