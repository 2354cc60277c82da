"""The rank unit's lifecycle: start from a validated launch, stop with a deadline, watch, re-adopt.

The unit belongs to systemd (PID 1), not to the agent: an agent restart re-adopts it by name and
never restarts it. Its state comes from D-Bus, pushed by PropertiesChanged so an exit is seen
within a second, and the last exit is recorded before a failed unit is reset.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from dsv41.adapterversion import adapter_stale, adapter_version_from_fields
from dsv41.journal import EventLog

from .rankspec import (NO_FLOOR, RANK_UNIT, FloorSpec, RankLaunch, fill_env, fingerprint_from_fields, floor_from_fields,
                       unit_properties)
from .systemd import NO_SUCH_UNIT, UNIT_IFACE, Systemd, SystemdError, unit_path

SERVICE_IFACE = "org.freedesktop.systemd1.Service"
_UNKNOWN = 2**64 - 1


class RankError(Exception):
    """The start or stop could not be done; `code` is the gRPC status name to answer with."""

    def __init__(self, message: str, code: str = "FAILED_PRECONDITION"):
        super().__init__(message)
        self.code = code


MEMORY_FLOOR = "memory_floor"  # ExitRecord.cause: the agent's last line stopped the rank


@dataclass(frozen=True)
class ExitRecord:
    result: str
    code: str  # exited, killed, dumped
    status: int
    at_unix_s: float
    invocation_id: str
    cause: str = ""  # MEMORY_FLOOR when this agent ended the run; "" otherwise
    cause_detail: str = ""
    # When the run's first SGLang process ended (treewatch.py), which may be seconds before the
    # unit exited; 0 when none was seen to end first.
    first_loss_at_unix_s: float = 0.0
    first_loss_detail: str = ""


@dataclass(frozen=True)
class RankStatus:
    active_state: str  # active, activating, deactivating, inactive, failed, or absent
    sub_state: str
    main_pid: int
    active_since_unix_s: float
    memory_current: int
    fingerprint: str
    invocation_id: str
    status_text: str
    n_restarts: int
    last_exit: ExitRecord | None
    control_group: str
    stopping_cause: str = ""  # MEMORY_FLOOR while this agent ends the run, before it has exited
    stopping_detail: str = ""
    first_loss_at_unix_s: float = 0.0  # one of the run's SGLang processes ended (treewatch.py)
    first_loss_detail: str = ""
    adapter_version: str = ""  # the adapter this run loaded at its start; "" when not recorded

    @property
    def running(self) -> bool:
        return self.active_state in ("active", "activating", "reloading")


ABSENT = RankStatus("absent", "", 0, 0.0, 0, "", "", "", 0, None, "")
_CODES = {1: "exited", 2: "killed", 3: "dumped"}


def _status_from(props: dict, last_exit: ExitRecord | None) -> RankStatus:
    memory = int(props.get("MemoryCurrent", 0))
    since = int(props.get("ActiveEnterTimestamp", 0)) / 1e6
    invocation = bytes(props.get("InvocationID", b"")).hex()
    return RankStatus(
        active_state=str(props.get("ActiveState", "")), sub_state=str(props.get("SubState", "")),
        main_pid=int(props.get("MainPID", 0)), active_since_unix_s=since,
        memory_current=0 if memory == _UNKNOWN else memory,
        fingerprint=fingerprint_from_fields(props.get("LogExtraFields", [])),
        invocation_id=invocation, status_text=str(props.get("StatusText", "")),
        n_restarts=int(props.get("NRestarts", 0)), last_exit=last_exit,
        control_group=str(props.get("ControlGroup", "")),
        adapter_version=adapter_version_from_fields(props.get("LogExtraFields", [])))


def _exit_from(props: dict, clock: Callable[[], float]) -> ExitRecord:
    # systemd's own timestamp of the exit (µs), so exits on different nodes can be ordered
    exited_us = int(props.get("ExecMainExitTimestamp", 0))
    return ExitRecord(result=str(props.get("Result", "")), code=_CODES.get(int(props.get("ExecMainCode", 0)), ""),
                      status=int(props.get("ExecMainStatus", 0)), at_unix_s=exited_us / 1e6 if exited_us else clock(),
                      invocation_id=bytes(props.get("InvocationID", b"")).hex())


class RankManager:
    def __init__(self, systemd: Systemd, node: str, log: EventLog, working_directory: str,
                 cgroup_roots: tuple[str, ...] = ("/sys/fs/cgroup/unified", "/sys/fs/cgroup/systemd", "/sys/fs/cgroup"),
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic,
                 installed_adapter: Callable[[], str] = str):
        """installed_adapter: the version of the adapter installed now, which a start loads ("" unknown)."""
        self._systemd = systemd
        self._installed_adapter = installed_adapter
        self._node = node
        self._log = log
        self._workdir = working_directory
        self._cgroup_roots = cgroup_roots
        self._clock = clock
        self._monotonic = monotonic
        self._path = unit_path(RANK_UNIT)
        self._lifecycle = threading.Lock()  # one start or stop at a time
        self._state_lock = threading.Condition()
        self._props: dict = {}  # last known Unit+Service properties, merged from GetAll and signals
        self._props_version = 0  # bumped by every change of _props: a read begun earlier is older
        self._last_exit: ExitRecord | None = None
        self._watchers: list[Callable[[RankStatus], None]] = []
        self._expected_stop = False
        self._exits = 0  # exits recorded so far
        self._finalizing: set[str] = set()  # invocation IDs whose exit is being read from systemd
        # invocation ID -> (cause, detail, published: shown as its stopping_cause) this agent set
        self._causes: dict[str, tuple[str, str, bool]] = {}
        self._first_losses: dict[str, tuple[float, str]] = {}  # invocation ID -> (when, which process)
        systemd.on_properties_changed(self._on_properties)
        systemd.on_reconnect(self.refresh)

    # -- observation

    def watch(self, callback: Callable[[RankStatus], None]) -> Callable[[], None]:
        with self._state_lock:
            self._watchers.append(callback)
        return lambda: self._unwatch(callback)

    def _unwatch(self, callback) -> None:
        with self._state_lock:
            if callback in self._watchers:
                self._watchers.remove(callback)

    def status(self) -> RankStatus:
        with self._state_lock:
            if not self._props or self._props.get("LoadState") == "not-found":
                return replace(ABSENT, last_exit=self._last_exit)
            status = _status_from(self._props, self._last_exit)
            if not (status.running or status.active_state == "deactivating"):
                return status
            cause = self._causes.get(status.invocation_id)
            if cause and cause[2]:
                status = replace(status, stopping_cause=cause[0], stopping_detail=cause[1])
            lost_at, lost = self._first_losses.get(status.invocation_id, (0.0, ""))
            return replace(status, first_loss_at_unix_s=lost_at, first_loss_detail=lost)

    def control_group(self) -> str:
        """The rank unit's control group, "" when there is none; read with every memory sample, so
        it builds no RankStatus."""
        with self._state_lock:
            if not self._props or self._props.get("LoadState") == "not-found":
                return ""
            return str(self._props.get("ControlGroup", ""))

    def floor(self) -> tuple[str, FloorSpec]:
        """(invocation ID, floor) of the rank unit while it runs (starting, loading, serving or
        stopping); ("", NO_FLOOR) otherwise. Read at the floor's sampling rate: no RankStatus."""
        with self._state_lock:
            props = self._props
            if not props or props.get("ActiveState") not in ("active", "activating", "reloading", "deactivating"):
                return "", NO_FLOOR
            return bytes(props.get("InvocationID", b"")).hex(), floor_from_fields(props.get("LogExtraFields", []))

    def note_cause(self, invocation_id: str, cause: str, detail: str, publish: bool = True) -> None:
        """The reason this agent is ending the run `invocation_id`: its exit record will carry it.
        With `publish` (once the signal was sent) it is also the run's stopping_cause and the
        watchers hear it at once (the run is lost to its TP group from now on); without, it is only
        held for an exit that may come before the sender publishes it (withdraw_cause if the
        signal could not be sent)."""
        with self._state_lock:
            published = self._causes.get(invocation_id, ("", "", False))[2]
            first = publish and not published
            self._causes[invocation_id] = (cause, detail, publish or published)
            for key in list(self._causes)[:-8]:  # a few runs back is plenty
                self._causes.pop(key, None)
            status = self.status()
            watchers = list(self._watchers)
        if first:
            for callback in watchers:
                callback(status)

    @property
    def cgroup_roots(self) -> tuple[str, ...]:
        return self._cgroup_roots

    def main_pid(self) -> int:
        with self._state_lock:
            return int(self._props.get("MainPID", 0)) if self._props else 0

    def note_first_loss(self, invocation_id: str, at_unix_s: float, detail: str) -> None:
        """The first process of run `invocation_id` ended (treewatch.py): the run's state shows it at
        once (the watchers hear it) and its exit record carries it."""
        with self._state_lock:
            first = invocation_id not in self._first_losses
            self._first_losses.setdefault(invocation_id, (at_unix_s, detail))
            for key in list(self._first_losses)[:-8]:
                self._first_losses.pop(key, None)
            status = self.status()
            watchers = list(self._watchers)
        if first and status.invocation_id == invocation_id:
            for callback in watchers:
                callback(status)

    def withdraw_cause(self, invocation_id: str) -> None:
        """Forgets a cause held but not published (its signal was not sent); a published one stays."""
        with self._state_lock:
            if not self._causes.get(invocation_id, ("", "", True))[2]:
                self._causes.pop(invocation_id, None)

    def refresh(self) -> RankStatus:
        """Reads the unit's properties from systemd (start-up, reconnect, or before answering)."""
        props = self._systemd.properties(RANK_UNIT, (UNIT_IFACE, SERVICE_IFACE))
        self._apply(props or {}, replace_all=True)
        return self.status()

    def adopt(self) -> RankStatus:
        """On agent start: take over an existing rank unit without touching it."""
        state = self.refresh()
        if state.active_state == "failed":
            self._record_exit_and_reset()
            state = self.status()
        if state.running:
            installed = self._installed_adapter()
            self._log.info("rank_adopted", f"re-adopted running {RANK_UNIT} (pid {state.main_pid}, plan "
                           f"{state.fingerprint}, adapter {state.adapter_version or 'unknown'})", unit=RANK_UNIT,
                           pid=state.main_pid, fingerprint=state.fingerprint,
                           adapter_version=state.adapter_version or None, adapter_installed=installed or None)
            if adapter_stale(state.adapter_version, installed):
                self._log.event("rank_adapter_stale", f"{RANK_UNIT} runs adapter {state.adapter_version}, "
                                f"{installed} is installed: the next restart of the ranks loads it", "notice",
                                unit=RANK_UNIT, adapter_version=state.adapter_version, adapter_installed=installed)
        return state

    def _on_properties(self, path: str, interface: str, changed: dict) -> None:
        if path != self._path or interface not in (UNIT_IFACE, SERVICE_IFACE):
            return
        self._apply(dict(changed), replace_all=False)

    def _apply(self, props: dict, replace_all: bool) -> None:
        with self._state_lock:
            previous = self._props
            before = previous.get("ActiveState", "inactive") if previous else "inactive"
            self._props = props if replace_all else {**previous, **props}
            self._props_version += 1
            after = self._props.get("ActiveState", "inactive")
            exited = before in ("active", "activating", "deactivating", "reloading") and after in ("inactive", "failed")
            # The exit's facts: what systemd just said over what was known of the run that ended (a
            # re-read of a unit already garbage-collected has none of its own).
            exiting = {**previous, **{k: v for k, v in props.items() if k != "InvocationID" or v}}
            invocation = bytes(exiting.get("InvocationID", b"")).hex()
            if exited and invocation in self._finalizing:
                exited = False  # the signal and a re-read saw the same exit: record it once
            if exited:
                self._finalizing.add(invocation)
            status = self.status()
            watchers = list(self._watchers)
            self._state_lock.notify_all()
        if exited:
            # Read the exit from systemd before anything resets the unit; off the signal thread.
            threading.Thread(target=self._finalize_exit, args=(self._expected_stop, exiting, invocation),
                             name="rank-exit", daemon=True).start()
            return
        for callback in watchers:
            callback(status)

    def settled_status(self, timeout_s: float = 5.0) -> RankStatus:
        """The status once an exit being recorded is recorded: between the unit's state change and
        the exit's facts read from systemd, status() would show the unit stopped with the previous
        run's exit."""
        deadline = self._monotonic() + timeout_s
        with self._state_lock:
            while self._finalizing and self._monotonic() < deadline:
                self._state_lock.wait(0.05)
            return self.status()

    def _finalize_exit(self, expected: bool, exiting: dict, invocation: str) -> None:
        with self._state_lock:
            version = self._props_version
        try:
            props = self._systemd.properties(RANK_UNIT, (UNIT_IFACE, SERVICE_IFACE))
        except SystemdError:
            props = None
        with self._state_lock:
            # By the time systemd answers, a new run may already have started under the same name:
            # its properties describe that run, not the exit being recorded.
            same_run = bool(props) and props.get("InvocationID") == exiting.get("InvocationID")
            # The unit's state is taken from this read only if nothing newer arrived meanwhile (a
            # stop's reset-failed and re-read, a signal): else a unit already gone reads "failed".
            if same_run and self._props_version == version:
                self._props = props
                self._props_version += 1
            record = self._last_exit = self._with_cause(_exit_from(props if same_run else exiting, self._clock))
            self._exits += 1
            self._finalizing.discard(invocation)
            status = self.status()
            watchers = list(self._watchers)
            self._state_lock.notify_all()
        priority = "notice" if expected else "err"
        why = f" (stopped by the node's memory floor: {record.cause_detail})" if record.cause == MEMORY_FLOOR else ""
        self._log.event("rank_exit", f"{RANK_UNIT} exited: result {record.result}, {record.code} status "
                        f"{record.status}{' (requested stop)' if expected else ''}{why}", priority,
                        unit=RANK_UNIT, result=record.result, exit_code=record.code, exit_status=record.status,
                        requested=int(expected), cause=record.cause or None)
        for callback in watchers:
            callback(status)
        if status.active_state == "failed" and not expected:
            try:
                self._systemd.reset_failed(RANK_UNIT)
                self.refresh()  # the unit is gone now, and no signal says so
            except SystemdError as exc:
                self._log.warning("rank_reset_failed", f"ResetFailedUnit {RANK_UNIT}: {exc}", unit=RANK_UNIT)

    def wait_exit_recorded(self, seen: int, timeout_s: float) -> ExitRecord | None:
        """Waits until more than `seen` exits were recorded; returns the last exit."""
        deadline = self._monotonic() + timeout_s
        with self._state_lock:
            while self._exits <= seen and self._monotonic() < deadline:
                self._state_lock.wait(0.1)
            return self._last_exit

    def _with_cause(self, record: ExitRecord) -> ExitRecord:
        """The exit with the cause this agent set for its run (held under _state_lock): whichever
        path records an exit (the signal's read, a stop or start that finds the unit failed), the
        cause travels with it."""
        cause, detail, _ = self._causes.get(record.invocation_id, ("", "", False))
        lost_at, lost = self._first_losses.get(record.invocation_id, (0.0, ""))
        if lost_at >= record.at_unix_s:
            lost_at, lost = 0.0, ""  # the unit's own exit was first
        return replace(record, cause=cause, cause_detail=detail, first_loss_at_unix_s=lost_at, first_loss_detail=lost)

    def _record_exit_and_reset(self) -> None:
        with self._state_lock:
            self._last_exit = self._with_cause(_exit_from(self._props, self._clock))
        self._systemd.reset_failed(RANK_UNIT)
        self.refresh()

    def wait_for(self, predicate: Callable[[RankStatus], bool], timeout_s: float) -> RankStatus:
        deadline = self._monotonic() + timeout_s
        with self._state_lock:
            while not predicate(self.status()):
                left = deadline - self._monotonic()
                if left <= 0:
                    break
                self._state_lock.wait(min(left, 0.5))
            return self.status()

    # -- lifecycle

    def start(self, launch: RankLaunch, facts: dict[str, str], replace_running: bool,
              timeout_s: float) -> tuple[str, RankStatus]:
        """Returns (outcome, status): outcome is STARTED, ALREADY_RUNNING or REPLACED."""
        with self._lifecycle:
            current = self.refresh()
            outcome = "STARTED"
            if current.running:
                if current.fingerprint == launch.fingerprint:
                    return "ALREADY_RUNNING", current
                if not replace_running:
                    raise RankError(f"{RANK_UNIT} is running plan {current.fingerprint}; the request is plan "
                                    f"{launch.fingerprint}: stop it first or ask to replace it")
                self._stop_locked(launch.stop_timeout_s)
                outcome = "REPLACED"
            elif current.active_state == "failed":
                self._record_exit_and_reset()
            elif current.active_state == "deactivating":
                self._stop_locked(launch.stop_timeout_s)
            env = fill_env(launch, facts)
            adapter = self._installed_adapter()
            props = unit_properties(launch, env, self._node, self._workdir, adapter)
            self._expected_stop = False
            exits_before = self._exits
            try:
                job = self._systemd.start_transient(RANK_UNIT, props, timeout_s)
            except SystemdError as exc:
                if exc.name == "org.freedesktop.systemd1.UnitExists":
                    raise RankError(f"{RANK_UNIT} already exists (another start raced this one)") from None
                raise RankError(f"StartTransientUnit {RANK_UNIT}: {exc}", "INTERNAL") from None
            if job.result != "done":
                record = self.wait_exit_recorded(exits_before, 5.0)
                detail = _start_failure(job.result, record, launch.argv[0])
                self._log.error("rank_start_failed", f"{RANK_UNIT} did not start: {detail}", unit=RANK_UNIT,
                                job_result=job.result, fingerprint=launch.fingerprint)
                raise RankError(detail)
            state = self.refresh()
            self._log.info("rank_started", f"started {RANK_UNIT} rank {launch.rank} (pid {state.main_pid}, plan "
                           f"{launch.fingerprint}, adapter {adapter or 'unknown'})", unit=RANK_UNIT,
                           pid=state.main_pid, fingerprint=launch.fingerprint, rank=launch.rank,
                           adapter_version=adapter or None)
            return outcome, state

    def stop(self, deadline_s: float) -> tuple[str, ExitRecord | None, int]:
        """Returns (outcome, exit, leftover processes); outcome CLEAN, KILLED_AFTER_DEADLINE or WAS_NOT_RUNNING."""
        with self._lifecycle:
            return self._stop_locked(deadline_s)

    def _stop_locked(self, deadline_s: float) -> tuple[str, ExitRecord | None, int]:
        current = self.refresh()
        if current.active_state in ("absent", "inactive", "failed"):
            if current.active_state == "failed":
                self._record_exit_and_reset()
            return "WAS_NOT_RUNNING", self._last_exit, 0
        group = current.control_group
        self._expected_stop = True
        try:
            try:
                job = self._systemd.stop(RANK_UNIT, deadline_s)
            except SystemdError as exc:
                if exc.name != NO_SUCH_UNIT:
                    raise
                # It ended by itself and its transient unit was unloaded between the read and the stop.
                self.refresh()
                self._log.info("rank_stopped", f"{RANK_UNIT} ended by itself before the stop reached it",
                               unit=RANK_UNIT, outcome="WAS_NOT_RUNNING", leftover=0)
                return "WAS_NOT_RUNNING", self._last_exit, 0
            outcome = "CLEAN"
            if job.result == "pending":
                self._log.warning("rank_stop_deadline", f"{RANK_UNIT} still stopping after {deadline_s:g} s: "
                                  "sending SIGKILL to every process", unit=RANK_UNIT, deadline_s=deadline_s)
                self._systemd.kill(RANK_UNIT, signal.SIGKILL)
                job = self._systemd.wait_job(job.job, 30.0)
                outcome = "KILLED_AFTER_DEADLINE"
            state = self.wait_for(lambda s: s.active_state in ("absent", "inactive", "failed"), 10.0)
            if state.active_state == "failed":
                self._record_exit_and_reset()
            leftover = self._leftover_processes(group)
            if leftover:
                self._systemd.kill(RANK_UNIT, signal.SIGKILL)
            self._log.info("rank_stopped", f"stopped {RANK_UNIT}: {outcome.lower().replace('_', ' ')}, "
                           f"{leftover} process(es) left", unit=RANK_UNIT, outcome=outcome, leftover=leftover)
            return outcome, self._last_exit, leftover
        finally:
            self._expected_stop = False

    def _leftover_processes(self, control_group: str) -> int:
        if not control_group:
            return 0
        for root in self._cgroup_roots:
            procs = Path(root + control_group) / "cgroup.procs"
            try:
                return len([line for line in procs.read_text().split() if line])
            except OSError:
                continue
        return 0


def _start_failure(job_result: str, record: ExitRecord | None, executable: str) -> str:
    status = record.status if record else 0
    if status == 203:
        return f"the executable {executable} could not be run (status 203/EXEC: missing or not executable)"
    if 200 <= status <= 243:
        return (f"systemd could not set up the rank's execution environment (status {status}; e.g. a bind path "
                "or the working directory is missing): see journalctl -u dsv41-rank")
    return f"start job {job_result}" + (f", unit result {record.result}, exit status {status}" if record else "")

