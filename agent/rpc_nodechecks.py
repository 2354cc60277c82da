"""RPCs for the node checks: the head's NFS export, a worker's mount, the RoCE fabric.

Every field is validated (INVALID_ARGUMENT says which and why); a request the node's state does
not allow now is FAILED_PRECONDITION. The work lives in agent.nfs and agent.fabric; blocking
file-system checks and netlink run in short-lived child processes, so no RPC can wedge the
agent and the agent never imports pyroute2.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from typing import Callable

import grpc

from dsv41.v1 import agent_pb2 as pb

from .fabric.checker import FabricChecker
from .fabric.checks import FabricResult
from .fabric.drift import FabricTarget
from .fabric.spec import Invalid as FabricInvalid
from .fabric.spec import check_fabric
from .nfs.errors import Denied, Invalid, Refused
from .nfs.exports import ExportManager, ExportStatus
from .nfs.ganesha import GaneshaExporter
from .nfs.health import ProbeRunner
from .nfs.kernel import KernelExporter
from .nfs.mount import MountManager, MountStatus
from .nfs.spec import (DEFAULT_MOUNT_TYPES, check_export, check_export_allowed, check_mount, check_mount_allowed,
                       check_mounted_by)
from .pathtrust import PathTrust, PathUse
from .nfs.units import Units
from .systemd import SystemdError

# What PID 1 (and so the rank and the NFS server) sees. The agent's own view differs: its unit
# has PrivateTmp=, which hides a mount under /var/tmp (the recipe's COMMON_MODEL) from it.
HOST_VIEW = "/proc/1/root"


@dataclass(frozen=True)
class NodeChecks:
    exports: ExportManager
    mounts: MountManager
    fabric: FabricChecker
    view: str = "/"  # where the host's file system is seen from
    owner: int = 0  # whose files are trusted: root (a test over its own files passes its uid)


def mount_points(view: str) -> frozenset[str]:
    """Where something is mounted in PID 1's namespace (its mountinfo), as the host sees the paths."""
    path = "/proc/1/mountinfo" if view == HOST_VIEW else "/proc/self/mountinfo"
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return frozenset()
    # Field 5 is the mount point, with blanks and backslashes escaped as \ooo.
    return frozenset(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
                     for line in lines if len(line.split()) > 4)


def host_view() -> str:
    try:
        os.listdir(HOST_VIEW)
        return HOST_VIEW
    except OSError:  # not root, or /proc hidden: our own view is the best we have
        return "/"


def build_node_checks(settings, systemd, events, view_root: str | None = None, owner: int = 0) -> NodeChecks:
    units = Units(systemd)
    view = host_view() if view_root is None else view_root
    exports = ExportManager(KernelExporter(units), GaneshaExporter(units), events, view_root=view)
    mounts = MountManager(units, ProbeRunner(), events, os.path.join(settings.state_dir, "mount.json"),
                          view_root=view)
    return NodeChecks(exports, mounts, FabricChecker(settings.sysfs_root), view, owner)


_MOUNT_STATES = {"unchecked": pb.MountState.STATE_UNSPECIFIED, "absent": pb.MountState.ABSENT, "mounting": pb.MountState.MOUNTING,
                 "healthy": pb.MountState.HEALTHY, "wrong_content": pb.MountState.WRONG_CONTENT,
                 "stale": pb.MountState.STALE, "failed": pb.MountState.FAILED}


def mount_pb(status: MountStatus) -> pb.MountState:
    return pb.MountState(state=_MOUNT_STATES[status.state], where=status.where, what=status.what, unit=status.unit,
                         detail=status.detail, stale_for_s=status.stale_for_s, shards_seen=status.shards_seen)


def export_pb(status: ExportStatus) -> pb.ExportState:
    return pb.ExportState(exported=status.exported, path=status.path, clients=list(status.clients),
                          detail=status.detail, outcome=pb.ExportState.Outcome.Value(status.outcome.value))


def fabric_pb(result: FabricResult) -> pb.FabricReport:
    return pb.FabricReport(ok=result.ok, roce_gid_index=result.gid_index,
                           checks=[pb.Check(name=c.name, ok=c.ok, detail=c.detail, warning=c.warning)
                                   for c in result.checks])


