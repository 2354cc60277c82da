"""The nfs-ganesha backend, for hosts without the kernel NFS server.

dsv41 runs its own nfs-ganesha as the transient unit dsv41-nfs-ganesha.service from a
configuration file it owns completely (/etc/ganesha/dsv41.conf): the distribution's
ganesha.conf and nfs-ganesha.service are left alone (and must not run, they would hold
port 2049). NFSv4 only, without NLM/rquota (no rpcbind or rpc.statd needed), and Graceless:
the export serves the moment it starts, not after a 90 s NFSv4 grace period; the export is
read-only, so there is no lock or open state worth reclaiming.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Callable

from .errors import Refused
from .files import read_text, remove, write_atomic
from .kernel import _HEADER, BackendStatus, parse_header
from .spec import Export
from .units import SERVICE_IFACE, Units

CONFIG_FILE = "/etc/ganesha/dsv41.conf"
UNIT = "dsv41-nfs-ganesha.service"
BINARY = "/usr/bin/ganesha.nfsd"
NFS_PORT = 2049
# Units that would hold port 2049 (or serve other exports from the same host) alongside ours.
CONFLICTING_UNITS = ("nfs-ganesha.service", "nfs-server.service", "nfs-kernel-server.service")
_SQUASH = {"root_squash": "Root_Squash", "no_root_squash": "No_Root_Squash", "all_squash": "All_Squash"}


def render_ganesha(export: Export) -> str:
    """A complete nfs-ganesha configuration serving one read-only export at /NAME."""
    flags = set(export.options)
    values = dict(o.split("=", 1) for o in export.options if "=" in o)
    squash = next((_SQUASH[o] for o in export.options if o in _SQUASH), "Root_Squash")
    header = json.dumps({"path": export.path, "clients": list(export.clients), "options": list(export.options),
                         "name": export.name}, sort_keys=True)
    extra = []
    if "anonuid" in values:
        extra.append(f"    Anonymous_Uid = {values['anonuid']};")
    if "anongid" in values:
        extra.append(f"    Anonymous_Gid = {values['anongid']};")
    sec = values.get("sec", "sys").replace(":", ", ")
    lines = [
        "# Written by dsv41-agent (EnsureExport) for dsv41-nfs-ganesha.service; edits are overwritten.",
        _HEADER + header,
        "NFS_CORE_PARAM {",
        f"    NFS_Port = {NFS_PORT};",
        "    Protocols = 4;",
        "    Enable_NLM = false;",
        "    Enable_RQUOTA = false;",
        "}",
        "NFSV4 {",
        "    # Read-only export: nothing to reclaim after a restart, so no grace period.",
        "    Graceless = true;",
        "}",
        "EXPORT_DEFAULTS {",
        "    Access_Type = None;",
        "}",
        "EXPORT {",
        "    Export_Id = 1;",
        f'    Path = "{export.path}";',
        f'    Pseudo = "/{export.name}";',
        "    Protocols = 4;",
        "    Transports = TCP;",
        "    Access_Type = None;",
        f"    Squash = {squash};",
        f"    SecType = {sec};",
        f"    PrivilegedPort = {'true' if 'secure' in flags else 'false'};",
        *extra,
        "    FSAL {",
        "        Name = VFS;",
        "    }",
        "    CLIENT {",
        f"        Clients = {', '.join(export.clients)};",
        "        Access_Type = RO;",
        "    }",
        "}",
    ]
    return "\n".join(lines) + "\n"


def unit_properties(config_file: str, binary: str = BINARY) -> list[tuple[str, str, object]]:
    argv = [binary, "-F", "-L", "STDERR", "-f", config_file, "-p", "/run/dsv41-nfs-ganesha.pid"]
    return [
        ("Description", "s", "dsv41 NFS export of the model (nfs-ganesha)"),
        ("ExecStart", "a(sasb)", [(binary, argv, False)]),
        ("Type", "s", "exec"),
        ("Restart", "s", "on-failure"),
        ("RestartUSec", "t", 2_000_000),
        ("SyslogIdentifier", "s", "dsv41-nfs-ganesha"),
        ("LimitNOFILE", "t", 65536),
    ]


def port_open(host: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


class GaneshaExporter:
    def __init__(self, units: Units, config_file: str = CONFIG_FILE, unit: str = UNIT, binary: str = BINARY,
                 port: int = NFS_PORT, start_timeout_s: float = 20.0, listen_timeout_s: float = 10.0,
                 port_open: Callable[[str, int, float], bool] = port_open,
                 sleep: Callable[[float], None] = time.sleep, monotonic: Callable[[], float] = time.monotonic):
        self._units = units
        self.config_file = config_file
        self.unit = unit
        self._binary = binary
        self._port = port
        self._start_timeout = start_timeout_s
        self._listen_timeout = listen_timeout_s
        self._port_open = port_open
        self._sleep = sleep
        self._monotonic = monotonic

    def configured(self) -> Export | None:
        export = parse_header(read_text(self.config_file))
        return None if export is None else Export(export.path, export.clients, export.options, "ganesha", export.name)

    def ensure(self, export: Export) -> BackendStatus:
        for name in CONFLICTING_UNITS:
            other = self._units.state(name)
            if other.active_state in ("active", "activating", "reloading"):
                raise Refused(f"{name} is {other.active_state} and would hold NFS port {self._port}: stop and "
                              f"disable it (dsv41 runs its own {self.unit}), or choose NFS_BACKEND=kernel")
        try:
            changed = write_atomic(self.config_file, render_ganesha(export))
        except FileNotFoundError:
            raise Refused(f"cannot write {self.config_file}: its directory is missing (install nfs-ganesha and "
                          "nfs-ganesha-vfs)") from None
        state = self._units.state(self.unit, SERVICE_IFACE)
        if state.active_state == "failed":
            self._units.reset_failed(self.unit)
        if state.active_state in ("active", "activating", "reloading") and state.known:
            action = "restarted" if changed else "running"
            result = self._units.restart(self.unit, self._start_timeout) if changed else "done"
        else:
            action = "started"
            result = self._units.start_transient(self.unit, unit_properties(self.config_file, self._binary),
                                                 self._start_timeout)
        if result != "done":
            raise Refused(f"{self.unit} did not start (job {result}): see journalctl -u {self.unit}")
        deadline = self._monotonic() + self._listen_timeout
        while not self._port_open("127.0.0.1", self._port, 0.5):
            state = self._units.state(self.unit, SERVICE_IFACE)
            if state.active_state not in ("active", "activating", "reloading") or self._monotonic() > deadline:
                raise Refused(f"{self.unit} is {state.active_state} ({state.result or state.sub_state}) and does "
                              f"not listen on port {self._port}: see journalctl -u {self.unit}")
            self._sleep(0.05)
        return BackendStatus(True, export, f"nfs-ganesha ({self.unit}, {action}) serves {export.path} at "
                                           f"/{export.name} on port {self._port} to {', '.join(export.clients)}")

    def serving(self) -> tuple[bool, str]:
        state = self._units.state(self.unit, SERVICE_IFACE)
        return state.active_state == "active", f"{self.unit} {state.active_state}"

    def remove(self) -> bool:
        state = self._units.state(self.unit, SERVICE_IFACE)
        stopped = False
        if state.known:
            result = self._units.stop(self.unit, self._start_timeout)
            if result not in ("done", "skipped"):
                raise Refused(f"{self.unit} did not stop (job {result}): see journalctl -u {self.unit}")
            if self._units.state(self.unit, SERVICE_IFACE).active_state == "failed":
                self._units.reset_failed(self.unit)
            stopped = True
        return remove(self.config_file) or stopped
