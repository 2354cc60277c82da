"""A worker's mount of the head's export, as a transient systemd mount unit.

Why transient (StartTransientUnit with What/Where/Type/Options) rather than a unit file in
/run/systemd/system: no daemon-reload (which re-reads every unit on the node and can stall
PID 1 while a rank is starting), the unit and its properties are created in one call, and it
still belongs to PID 1, so an agent restart leaves the mount alone. It disappears at reboot,
which is what we want: the coordinator's `share` step mounts again once the head exports.

State: systemd says absent/mounting/failed; once mounted, a probe child (health.py) says
healthy, wrong content or stale. The requested spec is kept in the agent's state directory so
GetMount, Remount and RemoveMount work across agent restarts.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable

from ..systemd import SystemdError
from .errors import Refused
from .files import read_text, remove, write_atomic
from .health import HEALTHY, STALE, ProbeRunner, judge
from .paths import resolve_in, unit_name_for_path
from .spec import Mount
from .units import MOUNT_IFACE, UnitState, Units

DESCRIPTION_PREFIX = "dsv41 model weights"
ABSENT, MOUNTING, FAILED, WRONG_CONTENT = "absent", "mounting", "failed", "wrong_content"
UNCHECKED = "unchecked"  # a spec is kept, but nothing was looked at since the agent started


@dataclass(frozen=True)
class MountStatus:
    state: str          # absent, mounting, healthy, wrong_content, stale, failed; unchecked
    where: str = ""
    what: str = ""
    unit: str = ""
    detail: str = ""
    stale_for_s: float = 0.0
    shards_seen: int = 0


NO_MOUNT = MountStatus(ABSENT, detail="no mount requested")


def mount_properties(spec: Mount, timeout_s: float) -> list[tuple[str, str, object]]:
    return [
        ("Description", "s", f"{DESCRIPTION_PREFIX} ({spec.what})"),
        ("What", "s", spec.what),
        ("Where", "s", spec.where),
        ("Type", "s", spec.type),
        ("Options", "s", ",".join(spec.options)),
        ("TimeoutUSec", "t", int(timeout_s * 1_000_000)),
        # A stale mount must never wedge the unmount: detach it at once (umount -l) and, for NFS, abort
        # the server's outstanding requests (-f; on other file systems -f can abort the whole superblock).
        ("LazyUnmount", "b", True),
        ("ForceUnmount", "b", spec.type.startswith("nfs")),
        ("DirectoryMode", "u", 0o755),
    ]


def ours(state: UnitState) -> bool:
    return state.transient and state.description.startswith(DESCRIPTION_PREFIX)


def unit_verdict(spec: Mount, state: UnitState) -> MountStatus | None:
    """The mount's state from its unit alone; None when it is mounted and its content must be probed."""
    base = MountStatus(ABSENT, spec.where, spec.what, state.name)
    if not state.known or state.active_state == "inactive":
        return replace(base, detail=f"{spec.where} is not mounted ({state.name} is not active: never mounted, "
                                    "unmounted by hand, or the node rebooted): EnsureMount or Remount")
    if not ours(state):
        return replace(base, state=FAILED, detail=f"{spec.where} is mounted by {state.name} "
                       f"(What={state.props.get('What', '?')}), which dsv41 did not create")
    if state.active_state == "failed":
        return replace(base, state=FAILED, detail=f"mounting {spec.what} on {spec.where} failed (result "
                       f"{state.result or '?'}): see journalctl -u {state.name}; check the export and the link "
                       f"to {spec.server or 'the server'}")
    if state.active_state == "activating":
        return replace(base, state=MOUNTING, detail=f"mounting {spec.what} ({state.sub_state})")
    if state.active_state == "deactivating":
        return replace(base, state=MOUNTING, detail=f"unmounting {spec.where} ({state.sub_state})")
    return None


