"""dsv41ctl bundle [-o FILE]: every node's diagnostics in one tar (see coordinator/bundle.py).

From the running coordinator over the control socket; when it is not running (it failed to start,
say), dsv41ctl as root asks the agents itself with the coordinator's certificate. The file is created
new (O_EXCL|O_NOFOLLOW, mode 0600: never through a symbolic link, never over an existing file) and
removed again when the bundle could not be completed.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import BinaryIO, TextIO

import grpc

from dsv41.v1 import control_pb2 as pb

from .ctl_cluster import ControlUnavailable, _stub
from .sockets import CONTROL_SOCKET
from .state import Phase


def add_commands(sub, default_config: str) -> None:
    p = sub.add_parser("bundle", help="one tar of every node's journals, kernel messages, memory figures, plans, "
                                      "status and events, for debugging (no secrets)")
    p.add_argument("--config", default=default_config, help="cluster.env (for asking agents directly)")
    p.add_argument("--socket", default=CONTROL_SOCKET, help="the coordinator's control socket")
    p.add_argument("-o", "--output", help="the tar to create (default dsv41-bundle-HOST-TIME.tar here; - for "
                                          "standard output); an existing file is never overwritten")
    p.add_argument("--journal-mib", type=int, default=8, metavar="MIB",
                   help="newest journal MiB kept per unit and node (1-64, default 8)")
    p.set_defaults(handler=_bundle)


class OutputFile:
    """A new file for the bundle, or standard output; discard() removes a file left incomplete."""

    def __init__(self, path: str, stdout: BinaryIO | None = None):
        self.path = path
        if path == "-":
            self._f, self._owned = stdout, False
            return
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        self._f, self._owned = os.fdopen(fd, "wb"), True

    def write(self, data: bytes) -> int:
        return self._f.write(data)

    def close(self) -> None:
        self._f.flush()
        if self._owned:
            os.fsync(self._f.fileno())
            self._f.close()

    def discard(self) -> None:
        if self._owned:
            self._f.close()
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def default_name(now: float | None = None) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    return f"dsv41-bundle-{socket.gethostname().split('.')[0]}-{stamp}.tar"


def _bundle(args, out: TextIO, err: TextIO) -> int:
    if not 1 <= args.journal_mib <= 64:
        print(f"--journal-mib {args.journal_mib}: must be 1..64", file=err)
        return 2
    path = args.output or default_name()
    if path == "-" and sys.stdout.isatty():
        print("-o -: standard output is a terminal; redirect it to a file", file=err)
        return 2
    journal_bytes = args.journal_mib << 20
    try:
        target = OutputFile(path, sys.stdout.buffer if path == "-" else None)
    except FileExistsError:
        print(f"{path}: exists (or is a symbolic link); nothing was written: choose another name with -o", file=err)
        return 1
    except OSError as exc:
        print(f"{path}: cannot create it: {exc.strerror}", file=err)
        return 1
    try:
        try:
            notes = _from_coordinator(args.socket, target, journal_bytes)
            source = "the coordinator"
        except (ControlUnavailable, _CoordinatorDown):
            notes = _from_agents(args.config, target, journal_bytes)
            source = "the agents (the coordinator is not running)"
        target.close()
    except PermissionError as exc:
        target.discard()
        print(str(exc), file=err)
        return 4
    except (_Failed, grpc.RpcError, OSError) as exc:
        target.discard()
        detail = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
        print(f"bundle failed, nothing was kept: {detail}", file=err)
        return 1
    for note in notes:
        print(f"warning: not collected: {note}", file=err)
    if path != "-":
        print(f"wrote {path} ({os.path.getsize(path)} bytes) from {source}", file=out)
    return 0


class _CoordinatorDown(Exception):
    pass


class _Failed(Exception):
    pass


def _from_coordinator(socket_path: str, target: OutputFile, journal_bytes: int) -> list[str]:
    notes: list[str] = []
    stream = _stub(socket_path).Bundle(pb.BundleRequest(journal_max_bytes=journal_bytes), timeout=900)
    first = True
    try:
        for chunk in stream:
            first = False
            if chunk.data:
                target.write(chunk.data)
            notes.extend(chunk.notes)
    except grpc.RpcError as exc:
        if first and exc.code() == grpc.StatusCode.UNAVAILABLE:
            raise _CoordinatorDown() from None  # a stale socket: nobody listens
        raise
    return notes


def _from_agents(config: str, target: OutputFile, journal_bytes: int) -> list[str]:
    from . import config as config_mod
    from . import pki
    from .bundle import BundleWriter
    from .control import bundle_sources, cluster_status, node_views
    from .session import load_tls, make_clients
    from .incidentlog import HISTORY_PATH, read_incidents
    from .runtime import Snapshot
    try:
        cfg = config_mod.load(config)
    except config_mod.ConfigInvalid as exc:
        raise _Failed(f"the coordinator is not running and {config} is invalid:\n{exc}") from None
    try:
        tls = load_tls(cfg)
    except PermissionError as exc:
        raise PermissionError(f"the coordinator is not running, and asking the agents needs its key: {exc} "
                              "(run dsv41ctl bundle as root)") from None
    except (OSError, FileNotFoundError) as exc:
        raise _Failed(f"the coordinator is not running, and its certificate is not usable: {exc}") from None
    secrets: list[str] = []
    if key_file := cfg.optional_text("API_KEY_FILE"):
        try:
            secrets.append(pki.read_api_key(key_file))
        except (pki.PkiError, OSError) as exc:
            raise _Failed(f"cannot read API_KEY_FILE to keep the key out of the bundle: {exc}") from None
    clients = make_clients(cfg, tls)
    try:
        views = node_views(cfg, clients, {}, {})
        not_running = Snapshot(phase=Phase.UNKNOWN, detail="the coordinator is not running")
        status = cluster_status(cfg, not_running, views, False)
        sources = bundle_sources(cfg, status, read_incidents(HISTORY_PATH), {},
                                 "dsv41ctl (the coordinator was not running)")
        return BundleWriter(cfg, clients, secrets).write(target, sources, journal_bytes)
    finally:
        for client in clients.values():
            client.close()
