"""The agent's gRPC service: the servicer gives each RPC to the handler object that serves it.

Each handler (agent/rpc_*.py, and StatusRpcs here) validates its requests, then asks the component
that owns the work; what it depends on is given to its constructor and what it keeps is its own.
build_handlers makes them for the daemon; AgentService lists which one serves which RPC.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc

from dsv41.adapterversion import InstalledAdapter
from dsv41.v1 import agent_pb2 as pb
from dsv41.v1 import agent_pb2_grpc
from dsv41.version import VERSION

from dsv41 import progress as progress_files

from .auth import cert_not_after
from .bootid import boot_id
from .events import EventHub
from .fabric.watch import FabricWatch
from .gpu.telemetry import GpuReading, GpuReport, GpuTelemetry
from .images import ImageIds
from .memory import MeminfoInvalid, MemorySampler, TriggerWatcher
from .rank import RankManager
from .pressure import NodePressure
from .rpc_diagnostics import DiagnosticsRpcs
from .rpc_events import EventRpcs
from .rpc_files import FileRpcs
from .rpc_journal import JournalRpcs
from .rpc_memory import MemoryRpcs, pressure_pb, sample_pb
from .rpc_nodechecks import NodeCheckRpcs, build_node_checks, host_view
from .rpc_pack import PackRpcs
from .collective import CollectiveTestRpcs
from .gateway import GatewayRpcs
from .matmul import MatmulCheckRpcs
from .rpc_rank import RankRpcs, rank_pb
from .settings import AgentSettings
from .systemd import Systemd
from .treewatch import process_stopped

ADAPTER_DIGEST_MAX_AGE_S = 10.0


def adapter_digest(directory: str) -> str:
    """sha256 over the adapter files (relative path and content), so nodes can be compared."""
    digest = hashlib.sha256()
    root = Path(directory)
    if not root.is_dir():
        return ""
    for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


class AdapterDigest:
    """adapter_digest of one directory, computed again once the last is older than max_age_s."""

    def __init__(self, directory: str, monotonic: Callable[[], float] = time.monotonic,
                 max_age_s: float = ADAPTER_DIGEST_MAX_AGE_S):
        self._directory = directory
        self._monotonic = monotonic
        self._max_age_s = max_age_s
        self._lock = threading.Lock()
        self._last: tuple[float, str] = (0.0, "")  # (when, digest)

    def get(self) -> str:
        with self._lock:
            at, value = self._last
            if self._monotonic() - at > self._max_age_s:
                value = adapter_digest(self._directory)
                self._last = (self._monotonic(), value)
            return value


class CertExpiry:
    """A certificate's notAfter, read again only when the file changes (rotation needs no restart)."""

    def __init__(self, path: str | None):
        self._path = path
        self._last: tuple[float, int] = (-1.0, 0)  # (the file's mtime, notAfter)

    def get(self) -> int:
        try:
            mtime = os.stat(self._path).st_mtime if self._path else 0.0
        except OSError:
            return 0
        if mtime != self._last[0]:
            self._last = (mtime, cert_not_after(self._path))
        return self._last[1]


def rank_progress(directory: str) -> list[pb.RankProgress]:
    """The ranks' forward-step counters, as they publish them in `directory`."""
    return [pb.RankProgress(tp_rank=max(p.tp_rank, 0), forward_count=p.count, last_step_age_s=p.last_step_age_s,
                            pid=p.pid, problem=p.problem, process_stopped=process_stopped(p.pid))
            for p in progress_files.read_all(directory)]


def gpu_state_pb(reading: GpuReading) -> pb.GpuState:
    """A GPU's figures; one the device did not give stays unset (HasField false), never 0."""
    optional = ("sm_clock_mhz", "sm_clock_max_mhz", "sm_clock_applications_mhz", "graphics_clock_mhz",
                "memory_clock_mhz", "memory_clock_max_mhz", "power_w", "power_limit_w", "temperature_c",
                "utilization_gpu_pct", "utilization_memory_pct", "throttle_mask", "memory_total_bytes",
                "memory_used_bytes")
    figures = {name: getattr(reading, name) for name in optional if getattr(reading, name) is not None}
    return pb.GpuState(index=reading.index, name=reading.name, uuid=reading.uuid, **figures,
                       throttle_reasons=list(reading.throttle_reasons), xid_count=reading.xid_count,
                       last_xid=reading.last_xid or 0, last_xid_unix_s=reading.last_xid_unix_s or 0.0,
                       unsupported=list(reading.unsupported), errors=list(reading.errors))


