"""The agent's own small configuration, /etc/dsv41/agent.env.

The agent never reads the cluster config: the coordinator sends what the node must run, and this
file only says who the node is, where to listen, which certificates prove it, and what it may run.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from dsv41 import envfile

DEFAULT_PATH = "/etc/dsv41/agent.env"
_NODE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_IMAGE = re.compile(r"[a-z0-9][a-z0-9._/:-]*(@sha256:[0-9a-f]{64})?")


class SettingsError(Exception):
    pass


@dataclass(frozen=True)
class AgentSettings:
    node: str
    listen: str  # host:port
    tls_ca: str | None
    tls_cert: str | None
    tls_key: str | None
    coordinator_name: str  # the certificate identity allowed to call
    insecure_no_tls: bool
    allowed_runtimes: tuple[str, ...]
    allowed_images: tuple[str, ...]
    allowed_executables: tuple[str, ...]
    state_dir: str
    adapter_dir: str
    sysfs_root: str
    cache_dir: str
    allowed_mount_types: tuple[str, ...] = ("nfs4",)

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None


_KEYS = {
    "NODE_NAME": None,
    "LISTEN": "0.0.0.0:7441",
    "TLS_CA": "",
    "TLS_CERT": "",
    "TLS_KEY": "",
    "COORDINATOR_NAME": "dsv41-coordinator",
    "INSECURE_NO_TLS": "0",
    "ALLOWED_RUNTIMES": "container",
    "ALLOWED_IMAGES": "",
    "ALLOWED_EXECUTABLES": "",
    "STATE_DIR": "/var/lib/dsv41",
    "ADAPTER_DIR": "/usr/share/dsv41/rank",
    "SYSFS_ROOT": "/sys",
    "CACHE_DIR": "/var/cache/dsv41",
    "ALLOWED_MOUNT_TYPES": "nfs4",
}


def load(path: str = DEFAULT_PATH, environ: Mapping[str, str] | None = None) -> AgentSettings:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise SettingsError(f"{path}: cannot read: {exc}") from None
    return parse(text, path, os.environ if environ is None else environ)


def parse(text: str, path: str, environ: Mapping[str, str]) -> AgentSettings:
    entries, syntax = envfile.parse(text, environ)
    problems = [f"{path}:{e.line}: {e.message}" for e in syntax]
    given = {e.key: e.value for e in entries}
    lines = {e.key: e.line for e in entries}
    for key in given:
        if key not in _KEYS:
            problems.append(f"{path}:{lines[key]}: {key}: unknown key; allowed: {', '.join(_KEYS)}")
    values = {k: given.get(k, d) for k, d in _KEYS.items()}

    def bad(key: str, message: str) -> None:
        where = f"{path}:{lines[key]}" if key in lines else path
        problems.append(f"{where}: {key}={values[key] or ''}: {message}")

    if values["NODE_NAME"] is None:
        problems.append(f"{path}: NODE_NAME: is required (this node's name as the cluster config knows it)")
    elif not _NODE.fullmatch(values["NODE_NAME"]):
        bad("NODE_NAME", "must be a host name of letters, digits and -")
    host, _, port = values["LISTEN"].rpartition(":")
    try:
        ipaddress.ip_address(host.strip("[]"))
        if not 1 <= int(port) <= 65535:
            raise ValueError
    except ValueError:
        bad("LISTEN", "must be ADDRESS:PORT with an IP address, e.g. 0.0.0.0:7441")
    tls = [values[k] for k in ("TLS_CA", "TLS_CERT", "TLS_KEY")]
    if any(tls) and not all(tls):
        bad("TLS_CERT", "TLS_CA, TLS_CERT and TLS_KEY go together")
    for key in ("TLS_CA", "TLS_CERT", "TLS_KEY", "STATE_DIR", "ADAPTER_DIR", "SYSFS_ROOT", "CACHE_DIR"):
        if values[key] and not values[key].startswith("/"):
            bad(key, "must be an absolute path")
    if values["INSECURE_NO_TLS"] not in ("0", "1"):
        bad("INSECURE_NO_TLS", "must be 0 or 1")
    insecure = values["INSECURE_NO_TLS"] == "1"
    if not all(tls) and not insecure:
        problems.append(f"{path}: TLS_CA/TLS_CERT/TLS_KEY are required (make them with `dsv41ctl pki init`); "
                        "INSECURE_NO_TLS=1 serves without authentication, for isolated test networks only")
    runtimes = _list(values["ALLOWED_RUNTIMES"])
    if not runtimes or any(r not in ("container", "host") for r in runtimes):
        bad("ALLOWED_RUNTIMES", "must list container and/or host")
    images = _list(values["ALLOWED_IMAGES"])
    for image in images:
        if not _IMAGE.fullmatch(image):
            bad("ALLOWED_IMAGES", f"{image!r} is not an image reference")
    executables = _list(values["ALLOWED_EXECUTABLES"])
    for exe in executables:
        if not exe.startswith("/") or ".." in exe.split("/"):
            bad("ALLOWED_EXECUTABLES", f"{exe!r} must be an absolute path")
    mount_types = _list(values["ALLOWED_MOUNT_TYPES"])
    if not mount_types or any(t not in ("nfs4", "nfs", "none") for t in mount_types):
        bad("ALLOWED_MOUNT_TYPES", "must list mount types from nfs4, nfs, none (none: bind mounts, for tests)")
    if problems:
        raise SettingsError("\n".join(problems))
    return AgentSettings(
        node=values["NODE_NAME"], listen=values["LISTEN"],
        tls_ca=values["TLS_CA"] or None, tls_cert=values["TLS_CERT"] or None, tls_key=values["TLS_KEY"] or None,
        coordinator_name=values["COORDINATOR_NAME"], insecure_no_tls=insecure,
        allowed_runtimes=runtimes, allowed_images=images, allowed_executables=executables,
        state_dir=values["STATE_DIR"], adapter_dir=values["ADAPTER_DIR"], sysfs_root=values["SYSFS_ROOT"],
        cache_dir=values["CACHE_DIR"], allowed_mount_types=mount_types)


def _list(raw: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in raw.split(",") if item.strip())
