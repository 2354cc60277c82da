"""The agent's gRPC service: validates every request, then asks the component that owns it."""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from pathlib import Path
from typing import Callable

import grpc

from dsv41.v1 import agent_pb2 as pb
from dsv41.v1 import agent_pb2_grpc
from dsv41.version import VERSION

from dsv41 import progress as progress_files

from .auth import cert_not_after
from .bootid import boot_id
from .events import EventHub
from .images import ImageIds
from .memory import ChangeFilter, MeminfoInvalid, MemorySampler, Sample, SendPolicy, TriggerWatcher, Wakeup
from .rank import MEMORY_FLOOR, ExitRecord, RankError, RankManager, RankStatus
from .rankspec import RANK_UNIT, RankLaunch, SpecDenied, SpecInvalid, check_launch
from .roce import find_roce_v2_gid
from .pressure import NodePressure
from .rpc_diagnostics import DiagnosticsRpcs
from .rpc_files import FileRpcs
from .rpc_journal import JournalRpcs
from .rpc_nodechecks import NodeCheckRpcs, host_view
from .rpc_pack import PackRpcs
from .settings import AgentSettings
from .systemd import Systemd
from .treewatch import process_stopped

MIN_INTERVAL_MS, MAX_INTERVAL_MS = 20, 10_000
MAX_UNREADABLE_TICKS = 25  # ticks in a row without a readable meminfo before a stream gives up
MIN_HEARTBEAT_MS, MAX_HEARTBEAT_MS = 100, 60_000
MAX_MIN_CHANGE_BYTES = 1 << 40
MAX_HEARTBEAT_MS = 60_000
DEFAULT_HEARTBEAT_MS = 1_000
MAX_REPLAY_SAMPLES = 256


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


# systemd's Service.Result values (systemd.exec(5) "$SERVICE_RESULT"), as the wire's enum.
_EXIT_RESULTS = {"success": pb.ExitInfo.SUCCESS, "exit-code": pb.ExitInfo.EXIT_CODE, "signal": pb.ExitInfo.SIGNAL,
                 "core-dump": pb.ExitInfo.CORE_DUMP, "timeout": pb.ExitInfo.TIMEOUT, "oom-kill": pb.ExitInfo.OOM_KILL,
                 "watchdog": pb.ExitInfo.WATCHDOG, "start-limit-hit": pb.ExitInfo.START_LIMIT_HIT,
                 "resources": pb.ExitInfo.RESOURCES}
_EXIT_CODES = {"exited": pb.ExitInfo.EXITED, "killed": pb.ExitInfo.KILLED, "dumped": pb.ExitInfo.DUMPED}
_CAUSES = {MEMORY_FLOOR: pb.ExitInfo.MEMORY_FLOOR}


def exit_result_kind(result: str) -> int:
    """systemd's Result as the wire's ExitInfo.Result (OTHER for one this agent does not know)."""
    if not result:
        return pb.ExitInfo.RESULT_UNSPECIFIED
    return _EXIT_RESULTS.get(result, pb.ExitInfo.OTHER)


def exit_pb(record: ExitRecord | None) -> pb.ExitInfo | None:
    if record is None:
        return None
    return pb.ExitInfo(result=record.result, code=record.code, status=record.status, at_unix_s=record.at_unix_s,
                       invocation_id=record.invocation_id, result_kind=exit_result_kind(record.result),
                       code_kind=_EXIT_CODES.get(record.code, pb.ExitInfo.CODE_UNSPECIFIED),
                       cause=_CAUSES.get(record.cause, pb.ExitInfo.CAUSE_UNSPECIFIED), cause_detail=record.cause_detail,
                       first_loss_at_unix_s=record.first_loss_at_unix_s, first_loss_detail=record.first_loss_detail)


def rank_pb(state: RankStatus) -> pb.RankState:
    return pb.RankState(unit=RANK_UNIT, active_state=state.active_state, sub_state=state.sub_state,
                        main_pid=state.main_pid, active_since_unix_s=state.active_since_unix_s,
                        memory_current_bytes=state.memory_current, fingerprint=state.fingerprint,
                        invocation_id=state.invocation_id, status_text=state.status_text,
                        last_exit=exit_pb(state.last_exit), n_restarts=state.n_restarts,
                        stopping_cause=_CAUSES.get(state.stopping_cause, pb.ExitInfo.CAUSE_UNSPECIFIED),
                        stopping_detail=state.stopping_detail, first_loss_at_unix_s=state.first_loss_at_unix_s,
                        first_loss_detail=state.first_loss_detail)