class StatusRpcs:
    """GetStatus: what this node is, runs and has, from what each component last knew."""

    def __init__(self, settings, sampler: MemorySampler, rank: RankManager, images: ImageIds,
                 mount: Callable[[], pb.MountState], export: Callable[[], pb.ExportState],
                 progress: Callable[[], list[pb.RankProgress]], boot_id: str, started_monotonic: float,
                 monotonic: Callable[[], float] = time.monotonic, pressure: NodePressure | None = None,
                 gpus: Callable[[], GpuReport] | None = None):
        """mount, export: the last known mount and export (no I/O that could block); progress: the
        ranks' forward-step counters; gpus: the node's GPU report (NVML; none: no GPU figures)."""
        self._settings = settings
        self._sampler = sampler
        self._rank = rank
        self._images = images
        self._mount = mount
        self._export = export
        self._progress = progress
        self._boot_id = boot_id
        self._started = started_monotonic
        self._monotonic = monotonic
        self._pressure = pressure or NodePressure()
        self._gpus = gpus or (lambda: GpuReport(available=False))
        self._adapter_digest = AdapterDigest(settings.adapter_dir, monotonic)
        self._adapter = InstalledAdapter(settings.adapter_dir)
        self._cert_expiry = CertExpiry(settings.tls_cert)

    def GetStatus(self, request, context):
        try:
            memory = self._sampler.sample()
        except MeminfoInvalid as exc:
            context.abort(grpc.StatusCode.INTERNAL, f"cannot read this node's memory: {exc}")
        gpus = self._gpus()
        return pb.NodeStatus(
            node=self._settings.node, agent_version=VERSION, adapter_digest=self._adapter_digest.get(),
            adapter_version=self._adapter.version(),
            agent_up_s=self._monotonic() - self._started, rank=rank_pb(self._settled_rank()),
            memory=sample_pb(memory), allowed_runtimes=list(self._settings.allowed_runtimes),
            mount=self._mount(), export=self._export(), images=self._images.get(),
            cert_not_after_unix_s=self._cert_expiry.get(), boot_id=self._boot_id, progress=self._progress(),
            pressure=[
                pb.ResourcePressure(resource=resource, some=pressure_pb(some), full=pressure_pb(full))
                for resource, (some, full) in self._pressure.read().items()],
            gpus=[gpu_state_pb(g) for g in gpus.gpus], gpu_telemetry=gpus.detail)

    def _settled_rank(self):
        self._rank.refresh()
        return self._rank.settled_status()


@dataclass(frozen=True)
class AgentHandlers:
    """The objects that serve the agent's RPCs; AgentService says which one serves which RPC."""
    status: StatusRpcs
    rank: RankRpcs
    memory: MemoryRpcs
    node_checks: NodeCheckRpcs
    pack: PackRpcs
    files: FileRpcs
    journal: JournalRpcs
    events: EventRpcs
    diagnostics: DiagnosticsRpcs
    collective: CollectiveTestRpcs
    matmul: MatmulCheckRpcs
    gateway: GatewayRpcs