class NodeCheckRpcs:
    """EnsureExport, RemoveExport, EnsureMount, GetMount, Remount, RemoveMount and CheckFabric; it
    owns the node checks (built at their first use, once) and lends the other handlers what they
    need of them: the paths' trust, the last known mount and export."""

    def __init__(self, settings, events, rank, build: Callable[[], NodeChecks],
                 watch_fabric: Callable[[FabricTarget], None] | None = None):
        """rank: whose status says whether the rank runs (a mount is not changed under it);
        build: makes the node checks (the mount manager reads its state file then);
        watch_fabric: given what each fabric check named, for the fabric watch (FabricWatch.watch)."""
        self._watch_fabric = watch_fabric
        self._settings = settings
        self._events = events
        self._rank = rank
        self._build = build
        self._lock = threading.Lock()
        self._built: NodeChecks | None = None

    def _node_checks(self) -> NodeChecks:
        with self._lock:
            if self._built is None:
                self._built = self._build()
            return self._built

    def host_view_root(self) -> str:
        """Where the host's file system is seen from (PID 1's root when the agent may read it)."""
        return self._node_checks().view

    def path_trust(self) -> PathTrust:
        """Checks paths as PID 1 (and so the rank) sees them; the weights' mount is not walked into."""
        checks = self._node_checks()

        def vouched() -> tuple[str, ...]:
            spec = checks.mounts.spec
            return (spec.where,) if spec is not None else ()
        return PathTrust(checks.view, vouched, checks.owner)

    def _allowed_mount_types(self) -> tuple[str, ...]:
        return tuple(getattr(self._settings, "allowed_mount_types", DEFAULT_MOUNT_TYPES))

    def _rank_running(self) -> bool:
        return self._rank.status().running

    # For GetStatus: the last known states, without any I/O that could block.
    def mount_snapshot_pb(self) -> pb.MountState:
        return mount_pb(self._node_checks().mounts.snapshot())

    def export_snapshot_pb(self) -> pb.ExportState:
        return export_pb(self._node_checks().exports.snapshot())

    def _call(self, context, fn, *args):
        try:
            return fn(*args)
        except (Invalid, FabricInvalid) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Refused as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except Denied as exc:
            self._events.warning("request_denied", str(exc))
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except SystemdError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"systemd over D-Bus: {exc}")

    # -- NFS export (head)

    def EnsureExport(self, request, context):
        def run() -> ExportStatus:
            export = check_export(path=request.path, clients=list(request.clients), options=request.options,
                                  backend=request.backend, name=request.name)
            check_export_allowed(export, self._settings.allowed_paths)
            # The workers' ranks load code from it (--trust-remote-code): only root may have written it.
            why = PathTrust(self.host_view_root(), owner=self._node_checks().owner).problem(
                PathUse(export.path, "export path"))
            if why:
                raise Denied(why)
            return self._node_checks().exports.ensure(export)
        return export_pb(self._call(context, run))

    def RemoveExport(self, request, context):
        def run() -> ExportStatus:
            mounted_by = check_mounted_by(list(request.mounted_by))
            try:
                return self._node_checks().exports.remove(bool(request.force), mounted_by)
            except Refused as exc:
                self._events.warning("export_remove_refused", str(exc), mounted_by=",".join(mounted_by))
                raise
        return export_pb(self._call(context, run))

    # -- NFS mount (workers)

    def EnsureMount(self, request, context):
        def run() -> MountStatus:
            spec = check_mount(what=request.what, where=request.where, type=request.type, options=request.options,
                               server=request.server, expected_shards=request.expected_shards,
                               allowed_types=self._allowed_mount_types())
            check_mount_allowed(spec, self._settings.allowed_paths, self._settings.allowed_mount_servers)
            self._check_mount_point(spec)
            return self._node_checks().mounts.ensure(spec, self._rank_running())
        return mount_pb(self._call(context, run))

    def GetMount(self, request, context):
        return mount_pb(self._call(context, self._node_checks().mounts.get))

    def Remount(self, request, context):
        return mount_pb(self._call(context, lambda: self._node_checks().mounts.remount(self._rank_running())))

    def RemoveMount(self, request, context):
        return mount_pb(self._call(context, lambda: self._node_checks().mounts.remove(self._rank_running())))

    def _check_mount_point(self, spec) -> None:
        """The mount point is root's: under a sticky /var/tmp anyone could have made it first. A
        mounted one is not looked at (a stale server would block the stat); its directory is."""
        view = self.host_view_root()
        owner = self._node_checks().owner
        problems = []
        if spec.type == "none":
            problems += PathTrust(view, owner=owner).problems([PathUse(spec.what, "bind mount source")])
        if spec.where in mount_points(view):
            # mounted: the walk stops at it, its directories are checked
            trust = PathTrust(view, vouched=lambda: (spec.where,), owner=owner)
        else:
            trust = PathTrust(view, owner=owner)
            host = os.path.join(view, spec.where.lstrip("/"))
            try:
                os.mkdir(host, 0o755)  # fails when it exists: then its owner is checked
            except FileExistsError:
                pass
            except OSError as exc:
                problems.append(f"mount point {spec.where}: cannot create it: {exc.strerror}")
        problems += trust.problems([PathUse(spec.where, "mount point")])
        if problems:
            raise Denied("; ".join(problems))

    # -- fabric

    def CheckFabric(self, request, context):
        def run() -> FabricResult:
            req = check_fabric(hcas=list(request.hcas), iface=request.iface, address=request.address,
                               mtu=request.mtu, socket_ifaces=list(request.socket_ifaces),
                               peers=[(p.name, p.address, p.port) for p in request.peers])
            result = self._node_checks().fabric.check(req)
            if self._watch_fabric is not None:
                self._watch_fabric(FabricTarget(tuple(dict.fromkeys([*([req.iface] if req.iface else []),
                                                                     *req.socket_ifaces])),
                                                req.hcas, req.address))
            failed = [c.name for c in result.checks if not c.ok]
            if failed:
                self._events.warning("fabric_check", f"fabric check failed: {', '.join(failed)}",
                                     failed=",".join(failed), gid_index=result.gid_index)
            else:
                self._events.info("fabric_check", f"fabric check passed ({len(result.checks)} checks, GID index "
                                  f"{result.gid_index})", gid_index=result.gid_index)
            return result
        return fabric_pb(self._call(context, run))
