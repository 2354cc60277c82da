"""The agent's own small configuration, /etc/dsv41/agent.env.

The agent never reads the cluster config: the coordinator sends what the node must run, and this
file only says who the node is, where to listen, which certificates prove it, and what it may run.
"""

from __future__ import annotations

import ipaddress
import os
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from dsv41 import envfile

from .nfs.errors import Invalid as PathInvalid
from .nfs.paths import check_path as check_root_path

DEFAULT_PATH = "/etc/dsv41/agent.env"
DEFAULT_PORT = 7441
PIN_FILE = "coordinator.pin"  # beside TLS_CA, from the node's bundle
_NODE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
# Immutable image references only: a tag can be moved to other content after it was allowed.
_IMAGE = re.compile(r"[a-z0-9][a-z0-9._/:-]*@sha256:[0-9a-f]{64}|sha256:[0-9a-f]{64}")
# Programs that run whatever code their arguments name (`python -c`, `sh -c`): an entry point of
# the host runtime receives the plan's flags, so it must not be one of these.
_INTERPRETER = re.compile(r"(python|pypy)[0-9.]*(-dbg)?|(ba|da|z|k|c|tc|fi|mk|a)?sh|busybox|env|perl[0-9.]*|"
                          r"ruby[0-9.]*|node(js)?|lua[0-9.]*|php[0-9.]*|tclsh[0-9.]*|wish[0-9.]*|[gm]?awk|"
                          r"sudo|su|setpriv|nsenter|chroot|systemd-run|xargs|find")


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
    # Pythons of the host runtime: each runs only `-m sglang.launch_server` with the plan's flags.
    allowed_pythons: tuple[str, ...] = ()
    # Directories the rank may be shown (model, Engram packs, a NCCL build): bind sources, mount
    # points, the export, the pack job's directories and every path in the rank's argv and
    # environment lie under one of them (or the adapter, the state and the cache directories).
    allowed_paths: tuple[str, ...] = ()
    allowed_mount_servers: tuple[str, ...] = ()  # addresses or networks the weights may be mounted from
    tls_pin: str | None = None  # file of sha256 fingerprints of the coordinator certificates accepted
    max_connections: int = 256
    max_connections_per_source: int = 32
    handshake_timeout_s: float = 5.0

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def rank_cache_dir(self) -> str:
        """The host runtime's caches (JIT kernels, byte code, autotune), written by root ranks only."""
        return posixpath.join(self.cache_dir, "rank")

    @property
    def container_cache_dir(self) -> str:
        """The container's /root/.cache: written from inside the container, so never loaded by a host rank."""
        return posixpath.join(self.cache_dir, "container")


_KEYS = {
    "NODE_NAME": None,
    "LISTEN": "",  # empty: 0.0.0.0:7441 with TLS, 127.0.0.1:7441 with INSECURE_NO_TLS=1
    "TLS_CA": "",
    "TLS_CERT": "",
    "TLS_KEY": "",
    "TLS_PIN": "",  # empty: coordinator.pin beside TLS_CA
    "COORDINATOR_NAME": "dsv41-coordinator",
    "INSECURE_NO_TLS": "0",
    "ALLOWED_RUNTIMES": "container",
    "ALLOWED_IMAGES": "",
    "ALLOWED_PYTHONS": "",
    "ALLOWED_EXECUTABLES": "",
    "ALLOWED_PATHS": "",
    "ALLOWED_MOUNT_SERVERS": "",
    "STATE_DIR": "/var/lib/dsv41",
    "ADAPTER_DIR": "/usr/share/dsv41/rank",
    "SYSFS_ROOT": "/sys",
    "CACHE_DIR": "/var/cache/dsv41",
    "ALLOWED_MOUNT_TYPES": "nfs4",
    "MAX_CONNECTIONS": "256",
    "MAX_CONNECTIONS_PER_SOURCE": "32",
    "TLS_HANDSHAKE_TIMEOUT_S": "5",
}


def load(path: str = DEFAULT_PATH, environ: Mapping[str, str] | None = None) -> AgentSettings:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise SettingsError(f"{path}: cannot read: {exc}") from None
    return parse(text, path, os.environ if environ is None else environ)


