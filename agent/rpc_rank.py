"""RPCs for the rank: StartRank (the request checked, its paths trusted), StopRank and WatchRank."""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Callable

import grpc

from dsv41.v1 import agent_pb2 as pb

from .pathtrust import PathTrust
from .rank import MEMORY_FLOOR, ExitRecord, RankError, RankManager, RankStatus
from .rankspec import RANK_UNIT, RankLaunch, SpecDenied, SpecInvalid, check_launch
from .roce import find_roce_v2_gid

MIN_HEARTBEAT_MS, MAX_HEARTBEAT_MS = 100, 60_000

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
                        first_loss_detail=state.first_loss_detail, adapter_version=state.adapter_version)


@dataclass(frozen=True)
class _FabricChanged:
    """The fabric watch's changes, queued beside the rank's states for one WatchRank stream."""
    changes: tuple


class RankRpcs:
    """StartRank, StopRank and WatchRank, over the node's one rank unit."""

    def __init__(self, settings, rank: RankManager, events, path_trust: Callable[[], PathTrust],
                 progress: Callable[[], list[pb.RankProgress]], boot_id: str,
                 monotonic: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 fabric_changes: Callable[[Callable], Callable[[], None]] | None = None):
        """path_trust: checks paths as PID 1 (and so the rank) sees them; progress: the ranks'
        forward-step counters, for WatchRank's heartbeats; fabric_changes: subscribes a listener to
        the fabric watch's changes (FabricWatch.subscribe), each sent at once on every WatchRank."""
        self._fabric_changes = fabric_changes
        self._settings = settings
        self._rank = rank
        self._events = events
        self._path_trust = path_trust
        self._progress = progress
        self._boot_id = boot_id
        self._monotonic = monotonic
        self._wall = wall

    def launch_problems(self, launch: RankLaunch) -> list[str]:
        trust = self._path_trust()
        problems = trust.problems(launch.trust)
        problems += [p for p in (trust.shadow_problem(t) for t in launch.targets) if p]
        return problems

    def checked_launch(self, spec: pb.RankSpec, context) -> RankLaunch:
        """The RankSpec validated and its paths trusted; aborts the RPC with the reason otherwise
        (StartRank's, and the collective test's, which runs in the rank's runtime)."""
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
        return launch

    def node_facts(self, launch: RankLaunch, context) -> dict[str, str]:
        """What the agent fills in (agent_fills): the RoCE v2 GID index of the fabric address."""
        facts = {}
        if "roce_gid_index" in launch.fills.values():
            match = find_roce_v2_gid(self._settings.sysfs_root, launch.hcas, launch.fabric_address)
            if match is None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"no RoCE v2 GID for {launch.fabric_address} on {', '.join(launch.hcas) or 'any HCA'}")
            facts["roce_gid_index"] = str(match.index)
        return facts

    def StartRank(self, request, context):
        launch = self.checked_launch(request.spec, context)
        timeout = request.start_timeout_s or 60
        if timeout > 600:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "start_timeout_s: must be at most 600")
        facts = self.node_facts(launch, context)
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

    def WatchRank(self, request, context):
        heartbeat_ms = request.heartbeat_ms
        if heartbeat_ms and not MIN_HEARTBEAT_MS <= heartbeat_ms <= MAX_HEARTBEAT_MS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"heartbeat_ms {heartbeat_ms}: must be 0 or {MIN_HEARTBEAT_MS}..{MAX_HEARTBEAT_MS}")
        interval = heartbeat_ms / 1000.0 if heartbeat_ms else None
        changes: queue.Queue = queue.Queue()
        unwatch = self._rank.watch(changes.put)
        unwatch_fabric = self._fabric_changes(lambda found: changes.put(_FabricChanged(found))) \
            if self._fabric_changes else (lambda: None)
        seq = 0

        def event(state: RankStatus, heartbeat: bool, fabric: tuple = ()) -> pb.RankEvent:
            nonlocal seq
            seq += 1
            return pb.RankEvent(at_monotonic_s=self._monotonic(), at_unix_s=self._wall(), rank=rank_pb(state),
                                boot_id=self._boot_id, seq=seq, heartbeat=heartbeat,
                                progress=self._progress() if interval else [],
                                fabric_changes=[pb.FabricChange(netdev=c.netdev, what=c.what, before=c.before,
                                                                after=c.after) for c in fabric])
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
                if isinstance(state, _FabricChanged):
                    yield event(self._rank.status(), False, state.changes)
                else:
                    yield event(state, False)
        finally:
            unwatch_fabric()
            unwatch()