def build_handlers(settings: AgentSettings, systemd: Systemd, rank: RankManager, sampler: MemorySampler,
                   triggers: TriggerWatcher, events: EventHub, started_monotonic: float,
                   monotonic: Callable[[], float] = time.monotonic, pressure: NodePressure | None = None,
                   host_root: str | None = None, progress_dir: str = progress_files.DIRECTORY,
                   proc_root: str = "/proc", gpus: GpuTelemetry | None = None,
                   fabric: FabricWatch | None = None) -> AgentHandlers:
    """The handlers over the daemon's components. host_root: where paths the coordinator names
    (pack directories) are seen as PID 1 sees them (this unit's PrivateTmp= hides /tmp and /var/tmp,
    where the pack job, its own unit, writes); progress_dir: where the ranks publish their
    forward-step counters; gpus: the node's GPU telemetry (NVML); fabric: the fabric watch, which each
    fabric check retargets and whose changes every WatchRank stream carries."""
    this_boot = boot_id(proc_root)

    def progress() -> list[pb.RankProgress]:
        return rank_progress(progress_dir)
    node_checks = NodeCheckRpcs(settings, events, rank, lambda: build_node_checks(settings, systemd, events),
                                None if fabric is None else fabric.watch)
    images = ImageIds(settings.allowed_images if "container" in settings.allowed_runtimes else ())
    status = StatusRpcs(settings, sampler, rank, images, node_checks.mount_snapshot_pb,
                        node_checks.export_snapshot_pb, progress, this_boot, started_monotonic, monotonic, pressure,
                        None if gpus is None else gpus.read)
    rank_rpcs = RankRpcs(settings, rank, events, node_checks.path_trust, progress, this_boot, monotonic,
                         fabric_changes=None if fabric is None else fabric.subscribe)
    return AgentHandlers(
        status=status,
        rank=rank_rpcs,
        memory=MemoryRpcs(sampler, triggers, monotonic),
        node_checks=node_checks,
        pack=PackRpcs(settings, systemd, events, rank, node_checks.path_trust,
                      host_view() if host_root is None else host_root),
        files=FileRpcs(settings.state_dir, events),
        journal=JournalRpcs(settings, rank, events),
        events=EventRpcs(settings.node, events),
        diagnostics=DiagnosticsRpcs(settings, events, status.GetStatus,
                                    lambda: node_checks.mount_snapshot_pb().unit),
        collective=CollectiveTestRpcs(settings, systemd, events, rank, rank_rpcs, monotonic=monotonic),
        matmul=MatmulCheckRpcs(settings, systemd, events, rank, rank_rpcs, monotonic=monotonic),
        gateway=GatewayRpcs(settings, systemd, events, rank_rpcs, monotonic=monotonic))


class AgentService(agent_pb2_grpc.AgentServicer):
    """The servicer registered with gRPC: every RPC of protos/dsv41/v1/agent.proto, in its order,
    handed to the one handler that serves it."""

    def __init__(self, handlers: AgentHandlers):
        self._handlers = handlers

    def GetStatus(self, request, context):
        return self._handlers.status.GetStatus(request, context)

    def StartRank(self, request, context):
        return self._handlers.rank.StartRank(request, context)

    def StopRank(self, request, context):
        return self._handlers.rank.StopRank(request, context)

    def WatchRank(self, request, context):
        return self._handlers.rank.WatchRank(request, context)

    def WatchMemory(self, request, context):
        return self._handlers.memory.WatchMemory(request, context)

    def EnsureExport(self, request, context):
        return self._handlers.node_checks.EnsureExport(request, context)

    def RemoveExport(self, request, context):
        return self._handlers.node_checks.RemoveExport(request, context)

    def EnsureMount(self, request, context):
        return self._handlers.node_checks.EnsureMount(request, context)

    def GetMount(self, request, context):
        return self._handlers.node_checks.GetMount(request, context)

    def Remount(self, request, context):
        return self._handlers.node_checks.Remount(request, context)

    def RemoveMount(self, request, context):
        return self._handlers.node_checks.RemoveMount(request, context)

    def CheckFabric(self, request, context):
        return self._handlers.node_checks.CheckFabric(request, context)

    def GetPackState(self, request, context):
        return self._handlers.pack.GetPackState(request, context)

    def StartPack(self, request, context):
        return self._handlers.pack.StartPack(request, context)

    def PutFile(self, request, context):
        return self._handlers.files.PutFile(request, context)

    def RemoveFile(self, request, context):
        return self._handlers.files.RemoveFile(request, context)

    def GetFileDigest(self, request, context):
        return self._handlers.files.GetFileDigest(request, context)

    def WatchEvents(self, request, context):
        return self._handlers.events.WatchEvents(request, context)

    def ReadJournal(self, request, context):
        return self._handlers.journal.ReadJournal(request, context)

    def ClearCaches(self, request, context):
        return self._handlers.journal.ClearCaches(request, context)

    def CollectDiagnostics(self, request, context):
        return self._handlers.diagnostics.CollectDiagnostics(request, context)

    def RunCollectiveTest(self, request, context):
        return self._handlers.collective.RunCollectiveTest(request, context)

    def RunMatmulCheck(self, request, context):
        return self._handlers.matmul.RunMatmulCheck(request, context)

    def SetGateway(self, request, context):
        return self._handlers.gateway.SetGateway(request, context)


def ensure_dirs(settings: AgentSettings) -> None:
    for directory in (settings.state_dir, os.path.join(settings.state_dir, "state"), settings.cache_dir,
                      settings.rank_cache_dir, settings.container_cache_dir):
        os.makedirs(directory, mode=0o755, exist_ok=True)
