"""A small client of systemd's D-Bus API on the system bus (pydbus over a private Gio connection).

What it guarantees, because the rank's life depends on it:
- every call has a timeout (pydbus's default is infinite);
- JobRemoved is subscribed before any job is started and every result is recorded, so a job
  that finishes before we begin waiting is not missed;
- a lost bus connection (dbus restarted) is re-established on the next call;
- signal callbacks (JobRemoved, PropertiesChanged) run on one GLib main-loop thread.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from gi.repository import Gio, GLib
from pydbus.bus import Bus

SYSTEMD = "org.freedesktop.systemd1"
MANAGER_PATH = "/org/freedesktop/systemd1"
MANAGER_IFACE = "org.freedesktop.systemd1.Manager"
UNIT_IFACE = "org.freedesktop.systemd1.Unit"
PROPS_IFACE = "org.freedesktop.DBus.Properties"
NO_SUCH_UNIT = "org.freedesktop.systemd1.NoSuchUnit"
_JOB_HISTORY = 512

PropertiesCallback = Callable[[str, str, dict], None]  # (unit path, interface, changed properties)


class SystemdError(Exception):
    def __init__(self, message: str, name: str = ""):
        super().__init__(message)
        self.name = name  # D-Bus error name, e.g. org.freedesktop.systemd1.NoSuchUnit


def unit_path(name: str) -> str:
    """The unit's object path: bytes outside [A-Za-z0-9] escaped as _XX (systemd's bus_label_escape)."""
    escaped = "".join(ch if ch.isascii() and ch.isalnum() else f"_{ord(ch):02x}" for ch in name)
    return f"{MANAGER_PATH}/unit/{escaped}"


@dataclass(frozen=True)
class JobResult:
    job: str
    unit: str
    result: str  # done, canceled, timeout, failed, dependency, skipped; "pending" if we stopped waiting


def _dbus_name(error: GLib.Error) -> str:
    return Gio.DBusError.get_remote_error(error) or ""


class Systemd:
    def __init__(self, call_timeout_s: float = 10.0, address: str | None = None):
        self._timeout_ms = int(call_timeout_s * 1000)
        self._address = address
        self._lock = threading.RLock()
        self._bus: Bus | None = None
        self._subscriptions: list = []
        self._jobs: collections.OrderedDict[str, JobResult] = collections.OrderedDict()
        self._jobs_changed = threading.Condition()
        self._property_callbacks: list[PropertiesCallback] = []
        self._reconnect_callbacks: list[Callable[[], None]] = []
        self._loop = GLib.MainLoop()
        self._loop_thread = threading.Thread(target=self._loop.run, name="glib-main", daemon=True)
        self._loop_thread.start()

    # -- connection

    def _connect(self) -> Bus:
        address = self._address or Gio.dbus_address_get_for_bus_sync(Gio.BusType.SYSTEM, None)
        flags = (Gio.DBusConnectionFlags.AUTHENTICATION_CLIENT |
                 Gio.DBusConnectionFlags.MESSAGE_BUS_CONNECTION)
        con = Gio.DBusConnection.new_for_address_sync(address, flags, None, None)
        con.set_exit_on_close(False)  # a restarted dbus must not end the agent
        bus = Bus(con)
        self._subscriptions = [
            bus.subscribe(sender=SYSTEMD, iface=MANAGER_IFACE, signal="JobRemoved", object=MANAGER_PATH,
                          signal_fired=self._on_job_removed),
            bus.subscribe(sender=SYSTEMD, iface=PROPS_IFACE, signal="PropertiesChanged",
                          signal_fired=self._on_properties_changed),
        ]
        con.call_sync(SYSTEMD, MANAGER_PATH, MANAGER_IFACE, "Subscribe", None, None,
                      Gio.DBusCallFlags.NONE, self._timeout_ms, None)
        return bus

    def _connection(self) -> Gio.DBusConnection:
        with self._lock:
            if self._bus is None or self._bus.con.is_closed():
                reconnected = self._bus is not None
                self._bus = self._connect()
                if reconnected:
                    for callback in list(self._reconnect_callbacks):
                        callback()
            return self._bus.con

    def close(self) -> None:
        with self._lock:
            if self._bus is not None:
                for sub in self._subscriptions:
                    sub.unsubscribe()
                self._bus.con.close_sync(None)
                self._bus = None
        self._loop.quit()

    def on_properties_changed(self, callback: PropertiesCallback) -> None:
        self._property_callbacks.append(callback)

    def on_reconnect(self, callback: Callable[[], None]) -> None:
        self._reconnect_callbacks.append(callback)

    def call(self, path: str, iface: str, method: str, args: GLib.Variant | None,
             reply: str | None = None, timeout_s: float | None = None):
        """One method call with a timeout; reconnects once if the connection was lost."""
        timeout_ms = self._timeout_ms if timeout_s is None else int(timeout_s * 1000)
        reply_type = GLib.VariantType(reply) if reply else None
        for attempt in (1, 2):
            con = self._connection()
            try:
                result = con.call_sync(SYSTEMD, path, iface, method, args, reply_type,
                                       Gio.DBusCallFlags.NONE, timeout_ms, None)
                return result.unpack() if result is not None else None
            except GLib.Error as exc:
                closed = exc.matches(Gio.io_error_quark(), Gio.IOErrorEnum.CLOSED) or con.is_closed()
                if closed and attempt == 1:
                    continue
                raise SystemdError(f"{method} {path}: {exc.message}", _dbus_name(exc)) from None
        raise AssertionError("unreachable")

    # -- signals

    def _on_job_removed(self, sender, path, iface, signal, params) -> None:
        job_id, job, unit, result = params
        with self._jobs_changed:
            self._jobs[job] = JobResult(job, unit, result)
            while len(self._jobs) > _JOB_HISTORY:
                self._jobs.popitem(last=False)
            self._jobs_changed.notify_all()

    def _on_properties_changed(self, sender, path, iface, signal, params) -> None:
        interface, changed, _invalidated = params
        for callback in list(self._property_callbacks):
            callback(path, interface, changed)

    def wait_job(self, job: str, timeout_s: float) -> JobResult:
        deadline = time.monotonic() + timeout_s
        with self._jobs_changed:
            while job not in self._jobs:
                left = deadline - time.monotonic()
                if left <= 0:
                    return JobResult(job, "", "pending")
                self._jobs_changed.wait(left)
            return self._jobs[job]

    # -- manager methods

    def start_transient(self, name: str, properties: Iterable[tuple[str, str, object]], timeout_s: float) -> JobResult:
        props = [(key, GLib.Variant(signature, value)) for key, signature, value in properties]
        args = GLib.Variant("(ssa(sv)a(sa(sv)))", (name, "fail", props, []))
        (job,) = self.call(MANAGER_PATH, MANAGER_IFACE, "StartTransientUnit", args, "(o)")
        return self.wait_job(job, timeout_s)

    def stop(self, name: str, timeout_s: float) -> JobResult:
        (job,) = self.call(MANAGER_PATH, MANAGER_IFACE, "StopUnit", GLib.Variant("(ss)", (name, "replace")), "(o)")
        return self.wait_job(job, timeout_s)

    def kill(self, name: str, signal: int, who: str = "all") -> None:
        """An unloaded unit has nothing to kill: its cgroup, and so every process of it, is gone."""
        try:
            self.call(MANAGER_PATH, MANAGER_IFACE, "KillUnit", GLib.Variant("(ssi)", (name, who, signal)))
        except SystemdError as exc:
            if exc.name != NO_SUCH_UNIT:
                raise

    def reset_failed(self, name: str) -> None:
        try:
            self.call(MANAGER_PATH, MANAGER_IFACE, "ResetFailedUnit", GLib.Variant("(s)", (name,)))
        except SystemdError as exc:
            if exc.name != NO_SUCH_UNIT:
                raise

    def properties(self, name: str, interfaces: Iterable[str]) -> dict | None:
        """All properties of the unit's interfaces merged, or None when the unit is not loaded."""
        try:
            (path,) = self.call(MANAGER_PATH, MANAGER_IFACE, "GetUnit", GLib.Variant("(s)", (name,)), "(o)")
        except SystemdError as exc:
            if exc.name == NO_SUCH_UNIT:
                return None
            raise
        merged: dict = {}
        for iface in interfaces:
            try:
                (values,) = self.call(path, PROPS_IFACE, "GetAll", GLib.Variant("(s)", (iface,)), "(a{sv})")
            except SystemdError as exc:
                if exc.name in ("org.freedesktop.DBus.Error.UnknownObject",
                                "org.freedesktop.DBus.Error.UnknownMethod"):
                    return None  # unloaded between the two calls
                raise
            merged.update(values)
        return merged