def send_policy(request: pb.WatchMemoryRequest, interval_ms: int) -> SendPolicy | str:
    """The stream's SendPolicy, or what is wrong with the request."""
    if request.min_change_bytes > MAX_MIN_CHANGE_BYTES:
        return f"min_change_bytes {request.min_change_bytes}: must be 0..{MAX_MIN_CHANGE_BYTES} (0: send every sample)"
    if not request.min_change_bytes:
        if request.heartbeat_ms or request.replay_samples or request.follow_samples:
            return "heartbeat_ms, replay_samples and follow_samples apply only with min_change_bytes > 0"
        return SendPolicy()
    heartbeat_ms = request.heartbeat_ms or DEFAULT_HEARTBEAT_MS
    if not interval_ms <= heartbeat_ms <= MAX_HEARTBEAT_MS:
        return f"heartbeat_ms {heartbeat_ms}: must be interval_ms ({interval_ms})..{MAX_HEARTBEAT_MS}"
    for name in ("replay_samples", "follow_samples"):
        if getattr(request, name) > MAX_REPLAY_SAMPLES:
            return f"{name} {getattr(request, name)}: must be 0..{MAX_REPLAY_SAMPLES}"
    return SendPolicy(request.min_change_bytes, heartbeat_ms / 1000.0, request.replay_samples,
                      request.follow_samples)


def pressure_pb(p) -> pb.Pressure:
    return pb.Pressure(avg10=p.avg10, avg60=p.avg60, avg300=p.avg300, total_us=p.total_us)


def sample_pb(s: Sample) -> pb.MemorySample:
    return pb.MemorySample(
        at_monotonic_s=s.at_monotonic_s, mem_total_bytes=s.mem_total, mem_available_bytes=s.mem_available,
        cgroup_limit_bytes=s.cgroup_limit, cgroup_usage_bytes=s.cgroup_usage, available_bytes=s.available,
        some=pb.Pressure(avg10=s.some.avg10, avg60=s.some.avg60, avg300=s.some.avg300, total_us=s.some.total_us),
        full=pb.Pressure(avg10=s.full.avg10, avg60=s.full.avg60, avg300=s.full.avg300, total_us=s.full.total_us),
        rank_memory_bytes=s.rank_memory, psi_triggered=s.psi_triggered, seq=s.seq)


