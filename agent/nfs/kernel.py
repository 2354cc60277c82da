"""The kernel NFS server backend: /etc/exports.d/dsv41.exports and `exportfs -ra`."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from typing import Callable, Sequence

from .errors import Refused
from .files import read_text, remove, write_atomic
from .spec import Export
from .units import Units

EXPORTS_FILE = "/etc/exports.d/dsv41.exports"
EXPORTFS = ("/usr/sbin/exportfs", "-ra")
SERVER_UNIT = "nfs-server.service"
_HEADER = "# dsv41-export: "


@dataclass(frozen=True)
class BackendStatus:
    exported: bool
    export: Export | None
    detail: str


def render_exports(export: Export) -> str:
    """exports(5) text: one line per client, so a client can be read off (and diffed) at a glance."""
    opts = ",".join(export.options)
    header = json.dumps({"path": export.path, "clients": list(export.clients), "options": list(export.options),
                         "name": export.name}, sort_keys=True)
    lines = ["# Written by dsv41-agent (EnsureExport) and removed by RemoveExport; edits are overwritten.",
             _HEADER + header]
    lines += [f"{export.path} {client}({opts})" for client in export.clients]
    return "\n".join(lines) + "\n"


def parse_header(text: str | None) -> Export | None:
    """The export a file written by render_exports() or the ganesha renderer describes."""
    for line in (text or "").splitlines():
        if line.startswith(_HEADER):
            try:
                data = json.loads(line[len(_HEADER):])
                return Export(data["path"], tuple(data["clients"]), tuple(data["options"]), "", data["name"])
            except (ValueError, KeyError, TypeError):
                return None
    return None


def nfsd_clients(proc_root: str = "/proc") -> list[str]:
    """Addresses of the NFSv4 clients the kernel server holds state for (Linux >= 5.3)."""
    base = os.path.join(proc_root, "fs", "nfsd", "clients")
    try:
        ids = os.listdir(base)
    except OSError:
        return []
    found = []
    for client in sorted(ids):
        text = read_text_quiet(os.path.join(base, client, "info"))
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "address":
                address = value.strip().strip('"')
                host = address.rsplit(":", 1)[0].strip("[]")
                found.append(host)
    return sorted(set(found))


def read_text_quiet(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(65536)
    except OSError:
        return ""


class KernelExporter:
    def __init__(self, units: Units, exports_file: str = EXPORTS_FILE, exportfs: Sequence[str] = EXPORTFS,
                 proc_root: str = "/proc", server_unit: str = SERVER_UNIT, timeout_s: float = 30.0,
                 run: Callable[..., subprocess.CompletedProcess] = subprocess.run):
        self._units = units
        self.exports_file = exports_file
        self._exportfs = tuple(exportfs)
        self._proc_root = proc_root
        self._server_unit = server_unit
        self._timeout = timeout_s
        self._run = run

    def configured(self) -> Export | None:
        export = parse_header(read_text(self.exports_file))
        return None if export is None else Export(export.path, export.clients, export.options, "kernel", export.name)

    def active_clients(self) -> list[str]:
        return nfsd_clients(self._proc_root)

    def ensure(self, export: Export) -> BackendStatus:
        directory = os.path.dirname(self.exports_file)
        if not os.path.isdir(directory):
            raise Refused(f"{directory} does not exist: install nfs-kernel-server, or choose NFS_BACKEND=ganesha")
        changed = write_atomic(self.exports_file, render_exports(export))
        self._exportfs_sync()
        server = self._units.state(self._server_unit)
        if not server.known:
            raise Refused(f"{self._server_unit} is not installed: install nfs-kernel-server (kernel nfsd), or "
                          "choose NFS_BACKEND=ganesha")
        if server.active_state != "active":
            result = self._units.start(self._server_unit, self._timeout)
            if result != "done":
                raise Refused(f"{self._server_unit} did not start (job {result}): see journalctl -u "
                              f"{self._server_unit}")
        what = "updated" if changed else "unchanged"
        return BackendStatus(True, export, f"kernel nfsd: {len(export.clients)} client line(s) in "
                                           f"{self.exports_file} ({what}), {self._server_unit} active")

    def remove(self) -> bool:
        removed = remove(self.exports_file)
        if removed:
            self._exportfs_sync()
        return removed

    def _exportfs_sync(self) -> None:
        try:
            r = self._run(list(self._exportfs), capture_output=True, text=True, timeout=self._timeout)
        except FileNotFoundError:
            raise Refused(f"{self._exportfs[0]} not found: install nfs-kernel-server, or choose "
                          "NFS_BACKEND=ganesha") from None
        except subprocess.TimeoutExpired:
            raise Refused(f"{' '.join(self._exportfs)} did not finish within {self._timeout:g} s") from None
        if r.returncode != 0:
            raise Refused(f"{' '.join(self._exportfs)} failed (exit {r.returncode}): "
                          f"{(r.stderr or r.stdout).strip()[-500:]}")