class MountManager:
    def __init__(self, units: Units, probe: ProbeRunner, events, state_file: str, view_root: str = "/",
                 job_wait_s: float = 10.0, mount_timeout_s: float = 90.0, stop_timeout_s: float = 30.0,
                 monotonic: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        self._units = units
        self._probe = probe
        self._events = events
        self._state_file = state_file
        self._view = view_root
        self._job_wait = job_wait_s
        self._mount_timeout = mount_timeout_s
        self._stop_timeout = stop_timeout_s
        self._monotonic = monotonic
        self._sleep = sleep
        self._lifecycle = threading.Lock()  # one ensure/remount/remove at a time
        self._lock = threading.Lock()
        self._spec = self._load()
        spec = self._spec
        self._last = NO_MOUNT if spec is None else MountStatus(
            UNCHECKED, spec.where, spec.what, unit_name_for_path(spec.where),
            "not checked since the agent started (GetMount checks it)")
        self._stale: tuple[str, float] | None = None  # (mount instance, first seen stale)

    # -- persisted spec

    def _load(self) -> Mount | None:
        try:
            return Mount.from_json(json.loads(read_text(self._state_file) or "null"))
        except (TypeError, ValueError, KeyError):
            return None

    def _save(self, spec: Mount | None) -> None:
        if spec is None:
            remove(self._state_file)
        else:
            os.makedirs(os.path.dirname(self._state_file), exist_ok=True)
            write_atomic(self._state_file, json.dumps(spec.to_json(), sort_keys=True) + "\n", 0o600)
        self._spec = spec

    @property
    def spec(self) -> Mount | None:
        return self._spec

    def snapshot(self) -> MountStatus:
        """The last observed state (stale_for_s brought up to date), without touching the mount."""
        with self._lock:
            last, stale = self._last, self._stale
        if last.state == STALE and stale is not None:
            return replace(last, stale_for_s=self._monotonic() - stale[1])
        return last

    # -- observation

    def get(self) -> MountStatus:
        spec = self._spec
        if spec is None:
            return self._record(NO_MOUNT, "")
        return self._observe(spec)

    def _observe(self, spec: Mount, job_result: str = "") -> MountStatus:
        unit = unit_name_for_path(spec.where)
        state = self._units.state(unit, MOUNT_IFACE)
        verdict = unit_verdict(spec, state)
        if verdict is not None:
            if verdict.state == ABSENT and job_result == "pending":
                verdict = replace(verdict, state=MOUNTING, detail=f"mounting {spec.what}: the mount job is still "
                                  "running")
            return self._record(verdict, "")
        instance = bytes(state.props.get("InvocationID", b"")).hex() or unit
        path = spec.where if self._view == "/" else os.path.join(self._view, spec.where.lstrip("/"))
        outcome = self._probe.run(path, spec.expected_shards, f"{unit}#{instance}")
        health = judge(outcome, spec.where, spec.expected_shards, self._probe.timeout_s)
        if outcome.stuck_pid and not outcome.reused:
            self._events.error("mount_probe_stuck", f"health check of {spec.where} blocked in the kernel; probe pid "
                               f"{outcome.stuck_pid} abandoned", where=spec.where, pid=outcome.stuck_pid)
        status = MountStatus(health.state, spec.where, spec.what, unit, health.detail, 0.0, health.shards_seen)
        return self._record(status, instance)

    def _record(self, status: MountStatus, instance: str) -> MountStatus:
        now = self._monotonic()
        with self._lock:
            before = self._last.state
            if status.state == STALE:
                if self._stale is None or self._stale[0] != instance:
                    self._stale = (instance, now)
                status = replace(status, stale_for_s=now - self._stale[1])
            else:
                self._stale = None
            self._last = status
        if status.state != before:
            fields = {"where": status.where, "unit": status.unit, "state": status.state}
            if status.state == STALE:
                self._events.warning("mount_stale", f"{status.where} is stale: {status.detail}", **fields)
            elif status.state == HEALTHY:
                self._events.info("mount_healthy", f"{status.where}: {status.detail}", **fields)
            elif status.state in (WRONG_CONTENT, FAILED):
                self._events.warning(f"mount_{status.state}", f"{status.where}: {status.detail}", **fields)
        return status

    # -- changes

    def ensure(self, spec: Mount, rank_running: bool) -> MountStatus:
        with self._lifecycle:
            unit = unit_name_for_path(spec.where)
            previous = self._spec
            if previous is not None and previous.where != spec.where:
                old_unit = unit_name_for_path(previous.where)
                old = self._units.state(old_unit, MOUNT_IFACE)
                if ours(old) and old.active_state != "inactive":
                    self._refuse_if_running(rank_running, previous, "replace it")
                    self._stop(old_unit)
            state = self._units.state(unit, MOUNT_IFACE)
            if state.known and state.active_state != "inactive" and not ours(state):
                raise Refused(f"{spec.where} is already a mount point ({unit}, What={state.props.get('What', '?')}) "
                              "that dsv41 did not create: unmount it, or choose another COMMON_MODEL")
            mounted = ours(state) and state.active_state in ("active", "activating")
            if mounted and previous == spec:
                return self._observe(spec)
            if ours(state) and state.active_state not in ("inactive", "failed"):
                self._refuse_if_running(rank_running, previous or spec, "replace it")
                self._stop(unit)
            return self._mount(spec, unit, "mount_created")

    def remount(self, rank_running: bool) -> MountStatus:
        with self._lifecycle:
            spec = self._spec
            if spec is None:
                raise Refused("no mount to remount: EnsureMount first")
            self._refuse_if_running(rank_running, spec, "remount")
            unit = unit_name_for_path(spec.where)
            state = self._units.state(unit, MOUNT_IFACE)
            if state.known and state.active_state != "inactive" and not ours(state):
                raise Refused(f"{spec.where} is mounted by {unit}, which dsv41 did not create: not touching it")
            if ours(state) and state.active_state not in ("inactive", "failed"):
                self._stop(unit)
            return self._mount(spec, unit, "mount_remounted")

    def remove(self, rank_running: bool) -> MountStatus:
        with self._lifecycle:
            spec = self._spec
            if spec is None:
                return self._record(NO_MOUNT, "")
            self._refuse_if_running(rank_running, spec, "unmount it")
            unit = unit_name_for_path(spec.where)
            state = self._units.state(unit, MOUNT_IFACE)
            if ours(state) and state.active_state != "inactive":
                self._stop(unit)
            self._save(None)
            self._events.info("mount_removed", f"unmounted {spec.where} and forgot it", where=spec.where, unit=unit)
            return self._record(MountStatus(ABSENT, spec.where, spec.what, unit, "removed"), "")

    def _refuse_if_running(self, rank_running: bool, spec: Mount, action: str) -> None:
        if rank_running:
            raise Refused(f"the rank is running and reads its weights from {spec.where}: stop the rank first, "
                          f"then {action}")

    def _stop(self, unit: str) -> None:
        result = self._units.stop(unit, self._stop_timeout)
        if result not in ("done", "skipped"):
            raise Refused(f"{unit} did not stop within {self._stop_timeout:g} s (job {result}): see journalctl -u "
                          f"{unit}")
        if self._units.state(unit, MOUNT_IFACE).active_state == "failed":
            self._units.reset_failed(unit)

    def _mount(self, spec: Mount, unit: str, event: str) -> MountStatus:
        if resolve_in(self._view, spec.where) != spec.where:
            raise Refused(f"where {spec.where}: goes through a symbolic link; systemd mounts only on the real path "
                          f"({resolve_in(self._view, spec.where)})")
        if self._units.state(unit, MOUNT_IFACE).active_state == "failed":
            self._units.reset_failed(unit)
        self._save(spec)
        with self._lock:
            self._stale = None
        props = mount_properties(spec, self._mount_timeout)
        for attempt in range(20):
            try:
                result = self._units.start_transient(unit, props, self._job_wait)
                break
            except SystemdError as exc:
                # A stopped transient unit is unloaded a moment after its job ends.
                if exc.name != "org.freedesktop.systemd1.UnitExists" or attempt == 19:
                    raise Refused(f"cannot create {unit}: {exc}") from None
                self._sleep(0.05)
        self._events.info(event, f"mounting {spec.what} on {spec.where} ({unit}): job {result}", where=spec.where,
                          what=spec.what, unit=unit, job_result=result)
        return self._observe(spec, result)