class AgentService(NodeCheckRpcs, PackRpcs, FileRpcs, JournalRpcs, DiagnosticsRpcs, agent_pb2_grpc.AgentServicer):
    """The RPCs; groups of them live in mixins (rpc_*.py) that use the attributes set here."""

    def __init__(self, settings: AgentSettings, systemd: Systemd, rank: RankManager, sampler: MemorySampler,
                 triggers: TriggerWatcher, events: EventHub, started_monotonic: float,
                 monotonic: Callable[[], float] = time.monotonic, pressure: NodePressure | None = None,
                 host_root: str | None = None, progress_dir: str = progress_files.DIRECTORY,
                 proc_root: str = "/proc"):
        self._settings = settings
        self._progress_dir = progress_dir  # where the ranks publish their forward-step counters
        self._boot_id = boot_id(proc_root)
        # Paths the coordinator names (pack directories) as PID 1 sees them: this unit's PrivateTmp=
        # hides /tmp and /var/tmp, where the pack job (its own unit) writes.
        self._host_root = host_view() if host_root is None else host_root
        self._systemd = systemd
        self._rank = rank
        self._sampler = sampler
        self._triggers = triggers
        self._events = events
        self._started = started_monotonic
        self._monotonic = monotonic
        self._images = ImageIds(settings.allowed_images if "container" in settings.allowed_runtimes else ())
        self._cert_expiry: tuple[float, int] = (-1.0, 0)  # (certificate mtime, notAfter)
        self._digest_lock = threading.Lock()
        self._digest: tuple[float, str] = (0.0, "")
        self._pressure = pressure or NodePressure()

    def launch_problems(self, launch: RankLaunch) -> list[str]:
        trust = self.path_trust()
        problems = trust.problems(launch.trust)
        problems += [p for p in (trust.shadow_problem(t) for t in launch.targets) if p]
        return problems

    def _adapter_digest(self) -> str:
        with self._digest_lock:
            at, value = self._digest
            if self._monotonic() - at > 10.0:
                value = adapter_digest(self._settings.adapter_dir)
                self._digest = (self._monotonic(), value)
            return value

    def _cert_not_after(self) -> int:
        """The agent certificate's notAfter, re-read only when the file changes (rotation needs no restart)."""
        path = self._settings.tls_cert
        try:
            mtime = os.stat(path).st_mtime if path else 0.0
        except OSError:
            return 0
        if mtime != self._cert_expiry[0]:
            self._cert_expiry = (mtime, cert_not_after(path))
        return self._cert_expiry[1]

    # -- status

    def GetStatus(self, request, context):
        try:
            memory = self._sampler.sample()
        except MeminfoInvalid as exc:
            context.abort(grpc.StatusCode.INTERNAL, f"cannot read this node's memory: {exc}")
        return pb.NodeStatus(
            node=self._settings.node, agent_version=VERSION, adapter_digest=self._adapter_digest(),
            agent_up_s=self._monotonic() - self._started, rank=rank_pb(self._settled_rank()),
            memory=sample_pb(memory), allowed_runtimes=list(self._settings.allowed_runtimes),
            mount=self.mount_snapshot_pb(), export=self.export_snapshot_pb(), images=self._images.get(),
            cert_not_after_unix_s=self._cert_not_after(), boot_id=self._boot_id, progress=self._progress(),
            pressure=[
                pb.ResourcePressure(resource=resource, some=pressure_pb(some), full=pressure_pb(full))
                for resource, (some, full) in self._pressure.read().items()])

    def _settled_rank(self):
        self._rank.refresh()
        return self._rank.settled_status()

    # -- rank

    def StartRank(self, request, context):
        spec = request.spec
        try:
            launch = check_launch(
                runtime=spec.runtime, argv=list(spec.argv), env=dict(spec.env), fills=dict(spec.agent_fills),
                binds=[(b.source, b.target, b.read_only) for b in spec.binds],
                exec_start_pre=[list(c.argv) for c in spec.exec_start_pre],
                exec_stop_post=[list(c.argv) for c in spec.exec_stop_post],
                stop_timeout_s=spec.stop_timeout_s, memory_max=spec.memory_max_bytes,
                memory_high=spec.memory_high_bytes, fingerprint=spec.fingerprint, rank=spec.rank,
                generation=spec.cluster_generation, fabric_address=spec.fabric_address, hcas=list(spec.hcas),
                settings=self._settings, memory_floor=spec.memory_floor_bytes,
                floor_kill_after_ms=spec.memory_floor_kill_after_ms, floor_interval_ms=spec.memory_floor_interval_ms)
        except SpecInvalid as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except SpecDenied as exc:
            self._events.warning("rank_request_denied", f"refused a rank request: {exc}")
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        problems = self.launch_problems(launch)
        if problems:
            self._events.warning("rank_request_denied", f"refused a rank request: {'; '.join(problems)}")
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "; ".join(problems))
        timeout = request.start_timeout_s or 60
        if timeout > 600:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "start_timeout_s: must be at most 600")
        facts = {}
        if "roce_gid_index" in launch.fills.values():
            match = find_roce_v2_gid(self._settings.sysfs_root, launch.hcas, launch.fabric_address)
            if match is None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"no RoCE v2 GID for {launch.fabric_address} on {', '.join(launch.hcas) or 'any HCA'}")
            facts["roce_gid_index"] = str(match.index)
        try:
            outcome, state = self._rank.start(launch, facts, request.replace, timeout)
        except RankError as exc:
            context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
        return pb.StartRankResponse(outcome=getattr(pb.StartRankResponse, outcome), rank=rank_pb(state))

    def StopRank(self, request, context):
        deadline = request.deadline_s or 120
        if deadline > 3600:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "deadline_s: must be at most 3600")
        try:
            outcome, record, leftover = self._rank.stop(float(deadline))
        except RankError as exc:
            context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
        return pb.StopRankResponse(outcome=getattr(pb.StopRankResponse, outcome), exit=exit_pb(record),
                                   leftover_processes=leftover)

    def _progress(self) -> list[pb.RankProgress]:
        return [pb.RankProgress(tp_rank=max(p.tp_rank, 0), forward_count=p.count, last_step_age_s=p.last_step_age_s,
                                pid=p.pid, problem=p.problem, process_stopped=process_stopped(p.pid))
                for p in progress_files.read_all(self._progress_dir)]

    def WatchRank(self, request, context):
        heartbeat_ms = request.heartbeat_ms
        if heartbeat_ms and not MIN_HEARTBEAT_MS <= heartbeat_ms <= MAX_HEARTBEAT_MS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"heartbeat_ms {heartbeat_ms}: must be 0 or {MIN_HEARTBEAT_MS}..{MAX_HEARTBEAT_MS}")
        interval = heartbeat_ms / 1000.0 if heartbeat_ms else None
        changes: queue.Queue = queue.Queue()
        unwatch = self._rank.watch(changes.put)
        seq = 0

        def event(state: RankStatus, heartbeat: bool) -> pb.RankEvent:
            nonlocal seq
            seq += 1
            return pb.RankEvent(at_monotonic_s=self._monotonic(), at_unix_s=time.time(), rank=rank_pb(state),
                                boot_id=self._boot_id, seq=seq, heartbeat=heartbeat,
                                progress=self._progress() if interval else [])
        try:
            yield event(self._rank.status(), False)
            beat_at = self._monotonic() + (interval or 0.0)
            while context.is_active():
                wait = min(1.0, max(0.0, beat_at - self._monotonic())) if interval else 1.0
                try:
                    state = changes.get(timeout=wait)
                except queue.Empty:
                    if interval and self._monotonic() >= beat_at:
                        yield event(self._rank.status(), True)
                        beat_at = self._monotonic() + interval
                    continue
                yield event(state, False)
        finally:
            unwatch()

    # -- memory

    def WatchMemory(self, request, context):
        interval_ms = request.interval_ms or 50
        if not MIN_INTERVAL_MS <= interval_ms <= MAX_INTERVAL_MS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"interval_ms {interval_ms}: must be {MIN_INTERVAL_MS}..{MAX_INTERVAL_MS}")
        policy = send_policy(request, interval_ms)
        if isinstance(policy, str):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, policy)
        sends = ChangeFilter(policy)
        fired = Wakeup()
        remove = self._triggers.add(fired.set) if request.psi_trigger else (lambda: None)
        interval = interval_ms / 1000.0
        # Sending only changes, a tick reads just what "available" needs; PSI and the rank's memory
        # are read for the samples sent (held-back ones that may be replayed are read in full).
        lazy = policy.min_change_bytes > 0 and policy.replay == 0
        complete = self._sampler.with_details if lazy else (lambda sample: sample)
        taken = unreadable = 0
        try:
            next_at = self._monotonic()
            while context.is_active():
                taken += 1
                pushed = fired.wait(next_at - self._monotonic())
                try:
                    sample = self._sampler.sample(psi_triggered=pushed, details=not lazy, seq=taken)
                    unreadable = 0
                except MeminfoInvalid as exc:
                    # A tick that cannot be read is skipped (seq shows the gap); one that never can ends
                    # the stream with the reason rather than sending a node that seems out of memory.
                    unreadable += 1
                    if unreadable >= MAX_UNREADABLE_TICKS:
                        context.abort(grpc.StatusCode.INTERNAL, f"cannot read this node's memory: {exc}")
                    sample = None
                for sent in sends.offer(sample) if sample is not None else ():
                    yield sample_pb(complete(sent))
                if pushed:  # a PSI trigger cut the wait short: the timer's tick is still due
                    continue
                next_at += interval
                now = self._monotonic()
                if next_at < now:
                    # A tick missed (a slow reader, or the agent starved of CPU while the rank
                    # populates memory): take the next sample at once, then keep the cadence from
                    # it. One fresh sample, not a burst of the missed ones, and not a further
                    # interval's wait: a node falling fast is seen when the agent can look.
                    next_at = now
        finally:
            remove()
            fired.close()

    # -- events

    def WatchEvents(self, request, context):
        events, unsubscribe = self._events.subscribe(replay=64)
        try:
            while context.is_active():
                try:
                    event = events.get(timeout=1.0)
                except queue.Empty:
                    continue
                yield pb.Event(at_unix_s=event.at_unix_s, node=self._settings.node, kind=event.kind,
                               priority=event.priority, message=event.message, fields=event.fields)
        finally:
            unsubscribe()


def ensure_dirs(settings: AgentSettings) -> None:
    for directory in (settings.state_dir, os.path.join(settings.state_dir, "state"), settings.cache_dir,
                      settings.rank_cache_dir, settings.container_cache_dir):
        os.makedirs(directory, mode=0o755, exist_ok=True)
