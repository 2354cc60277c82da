"""The few systemd operations NFS needs, over the agent's D-Bus client (agent.systemd.Systemd)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from gi.repository import GLib

from ..systemd import MANAGER_IFACE, MANAGER_PATH, NO_SUCH_UNIT, UNIT_IFACE, Systemd, SystemdError

MOUNT_IFACE = "org.freedesktop.systemd1.Mount"
SERVICE_IFACE = "org.freedesktop.systemd1.Service"


@dataclass(frozen=True)
class UnitState:
    name: str
    load_state: str    # loaded, not-found, ... ; "" when systemd does not know the unit at all
    active_state: str  # active, activating, deactivating, inactive, failed
    sub_state: str
    result: str        # the Mount/Service Result: success, exit-code, timeout, ...
    transient: bool
    description: str
    props: dict

    @property
    def known(self) -> bool:
        return self.load_state not in ("", "not-found")


class Units:
    def __init__(self, systemd: Systemd):
        self._systemd = systemd

    def state(self, name: str, kind_iface: str | None = None) -> UnitState:
        ifaces = (UNIT_IFACE,) + ((kind_iface,) if kind_iface else ())
        props = self._systemd.properties(name, ifaces) or {}
        return UnitState(name, str(props.get("LoadState", "")), str(props.get("ActiveState", "inactive")),
                         str(props.get("SubState", "")), str(props.get("Result", "")),
                         bool(props.get("Transient", False)), str(props.get("Description", "")), props)

    def start_transient(self, name: str, properties: Iterable[tuple[str, str, object]], timeout_s: float) -> str:
        """Creates and starts a transient unit; returns the job result (done, failed, ..., pending)."""
        return self._systemd.start_transient(name, properties, timeout_s).result

    def _job(self, method: str, name: str, timeout_s: float) -> str:
        (job,) = self._systemd.call(MANAGER_PATH, MANAGER_IFACE, method, GLib.Variant("(ss)", (name, "replace")),
                                    "(o)")
        return self._systemd.wait_job(job, timeout_s).result

    def start(self, name: str, timeout_s: float) -> str:
        return self._job("StartUnit", name, timeout_s)

    def restart(self, name: str, timeout_s: float) -> str:
        return self._job("RestartUnit", name, timeout_s)

    def stop(self, name: str, timeout_s: float) -> str:
        try:
            return self._systemd.stop(name, timeout_s).result
        except SystemdError as exc:
            if exc.name == NO_SUCH_UNIT:
                return "done"
            raise

    def reset_failed(self, name: str) -> None:
        self._systemd.reset_failed(name)
