"""The head's NFS export: one dsv41 export, served by the backend the spec names.

The configuration files are the state (each carries the export it describes in a header
line), so an agent restart knows what is exported without a file of its own. Unexporting
while a worker has the export mounted once wedged that worker until a power cycle, so
RemoveExport is refused while any worker is known to have it mounted, unless forced.
"""

from __future__ import annotations

import enum
import os
import threading
from dataclasses import dataclass

from .errors import Refused
from .ganesha import GaneshaExporter
from .kernel import KernelExporter
from .paths import check_path, resolve_in
from .spec import Export


class Outcome(str, enum.Enum):
    """What the last request did to the export (the wire's ExportState.Outcome, by name)."""
    EXPORTED = "EXPORTED"
    CONFIGURED = "CONFIGURED"  # configured, not checked since the agent started
    NOT_EXPORTED = "NOT_EXPORTED"
    REMOVED = "REMOVED"
    REMOVED_FORCED = "REMOVED_FORCED"
    WAS_NOT_EXPORTED = "WAS_NOT_EXPORTED"


@dataclass(frozen=True)
class ExportStatus:
    exported: bool
    path: str
    clients: tuple[str, ...]
    detail: str
    outcome: Outcome


NOT_EXPORTED = ExportStatus(False, "", (), "nothing exported", Outcome.NOT_EXPORTED)


class ExportManager:
    def __init__(self, kernel: KernelExporter, ganesha: GaneshaExporter, events, view_root: str = "/"):
        """view_root: where the host's file system is seen from (the agent's own view may have a
        private /tmp and /var/tmp; "/proc/1/root" is what PID 1, and so the NFS server, sees)."""
        self._backends = {"kernel": kernel, "ganesha": ganesha}
        self._events = events
        self._view = view_root
        self._lock = threading.Lock()
        self._last: ExportStatus | None = None

    def snapshot(self) -> ExportStatus:
        """The last known state, for GetStatus: no D-Bus, no NFS; before the first request since the
        agent started, what the dsv41 configuration files say."""
        last = self._last
        if last is None:
            current = self.configured()
            if current is None:
                return NOT_EXPORTED
            return ExportStatus(True, current.path, current.clients, f"configured for {current.backend}; not "
                                "checked since the agent started", Outcome.CONFIGURED)
        return last

    def configured(self) -> Export | None:
        for backend in self._backends.values():
            export = backend.configured()
            if export is not None:
                return export
        return None

    def ensure(self, export: Export) -> ExportStatus:
        resolved = resolve_in(self._view, export.path)
        if resolved != export.path:
            check_path(resolved, f"path {export.path} (resolves to)")
        real = os.path.join(self._view, resolved.lstrip("/"))
        if not os.path.isdir(real):
            raise Refused(f"path {export.path}: not a directory on this node (MODEL_DIR must hold the checkpoint)")
        note = "" if os.path.isfile(os.path.join(real, "config.json")) else \
            f"; warning: no config.json in {export.path}"
        with self._lock:
            for name, backend in self._backends.items():
                if name != export.backend and backend.configured() is not None:
                    backend.remove()  # both would serve port 2049
                    self._events.info("export_backend_switched", f"removed the {name} export to serve it with "
                                      f"{export.backend}", backend=export.backend)
            before = self._backends[export.backend].configured()
            status = self._backends[export.backend].ensure(export)
            result = ExportStatus(True, export.path, export.clients, status.detail + note, Outcome.EXPORTED)
            self._last = result
        if before != export:
            self._events.info("export_changed", f"exporting {export.path} over NFS ({export.backend}) to "
                              f"{', '.join(export.clients)}", path=export.path, backend=export.backend,
                              clients=",".join(export.clients))
        return result

    def remove(self, force: bool, mounted_by: tuple[str, ...]) -> ExportStatus:
        with self._lock:
            current = self.configured()
            if current is None:
                self._last = NOT_EXPORTED
                return ExportStatus(False, "", (), "was not exported", Outcome.WAS_NOT_EXPORTED)
            held = list(mounted_by)
            clients = self._backends["kernel"].active_clients() if current.backend == "kernel" else []
            if (held or clients) and not force:
                who = ", ".join(held + [f"NFS client {c}" for c in clients])
                raise Refused(f"export {current.path} is mounted by {who}: unexporting under a mounted worker can "
                              "wedge it until a power cycle; remove the mounts first (RemoveMount on each worker), "
                              "or force")
            for backend in self._backends.values():
                backend.remove()
            forced = bool(force and (held or clients))
            self._last = ExportStatus(False, current.path, (), "removed" + (" (forced)" if force else ""),
                                      Outcome.REMOVED_FORCED if forced else Outcome.REMOVED)
        if held or clients:
            self._events.warning("export_removed", f"unexported {current.path} although mounted by "
                                 f"{', '.join(held + clients)} (forced)", path=current.path, forced=1)
        else:
            self._events.info("export_removed", f"unexported {current.path}", path=current.path, forced=int(force))
        return self._last