class _Problems:
    """What is wrong with agent.env, each with its file and line."""

    def __init__(self, path: str, lines: dict[str, int], values: dict[str, str]) -> None:
        self.path, self.lines, self.values = path, lines, values
        self.found: list[str] = []

    def whole(self, message: str) -> None:
        self.found.append(f"{self.path}: {message}")

    def bad(self, key: str, message: str) -> None:
        where = f"{self.path}:{self.lines[key]}" if key in self.lines else self.path
        self.found.append(f"{where}: {key}={self.values[key] or ''}: {message}")


def parse(text: str, path: str, environ: Mapping[str, str]) -> AgentSettings:
    entries, syntax = envfile.parse(text, environ)
    given = {e.key: e.value for e in entries}
    lines = {e.key: e.line for e in entries}
    values = {k: given.get(k, d) for k, d in _KEYS.items()}
    p = _Problems(path, lines, values)
    p.found.extend(f"{path}:{e.line}: {e.message}" for e in syntax)
    for key in given:
        if key not in _KEYS:
            p.found.append(f"{path}:{lines[key]}: {key}: unknown key; allowed: {', '.join(_KEYS)}")
    listen, insecure, tls = _check_identity(values, p)
    runtimes, images, pythons, executables = _check_runtimes(values, p)
    paths, servers, mount_types = _check_data_roots(values, p)
    limits = _check_limits(values, p)
    if p.found:
        raise SettingsError("\n".join(p.found))
    pin = values["TLS_PIN"] or (posixpath.join(posixpath.dirname(values["TLS_CA"]), PIN_FILE)
                                if values["TLS_CA"] else "")
    return AgentSettings(
        node=values["NODE_NAME"], listen=listen,
        tls_ca=values["TLS_CA"] or None, tls_cert=values["TLS_CERT"] or None, tls_key=values["TLS_KEY"] or None,
        coordinator_name=values["COORDINATOR_NAME"], insecure_no_tls=insecure,
        allowed_runtimes=runtimes, allowed_images=images, allowed_executables=executables,
        state_dir=values["STATE_DIR"], adapter_dir=values["ADAPTER_DIR"], sysfs_root=values["SYSFS_ROOT"],
        cache_dir=values["CACHE_DIR"], allowed_mount_types=mount_types, allowed_pythons=pythons,
        allowed_paths=paths, allowed_mount_servers=servers, tls_pin=(pin or None) if all(tls) else None,
        max_connections=limits["MAX_CONNECTIONS"], max_connections_per_source=limits["MAX_CONNECTIONS_PER_SOURCE"],
        handshake_timeout_s=float(limits["TLS_HANDSHAKE_TIMEOUT_S"]))


def _check_identity(values: dict, p: _Problems) -> tuple[str, bool, list[str]]:
    """The node's name, where it listens, TLS; returns the listen address, INSECURE_NO_TLS and the TLS files."""
    if values["NODE_NAME"] is None:
        p.whole("NODE_NAME: is required (this node's name as the cluster config knows it)")
    elif not _NODE.fullmatch(values["NODE_NAME"]):
        p.bad("NODE_NAME", "must be a host name of letters, digits and -")
    if values["INSECURE_NO_TLS"] not in ("0", "1"):
        p.bad("INSECURE_NO_TLS", "must be 0 or 1")
    insecure = values["INSECURE_NO_TLS"] == "1"
    # Without TLS anyone who reaches the port can start processes as root: unless LISTEN says
    # otherwise, listen on loopback only.
    listen = values["LISTEN"] or (f"127.0.0.1:{DEFAULT_PORT}" if insecure else f"0.0.0.0:{DEFAULT_PORT}")
    host, _, port = listen.rpartition(":")
    try:
        ipaddress.ip_address(host.strip("[]"))
        if not 1 <= int(port) <= 65535:
            raise ValueError
    except ValueError:
        p.bad("LISTEN", "must be ADDRESS:PORT with an IP address, e.g. 0.0.0.0:7441")
    tls = [values[k] for k in ("TLS_CA", "TLS_CERT", "TLS_KEY")]
    if any(tls) and not all(tls):
        p.bad("TLS_CERT", "TLS_CA, TLS_CERT and TLS_KEY go together")
    for key in ("TLS_CA", "TLS_CERT", "TLS_KEY", "TLS_PIN", "STATE_DIR", "ADAPTER_DIR", "SYSFS_ROOT",
                "CACHE_DIR"):
        if values[key] and (not values[key].startswith("/") or ".." in values[key].split("/")):
            p.bad(key, "must be an absolute path without '..'")
    if not all(tls) and not insecure:
        p.whole("TLS_CA/TLS_CERT/TLS_KEY are required (make them with `dsv41ctl pki init`); "
                "INSECURE_NO_TLS=1 serves without authentication, for isolated test networks only")
    return listen, insecure, tls


