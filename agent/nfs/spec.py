"""Validates what the coordinator asks to export or mount. Pure functions over dataclasses.

An agent that runs as root must not export or mount whatever it is sent: paths are checked
against the system directories, options against a short list of what serving read-only model
weights needs, and mount types against the node's agent.env.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Iterable, Mapping

from .errors import Denied, Invalid
from .paths import check_path, check_unit_path

BACKENDS = ("kernel", "ganesha")
DEFAULT_MOUNT_TYPES = ("nfs4",)
MAX_CLIENTS = 64
MAX_OPTIONS = 32
MAX_SHARDS = 100_000
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_NODE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def _uint(lo: int, hi: int):
    def check(value: str) -> bool:
        return value.isascii() and value.isdigit() and lo <= int(value) <= hi
    return check


def _one_of(*values: str):
    return lambda value: value in values


def _ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        return False


# exports(5) options for a read-only export of model weights. `rw` is not among them.
EXPORT_FLAGS = frozenset({
    "ro", "sync", "async", "no_subtree_check", "subtree_check", "root_squash", "no_root_squash", "all_squash",
    "insecure", "secure", "wdelay", "no_wdelay", "hide", "nohide", "crossmnt", "no_acl",
})
EXPORT_VALUES = {
    "fsid": lambda v: v in ("0", "root") or v.isascii() and v.isdigit() and int(v) < 2**32
    or re.fullmatch(r"[0-9a-fA-F]{8}(-?[0-9a-fA-F]{4}){3}-?[0-9a-fA-F]{12}", v) is not None,
    "sec": lambda v: all(s in ("sys", "krb5", "krb5i", "krb5p") for s in v.split(":")),
    "anonuid": _uint(0, 2**32 - 2),
    "anongid": _uint(0, 2**32 - 2),
}
# nfs(5) options for a read-only NFSv4 client mount.
NFS_MOUNT_FLAGS = frozenset({
    "ro", "hard", "soft", "softerr", "intr", "nointr", "noatime", "nodiratime", "relatime", "nosuid", "nodev",
    "noexec", "_netdev", "nofail", "ac", "noac", "cto", "nocto", "sharecache", "nosharecache", "resvport",
    "noresvport", "fsc", "nofsc",
})
NFS_MOUNT_VALUES = {
    "nfsvers": _one_of("4", "4.0", "4.1", "4.2"),
    "vers": _one_of("4", "4.0", "4.1", "4.2"),
    "nconnect": _uint(1, 16),
    "max_connect": _uint(1, 16),
    "rsize": _uint(1024, 16 << 20),
    "wsize": _uint(1024, 16 << 20),
    "timeo": _uint(1, 6000),
    "retrans": _uint(0, 100),
    "retry": _uint(0, 10000),
    "proto": _one_of("tcp", "tcp6", "rdma", "rdma6"),
    "port": _uint(0, 65535),
    "sec": _one_of("sys"),
    "actimeo": _uint(0, 3600),
    "acregmin": _uint(0, 3600),
    "acregmax": _uint(0, 3600),
    "acdirmin": _uint(0, 3600),
    "acdirmax": _uint(0, 3600),
    "lookupcache": _one_of("all", "none", "pos", "positive"),
    "local_lock": _one_of("none"),
    "clientaddr": _ip,
}
# A bind mount stands in for NFS only where agent.env allows the type `none` (tests).
BIND_MOUNT_FLAGS = frozenset({"bind", "ro", "nosuid", "nodev", "noexec"})
# Whoever controls the server controls the files: no set-user-ID programs or device nodes from it.
MOUNT_REQUIRED = ("ro", "nosuid", "nodev")


@dataclass(frozen=True)
class Export:
    path: str
    clients: tuple[str, ...]
    options: tuple[str, ...]
    backend: str
    name: str


@dataclass(frozen=True)
class Mount:
    what: str
    where: str
    type: str
    options: tuple[str, ...]
    server: str
    expected_shards: int

    def to_json(self) -> dict:
        return {"what": self.what, "where": self.where, "type": self.type, "options": list(self.options),
                "server": self.server, "expected_shards": self.expected_shards}

    @classmethod
    def from_json(cls, data: Mapping) -> Mount:
        return cls(str(data["what"]), str(data["where"]), str(data["type"]), tuple(data["options"]),
                   str(data["server"]), int(data["expected_shards"]))


def check_options(raw: str, what: str, flags: Iterable[str], values: Mapping[str, object],
                  required: Iterable[str] = ()) -> tuple[str, ...]:
    """A comma-separated option list where every option is known and allowed, none repeated."""
    if not isinstance(raw, str) or len(raw) > 4096 or any(c.isspace() or c in "\0\"'\\" for c in raw):
        raise Invalid(f"{what}: must be one comma-separated list without blanks or quotes")
    options = [o for o in raw.split(",")] if raw else []
    if len(options) > MAX_OPTIONS:
        raise Invalid(f"{what}: at most {MAX_OPTIONS} options")
    flags = frozenset(flags)
    seen: set[str] = set()
    for option in options:
        key, eq, value = option.partition("=")
        if not key:
            raise Invalid(f"{what} {raw!r}: empty option")
        if key in seen:
            raise Invalid(f"{what}: option {key} given twice")
        seen.add(key)
        if eq:
            check = values.get(key)
            if check is None:
                raise Invalid(f"{what}: option {option!r} is not allowed; allowed: {_allowed(flags, values)}")
            if not check(value):  # type: ignore[operator]
                raise Invalid(f"{what}: option {option!r}: value not allowed")
        elif key not in flags:
            raise Invalid(f"{what}: option {key!r} is not allowed; allowed: {_allowed(flags, values)}")
    missing = [r for r in required if r not in seen]
    if missing:
        raise Invalid(f"{what} {raw!r}: must include {', '.join(missing)} (the model is shared read-only, and "
                      "nothing on it may be a set-user-ID program or a device node)")
    return tuple(options)


def _allowed(flags: frozenset[str], values: Mapping[str, object]) -> str:
    return ", ".join(sorted(flags) + [f"{k}=..." for k in sorted(values)])


def check_client(raw: str) -> str:
    """An IP address or network with its host bits zero; nothing wider than /8 (IPv4) or /32 (IPv6)."""
    try:
        net = ipaddress.ip_network(raw, strict=True)
    except ValueError:
        raise Invalid(f"client {raw!r}: must be an IP address or network like 10.0.22.0/24 (host bits zero)") \
            from None
    widest = 8 if net.version == 4 else 32
    if net.prefixlen < widest:
        raise Invalid(f"client {raw!r}: wider than /{widest} would export the model to most of the Internet; "
                      "list the workers' addresses or links")
    return str(net.network_address) if net.num_addresses == 1 else str(net)


def check_export(*, path: str, clients: Iterable[str], options: str, backend: str, name: str) -> Export:
    check_path(path, "path")
    if backend not in BACKENDS:
        raise Invalid(f"backend {backend!r}: must be one of {', '.join(BACKENDS)}")
    if not _NAME.fullmatch(name or ""):
        raise Invalid(f"name {name!r}: 1-64 letters, digits and ._- (the nfs-ganesha pseudo path is /NAME)")
    clients = list(clients)
    if not clients:
        raise Invalid("clients: at least one address or network (the workers' NFS_CLIENTS)")
    if len(clients) > MAX_CLIENTS:
        raise Invalid(f"clients: at most {MAX_CLIENTS}")
    checked = [check_client(c) for c in clients]
    if len(set(checked)) != len(checked):
        raise Invalid(f"clients: listed twice: {', '.join(sorted({c for c in checked if checked.count(c) > 1}))}")
    opts = check_options(options, "options", EXPORT_FLAGS, EXPORT_VALUES, required=("ro",))
    return Export(path, tuple(checked), opts, backend, name)


def check_mount(*, what: str, where: str, type: str, options: str, server: str, expected_shards: int,
                allowed_types: Iterable[str] = DEFAULT_MOUNT_TYPES) -> Mount:
    check_unit_path(where, "where")
    allowed = tuple(allowed_types)
    if type not in allowed:
        raise Invalid(f"type {type!r}: not allowed on this node; allowed: {', '.join(allowed)} "
                      "(agent.env ALLOWED_MOUNT_TYPES)")
    if not 1 <= expected_shards <= MAX_SHARDS:
        raise Invalid(f"expected_shards {expected_shards}: must be 1..{MAX_SHARDS}")
    if type == "none":
        if server:
            raise Invalid("server: must be empty for a bind mount")
        check_path(what, "what")
        opts = check_options(options, "options", BIND_MOUNT_FLAGS, {}, required=("bind", *MOUNT_REQUIRED))
        return Mount(what, where, type, opts, "", expected_shards)
    if type not in ("nfs4", "nfs"):
        raise Invalid(f"type {type!r}: only nfs4 (or nfs with nfsvers=4.x) and bind mounts are supported")
    host, sep, export_path = what.rpartition(":")
    if not sep or not host:
        raise Invalid(f"what {what!r}: must be SERVER:/PATH with the server's IP address")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not _ip(bare) or (":" in bare) != host.startswith("["):
        raise Invalid(f"what {what!r}: the server must be an IP address (IPv6 in brackets), not a host name, "
                      "so the mount goes over the intended link")
    if export_path != "/" and not export_path.startswith("/"):
        raise Invalid(f"what {what!r}: the export path must be absolute")
    if export_path != "/":
        # The server's path is the server's business, but keep it to plain components.
        for part in export_path[1:].split("/"):
            if part in ("", ".", "..") or not re.fullmatch(r"[A-Za-z0-9._+@%=,~-]{1,255}", part):
                raise Invalid(f"what {what!r}: the export path must be normalized, of letters, digits and ._+@%=,~-")
    if server != bare:
        raise Invalid(f"server {server!r}: must be the address in what ({bare})")
    opts = check_options(options, "options", NFS_MOUNT_FLAGS, NFS_MOUNT_VALUES, required=MOUNT_REQUIRED)
    if type == "nfs" and not any(o.split("=")[0] in ("nfsvers", "vers") for o in opts):
        raise Invalid("options: type nfs needs nfsvers=4.x (NFSv3 needs rpcbind and locking helpers; use nfs4)")
    return Mount(what, where, type, opts, bare, expected_shards)


def check_mounted_by(names: Iterable[str]) -> tuple[str, ...]:
    names = list(names)
    if len(names) > 64:
        raise Invalid("mounted_by: at most 64 node names")
    for name in names:
        if not _NODE.fullmatch(name):
            raise Invalid(f"mounted_by {name!r}: must be a node name (letters, digits and -)")
    return tuple(dict.fromkeys(names))


def _under(path: str, roots: Iterable[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def check_mount_allowed(mount: Mount, roots: Iterable[str], servers: Iterable[str]) -> None:
    """The mount point (and a bind mount's source) under ALLOWED_PATHS, the server in
    ALLOWED_MOUNT_SERVERS; Denied names the setting and the fix."""
    roots, servers = tuple(roots), tuple(servers)
    paths = [("where", mount.where)] + ([("what", mount.what)] if mount.type == "none" else [])
    for what, path in paths:
        if not _under(path, roots):
            raise Denied(f"{what} {path}: not under this node's ALLOWED_PATHS ({', '.join(roots) or 'none'}); add "
                         "the directory to ALLOWED_PATHS in /etc/dsv41/agent.env")
    if mount.type != "none":
        address = ipaddress.ip_address(mount.server)
        if not any(address in ipaddress.ip_network(s) for s in servers):
            raise Denied(f"server {mount.server}: not in this node's ALLOWED_MOUNT_SERVERS "
                         f"({', '.join(servers) or 'none'}); list the head's address on this node's link "
                         "(NFS_SERVER_IP_k) there")


def check_export_allowed(export: Export, roots: Iterable[str]) -> None:
    roots = tuple(roots)
    if not _under(export.path, roots):
        raise Denied(f"path {export.path}: not under this node's ALLOWED_PATHS ({', '.join(roots) or 'none'}); add "
                     "the model's directory to ALLOWED_PATHS in /etc/dsv41/agent.env")