def _check_runtimes(values: dict, p: _Problems) -> tuple[tuple[str, ...], ...]:
    """What a rank may run: runtimes, images, Pythons, executables."""
    runtimes = _list(values["ALLOWED_RUNTIMES"])
    if not runtimes or any(r not in ("container", "host") for r in runtimes):
        p.bad("ALLOWED_RUNTIMES", "must list container and/or host")
    images = _list(values["ALLOWED_IMAGES"])
    for image in images:
        if not _IMAGE.fullmatch(image):
            p.bad("ALLOWED_IMAGES", f"{image!r} is not an image pinned by digest: list NAME[:TAG]@sha256:<64 hex> "
                  "(docker image inspect --format '{{index .RepoDigests 0}}' IMAGE) or a local build's ID "
                  "sha256:<64 hex> (docker image inspect --format '{{.Id}}' IMAGE); a tag can be moved to other "
                  "content after it was allowed")
    pythons = _list(values["ALLOWED_PYTHONS"])
    for exe in pythons:
        if not exe.startswith("/") or ".." in exe.split("/"):
            p.bad("ALLOWED_PYTHONS", f"{exe!r} must be an absolute path")
    executables = _list(values["ALLOWED_EXECUTABLES"])
    for exe in executables:
        if not exe.startswith("/") or ".." in exe.split("/"):
            p.bad("ALLOWED_EXECUTABLES", f"{exe!r} must be an absolute path")
        elif _INTERPRETER.fullmatch(posixpath.basename(exe)):
            p.bad("ALLOWED_EXECUTABLES", f"{exe}: runs any code its arguments name (e.g. `-c`); an entry point "
                  "receives the plan's flags as they come. List a Python in ALLOWED_PYTHONS instead, where it "
                  "runs only `-m sglang.launch_server`")
    return runtimes, images, pythons, executables


def _check_data_roots(values: dict, p: _Problems) -> tuple[tuple[str, ...], ...]:
    """Where a rank's data may come from: paths, mount servers, mount types."""
    paths = _list(values["ALLOWED_PATHS"])
    for root in paths:
        try:
            check_root_path(root, "ALLOWED_PATHS entry")
        except PathInvalid as exc:
            p.bad("ALLOWED_PATHS", str(exc))
            continue
        for key in ("STATE_DIR", "CACHE_DIR", "ADAPTER_DIR"):
            other = values[key]
            if other and (root == other or root.startswith(other + "/") or other.startswith(root + "/")):
                p.bad("ALLOWED_PATHS", f"{root} overlaps {key}={other}: the rank's data roots must be apart from "
                      "the agent's own directories")
    servers = _list(values["ALLOWED_MOUNT_SERVERS"])
    for server in servers:
        try:
            ipaddress.ip_network(server, strict=True)
        except ValueError:
            p.bad("ALLOWED_MOUNT_SERVERS", f"{server!r} must be an IP address or network (host bits zero), "
                  "e.g. 10.0.22.1 (the head's NFS_SERVER_IP_k on this node's link)")
    mount_types = _list(values["ALLOWED_MOUNT_TYPES"])
    if not mount_types or any(t not in ("nfs4", "nfs", "none") for t in mount_types):
        p.bad("ALLOWED_MOUNT_TYPES", "must list mount types from nfs4, nfs, none (none: bind mounts, for tests)")
    return paths, servers, mount_types


def _check_limits(values: dict, p: _Problems) -> dict[str, int]:
    limits = {}
    for key, lo, hi in (("MAX_CONNECTIONS", 4, 65536), ("MAX_CONNECTIONS_PER_SOURCE", 2, 65536),
                        ("TLS_HANDSHAKE_TIMEOUT_S", 1, 120)):
        try:
            limits[key] = int(values[key])
            if not lo <= limits[key] <= hi:
                raise ValueError
        except ValueError:
            p.bad(key, f"must be an integer from {lo} to {hi}")
            limits[key] = lo
    if limits["MAX_CONNECTIONS_PER_SOURCE"] > limits["MAX_CONNECTIONS"]:
        p.bad("MAX_CONNECTIONS_PER_SOURCE", f"must not exceed MAX_CONNECTIONS={limits['MAX_CONNECTIONS']}")
    return limits


def _list(raw: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in raw.split(",") if item.strip())
