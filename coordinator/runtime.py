"""The cluster runtime: one supervisor thread brings the cluster up, keeps it serving and stops it.

Only the supervisor thread changes the cluster's state and drives agents. Rank watchers post the
rank states they see, the control socket and the memory guard post requests and jobs
(coordinator.messages, policy.Request); the supervisor applies them in order. While a step waits
(a poll, a health check, an agent call) the supervisor keeps reading its inbox: a rank that exits
fails the step at once, and an operator's stop, restart or shutdown cancels the step within a
fraction of a second, after which the ranks started so far are stopped, rank 0 first. The
decisions are pure functions in coordinator.policy; the steps are modules of coordinator.bringup.
The coordinator never touches D-Bus, sysfs or netlink itself: it asks the agents.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from typing import Any, Callable

from dsv41.journal import EventLog
from dsv41.v1 import agent_pb2 as pb

from . import adopt, bringup, fabricdrift, liveness, policy, share, stopping
from . import plan as plan_mod
from . import unexport as unexport_mod
from .agents import AgentClient, AgentUnavailable
from .bringup import BringUp, Preempted, StepContext, StepFailed
from .bringup.health import RANK_UNIT
from .packstate import incomplete
from .config import ClusterConfig
from .drain import OPERATOR_REASON, Drainer, Outcome, lift_stale
from .guard.engine import EngineApi
from .incidentlog import KEEP as INCIDENTS_KEPT, Counts, IncidentHistory, Loaded
from .messages import (AutotuneResetJob, CanaryDone, CanarySent, FabricTestJob, IncidentSeen, PackStartJob,
                       RankObserved, UnexportJob, Wake, WatchLost, WorkSeen)
from .parallel import on_each, spawn
from .peerfailure import peer_failure
from .policy import Action, Activity, RankExit, Request
from .state import STARTING, Incident, IncidentKind, Phase, Snapshot, generation_of, step_failed

__all__ = ["ClusterRuntime", "Incident", "Snapshot", "StepFailed", "generation_of"]

GIB = 1 << 30
SETTLE_S = 0.5  # when one rank dies the others follow within moments: wait for them before blaming
# Every rank seen to exit says its collective lost a peer: the peer that went may still be ending
# (its launcher killed, its unit stopping the scheduler it left behind) on a busy node.
CAUSE_WAIT_S = 3.0
# A rank's lines around its loss, read for a collective's "closed by peer": the scheduler logs its
# traceback moments before it ends (journald stamps lines as it reads them: a little later, at
# times). Narrower than any run: an earlier run's lines are not this one's.
EVIDENCE_LINES = 2000
EVIDENCE_WINDOW_S = 10.0
EVIDENCE_TIMEOUT_S = 5.0
MEMORY_POLL_S = 1.0
JOB_WAIT_S = 150.0
TICK_S = 0.25  # how often leases and hangs are checked when nothing arrives
WAIT_POLL_S = 1.0


def boottime() -> float:
    """CLOCK_BOOTTIME: the monotonic clock plus the time the machine spent suspended."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


@dataclass(frozen=True)
class Rollout:
    """A configuration change the ranks restart for: until the group has served for `confirm_s`,
    a failed bring-up or a rank exit brings the configuration before it back (`roll_back(why)`,
    which must not block: the daemon rebuilds the coordinator around the previous one)."""
    keys: tuple[str, ...]
    confirm_s: float
    roll_back: Callable[[str], None]


@dataclass(frozen=True)
class Trouble:
    """What ended a serving cluster, found by the supervisor, to recover from."""
    kind: IncidentKind  # RANK_EXIT, NODE_LOST, NODE_REBOOTED, RANK_HUNG
    node: str = ""
    message: str = ""


class ClusterRuntime:
    def __init__(self, cfg: ClusterConfig, clients: dict[str, AgentClient], log: EventLog,
                 table_source_dir: str = plan_mod.STATE_DIR, state_dir: str = "/var/lib/dsv41/coordinator",
                 api_key: str | None = None, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic, boottime: Callable[[], float] | None = None,
                 history: IncidentHistory | None = None, started_unix_s: float | None = None):
        self.cfg = cfg
        self.clients = clients
        self._log = log
        self._table_dir = table_source_dir
        self._state_dir = state_dir
        self._api_key = api_key  # read from API_KEY_FILE by the daemon; reaches rank 0 as a 0600 file
        self._clock, self._monotonic = clock, monotonic
        self._boottime = boottime or monotonic  # None: the monotonic clock given (a fake clock's pair)
        self.base_url = f"http://{cfg.text('HEAD_IP')}:{cfg.integer('PORT')}"
        # Published state: written by the supervisor only, read by anyone under the lock.
        self._lock = threading.Lock()
        # Incidents: those of earlier coordinators first, from the history on disk (never re-announced
        # to the listeners: the hook ran for them then); the counts keep those its bound dropped.
        self._history = history
        loaded = history.load() if history is not None else Loaded()
        self._incidents: list[Incident] = loaded.incidents[-INCIDENTS_KEPT:]
        self._incident_counts: Counts = dict(loaded.counts)
        # When this coordinator started (a configuration applied since builds a new runtime, not a new
        # coordinator), and how many of the first incidents came before it.
        self.started_unix_s = clock() if started_unix_s is None else started_unix_s
        self._earlier_incidents = sum(1 for i in self._incidents if i.at_unix_s < self.started_unix_s)
        self._incident_listeners: list[Callable[[Incident], None]] = []
        # Until the supervisor has looked for ranks to adopt, the cluster is neither stopped nor
        # serving, and the control socket already answers: status says "starting" there.
        self._snapshot = Snapshot(phase=STARTING, detail="looking for running ranks to adopt",
                                  since=self.started_unix_s,
                                  last_incident=self._incidents[-1] if self._incidents else None)
        self._snapshot_heard: dict[str, liveness.Heard] = {}  # the heartbeats, as readers see them
        # Hand-over from other threads.
        self._inbox: queue.Queue = queue.Queue()
        self._request_lock = threading.Lock()
        self._pending: Request | None = None
        # The supervisor's own state: touched by its thread only.
        self._activity = Activity.IDLE
        self._step = ""
        self._ranks_run = False  # this bring-up has started ranks: an exit fails it
        self._bring = BringUp()
        self._exits: dict[str, RankExit] = {}  # node -> how its rank of this generation ended
        self._trouble: Trouble | None = None  # found while serving; the loop recovers from it next
        # Liveness: the agents' heartbeats (on the rank watch), which boot each node runs, nodes not
        # heard from for a lease, and whether the serving cluster has work it must be stepping on.
        self._heard: dict[str, liveness.Heard] = {}
        self._boots: dict[str, str] = {}
        self._lost: dict[str, float] = {}  # node -> when last heard
        self._watching_since = monotonic()
        # The coordinator's own pauses: its last lease check, a pause not yet told, and when it last
        # ran again (leases and stalls are not counted across it).
        self._last_check: liveness.Tick | None = None
        self._checked_boots: dict[str, str] = {}  # the nodes' boots at that check
        self._pause: liveness.Pause | None = None
        self._first_after: dict[str, float] = {}  # node -> its first arrival since the pause not yet told
        self._resumed_at: float | None = None
        self._pending_since: float | None = None
        self._busy = False
        self._canary_out = False
        self._deferred: list = []  # jobs that arrived during an activity
        self._watch_lost: set[str] = set()  # nodes whose rank watch broke and has not answered since
        self._drift = fabricdrift.FabricDrift(cfg.number("FABRIC_SETTLE_S"), monotonic)
        self._stop_watchers = threading.Event()
        self._watch_threads: list[threading.Thread] = []
        self._done = threading.Event()
        self._worker = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self._autostart = True
        self._restart_for: tuple[str, ...] = ()
        self._rollout: Rollout | None = None

    # ------------------------------------------------------------------ public, thread-safe

    @property
    def log(self) -> EventLog:
        """Its events' log (a group's carries DSV41_GROUP): the group's guard logs there too."""
        return self._log

    def snapshot(self) -> Snapshot:
        with self._lock:
            return self._snapshot

    def guarded_run(self) -> tuple[float, bool] | None:
        """The run of the ranks the memory guard watches now: when it began, and whether its ranks
        serve requests (bringup.GUARDED_PHASES, from the steps' declarations); None: none runs."""
        snap = self.snapshot()
        if snap.phase not in bringup.GUARDED_PHASES or not snap.ranks_since:
            return None
        return snap.ranks_since, bringup.GUARDED_PHASES[snap.phase]

    def incidents(self) -> list[Incident]:
        """Oldest first, those recorded before this coordinator started included (the history)."""
        with self._lock:
            return list(self._incidents)

    def earlier_incidents(self) -> int:
        """How many of incidents(), the first ones, were recorded before this coordinator started."""
        with self._lock:
            return self._earlier_incidents

    def on_incident(self, listener: Callable[[Incident], None]) -> None:
        """listener(incident) on the supervisor thread for every incident: it must not block."""
        with self._lock:
            self._incident_listeners.append(listener)

    def follow_incidents(self, listener: Callable[[Incident], None]) -> Counts:
        """on_incident(listener), returning the incidents counted so far by (kind, node), earlier
        coordinators' included: at once, so that each incident is in the counts or given to the
        listener, never both nor neither (the metrics' counters carry on from them)."""
        with self._lock:
            self._incident_listeners.append(listener)
            return dict(self._incident_counts)

    def run(self, autostart: bool = True, restart_for: tuple[str, ...] = (), rollout: Rollout | None = None) -> None:
        """Starts the supervisor: re-adopt what runs, else bring the cluster up when asked to.
        `restart_for`: keys of a configuration change that needs the ranks restarted; the running
        ones are stopped and the group brought up again under `rollout`, if given."""
        self._watching_since = self._monotonic()
        heartbeat_ms = max(100, int(self.cfg.number("NODE_LEASE_S") * 250))  # four heartbeats a lease
        for client in self.clients.values():
            node = client.node
            self._watch_threads.append(client.watch_rank(
                lambda event, node=node: self._inbox.put(RankObserved.of(node, event, self._monotonic())),
                lambda why, node=node: self._inbox.put(WatchLost(node, why)), self._stop_watchers,
                heartbeat_ms=heartbeat_ms))
        self._autostart = autostart
        self._restart_for, self._rollout = restart_for, rollout
        self._worker.start()

    def post(self, message: object) -> None:
        """An observation for the supervisor (the serving probe's WorkSeen, CanarySent, CanaryDone)."""
        self._inbox.put(message)

    def liveness_views(self) -> dict[str, tuple[float, float, int]]:
        """node -> (seconds since its last heartbeat, seconds since its rank's last forward step,
        forward steps); -1 where not known."""
        now = self._monotonic()
        with self._lock:
            heard = dict(self._snapshot_heard)
        out = {}
        for node in self.clients:
            h = heard.get(node)
            if h is None:
                out[node] = (-1.0, -1.0, 0)
                continue
            step_age = -1.0 if h.stopped_at is None else max(0.0, now - h.stopped_at)
            out[node] = (max(0.0, now - h.at), step_age, h.forward_count or 0)
        return out

    def request(self, action: str, reason: str | None = None, source: str = "dsv41ctl", drain: bool = False) -> None:
        """An operator's (or the memory guard's) start, stop or restart; it supersedes one not yet
        served, and a stop or restart cancels a bring-up under way. `reason` is shown as the phase
        detail; a stop with a reason is recorded as an incident. `drain`: a restart that can wait
        lets rank 0's requests finish first (coordinator/drain.py)."""
        self._offer(Request(Action(action), reason or "", source=source, drain=drain))

    def shutdown(self, stop_cluster: bool) -> None:
        """Stops the supervisor (cancelling a bring-up); with stop_cluster, brings the ranks down first
        and confirms it on every node."""
        self._offer(Request(Action.SHUTDOWN, "coordinator stopping", stop_cluster, source="coordinator"))
        self._done.wait()
        self._stop_watchers.set()

    def unexport(self, force: bool, unmount: bool, wait_s: float = JOB_WAIT_S) -> tuple[bool, str]:
        """An operator's `dsv41ctl share unexport`: (done, what happened or why it was refused).

        Refused unless forced while a worker has the export mounted (the head's agent decides, from
        the `mounted_by` the workers' agents report) or ranks run or start; `unmount` first removes
        the workers' mounts, which their agents allow only while their ranks are stopped."""
        phase = self.snapshot().phase
        if not force and phase in share.BUSY_PHASES:
            return False, share.refusal("", [], [], phase)
        return self._submit(UnexportJob(force, unmount), wait_s)

    def start_pack(self, wait_s: float = JOB_WAIT_S) -> list[str]:
        """`dsv41ctl pack --start`: starts the pack job where shards are incomplete; the nodes it was
        started on. AgentUnavailable when an agent cannot be asked; RuntimeError when busy."""
        return self._submit(PackStartJob(), wait_s, busy=RuntimeError)

    def autotune_reset(self, wait_s: float = JOB_WAIT_S) -> tuple[bool, str]:
        return self._submit(AutotuneResetJob(), wait_s)

    def fabric_test(self) -> tuple[bool, str]:
        """`dsv41ctl fabric test`: the collective gate's job now; its figures go to the snapshot."""
        return self._submit(FabricTestJob(), self.cfg.integer("COLLECTIVE_TIMEOUT_S") + 60.0)

    # ------------------------------------------------------------------ hand-over

    def _offer(self, new: Request) -> None:
        with self._request_lock:
            self._pending = policy.merge_requests(self._pending, new)
        self._inbox.put(Wake())

    def _take_request(self) -> Request | None:
        with self._request_lock:
            request, self._pending = self._pending, None
            return request

    def _peek_request(self) -> Request | None:
        with self._request_lock:
            return self._pending

    def _submit(self, job, wait_s: float, busy: type[Exception] | None = None):
        self._inbox.put(job)
        try:
            return job.reply.result(timeout=wait_s)
        except FutureTimeout:
            if job.reply.cancel():
                message = (f"the coordinator is busy (phase {self.snapshot().phase}) and did not get to it within "
                           f"{wait_s:g} s; nothing was changed: try again")
                if busy is not None:
                    raise busy(message) from None
                return False, message
            return job.reply.result()

    # ------------------------------------------------------------------ published state

    def _set(self, **changes) -> Snapshot:
        with self._lock:
            if "phase" in changes and changes["phase"] != self._snapshot.phase:
                changes.setdefault("since", self._clock())
            self._snapshot = replace(self._snapshot, **changes)
            return self._snapshot

    def _record_rank(self, node: str, rank: pb.RankState) -> None:
        with self._lock:
            ranks = dict(self._snapshot.ranks)
            ranks[node] = rank
            self._snapshot = replace(self._snapshot, ranks=ranks)

    def _incident(self, node: str, kind: IncidentKind, message: str) -> Incident:
        incident = Incident(self._clock(), node, kind, message)
        if self._history is not None:
            self._history.append(incident)  # on disk before anyone is told; a failed write is only logged
        with self._lock:
            self._incidents.append(incident)
            cut = max(0, len(self._incidents) - INCIDENTS_KEPT)
            del self._incidents[:cut]
            self._earlier_incidents = max(0, self._earlier_incidents - cut)
            key = (str(kind), node)
            self._incident_counts[key] = self._incident_counts.get(key, 0) + 1
            self._snapshot = replace(self._snapshot, last_incident=incident)
            listeners = list(self._incident_listeners)  # with the count: see follow_incidents
        self._log.error("incident", f"{node}: {message}", node_name=node, incident=kind)
        for listener in listeners:
            try:
                listener(incident)
            except Exception as exc:  # a listener's bug must not stop the supervisor
                self._log.error("incident_listener_error", f"an incident listener failed: {exc!r}")
        return incident

    # ------------------------------------------------------------------ the supervisor loop

    def _run(self) -> None:
        self._guarded("start", self._first_start)
        while True:
            request = self._take_request()
            if request is not None:
                if request.action is Action.SHUTDOWN:
                    if request.stop_cluster:
                        self._guarded("shutdown", lambda: self._stop_ranks("coordinator stopping"))
                    self._done.set()
                    return
                self._guarded(request.action.value, lambda: self._serve(request))
                continue
            if self._trouble is not None:
                trouble, self._trouble = self._trouble, None
                self._guarded("recovery", lambda: self._recover(trouble))
                continue
            if self._deferred:
                message = self._deferred.pop(0)
            else:
                try:
                    message = self._inbox.get(timeout=TICK_S)
                except queue.Empty:
                    message = Wake()
            self._guarded("event", lambda: self._apply(message, react=True))
            self._guarded("liveness", lambda: self._check_liveness(react=True))
            self._confirm_rollout()

    def _guarded(self, what: str, fn: Callable[[], None]) -> None:
        """Runs one activity; the loop serves a preempting request next, and survives anything else."""
        try:
            fn()
        except Preempted:
            pass  # the request that preempted it is in the slot: the loop serves it next
        except Exception as exc:  # the supervisor must survive anything an activity throws
            self._log.error("supervisor_error", f"{what} failed unexpectedly: {exc!r}")
            self._set(phase=Phase.FAILED, detail=f"{what}: internal error: {exc}")
        finally:
            self._activity = Activity.IDLE

    def _serve(self, request: Request) -> None:
        if request.action is Action.STOP:
            if request.reason:
                self._incident(self.cfg.head.name, IncidentKind.STOPPED, request.reason)
            self._stop_ranks(request.reason or "requested by dsv41ctl stop")
        elif request.action is Action.START:
            if self.snapshot().phase != Phase.SERVING:
                self._bring_up_with_retries(reset_attempts=True)
        elif request.action is Action.RESTART:
            rank0_drains = True
            if request.drain and self.snapshot().phase in (Phase.SERVING, Phase.DRAINING):
                rank0_drains = self._drain_first(request.reason or OPERATOR_REASON)
                if rank0_drains is None:
                    return  # the group broke meanwhile: the loop recovers from that next
            self._stop_ranks("restart requested", wait_memory=True, drain=rank0_drains)
            self._bring_up_with_retries(reset_attempts=True)

    def _first_start(self) -> None:
        if self._restart_for:
            keys = ", ".join(self._restart_for)
            self._log.event("config_restart", f"restarting the ranks for the configuration change of {keys}",
                            "notice", keys=keys)
            rank0_drains = self._drain_first(f"configuration change: {keys}")  # planned: it can wait
            self._trouble = None  # the old configuration's group broke during it: the restart replaces it anyway
            self._stop_ranks(f"configuration change: {keys}", final_phase=None, wait_memory=True,
                             drain=bool(rank0_drains))
            self._bring_up_with_retries(reset_attempts=True)
            return
        if self._adopt():
            return
        if self._autostart:
            self._bring_up_with_retries()
        elif self.snapshot().phase == STARTING:  # nothing runs (ranks that run but do not answer stay "health")
            self._set(phase=Phase.STOPPED, detail="nothing was running; waiting for dsv41ctl start")

    def _drain_first(self, reason: str) -> bool | None:
        """The drain before a restart that can wait: None when the group broke meanwhile (the urgent
        path takes over), else whether rank 0 may still drain at its stop (nothing is being cut)."""
        self._activity = Activity.DRAINING
        self._set(phase=Phase.DRAINING, detail=f"draining for a restart: {reason}")
        engine = EngineApi(self.base_url, self._api_key, timeout_s=5.0)
        try:
            drained = Drainer(engine, self._log, wait=self._wait, call=self._call, monotonic=self._monotonic,
                              broken=lambda: self._trouble is not None,
                              set_detail=lambda detail: self._set(detail=detail)).run(
                reason, self.cfg.number("DRAIN_TIMEOUT_S"))
        except Preempted as preempted:
            if preempted.request.action is Action.SHUTDOWN and not preempted.request.stop_cluster:
                lift_stale(engine, self._log, "the coordinator stops leaving the ranks serving")
            raise
        finally:
            engine.close()
            self._activity = Activity.IDLE
        return None if drained.outcome is Outcome.BROKEN else drained.nothing_left

    def _lift_stale_drain(self, why: str) -> None:
        engine = EngineApi(self.base_url, self._api_key, timeout_s=5.0)
        try:
            lift_stale(engine, self._log, why)
        finally:
            engine.close()

    def _watching_group(self) -> bool:
        """Whether a broken group is trouble to recover from now: serving, or draining before a restart."""
        return self._trouble is None and (self._activity, self.snapshot().phase) in (
            (Activity.IDLE, Phase.SERVING), (Activity.DRAINING, Phase.DRAINING))

    # ------------------------------------------------------------------ events

    def _apply(self, message: Any, react: bool) -> None:
        """One inbox message. `react`: may fail the running step (a rank exit during a bring-up)."""
        if isinstance(message, RankObserved):
            self._observe(message, react)
        elif isinstance(message, WatchLost):
            if message.node not in self._watch_lost:  # once per loss: the watcher retries every second
                self._watch_lost.add(message.node)
                self._log.warning("agent_stream_lost", f"{message.node}: lost the rank watch ({message.why}); "
                                  "re-subscribing", node_name=message.node)
        elif isinstance(message, (WorkSeen, CanarySent, CanaryDone)):
            self._note_work(message)
        elif isinstance(message, IncidentSeen):
            self._incident(message.node, IncidentKind(message.kind), message.message)
        elif isinstance(message, (UnexportJob, PackStartJob, AutotuneResetJob, FabricTestJob)):
            if self._activity is Activity.IDLE and react:
                self._run_job(message)
            else:
                self._deferred.append(message)
        elif not isinstance(message, Wake):
            self._log.error("supervisor_error", f"unknown message {message!r}")

    def _observe(self, message: RankObserved, react: bool) -> None:
        node = message.node
        if node in self._watch_lost:
            self._watch_lost.discard(node)
            self._log.info("agent_stream_back", f"{node}: the rank watch is back", node_name=node)
        self._record_rank(node, message.rank)
        if message.fabric_changes:
            self._note_drift(node, message.fabric_changes)
        if message.received_at:
            self._heard_from(message, react)
        found = policy.new_exit(node, message.rank, self._bring.launched.get(node), self._exits, self._clock())
        if found is None:
            return
        self._exits[node] = found
        self._log.info("rank_gone", f"{node}: {found.describe()}", node_name=node, invocation=found.invocation_id,
                       exited_at_unix_s=f"{found.at_unix_s:.6f}")
        if not react:
            return
        if self._activity is Activity.BRINGUP and self._ranks_run:
            self._settle()
            blame = policy.first_failure(list(self._exits.values()))
            raise StepFailed(self._step, blame.node, f"during bring-up, {blame.message}",
                             incident=IncidentKind.MEMORY_FLOOR if blame.floor else None)
        if self._watching_group():
            self._trouble = Trouble(IncidentKind.RANK_EXIT, node)

    # ------------------------------------------------------------------ liveness

    def _heard_from(self, message: RankObserved, react: bool) -> None:
        """A node's agent answered on its stream: its lease, its boot, its ranks' progress."""
        node, now = message.node, message.received_at
        counts = [p for p in message.progress if not p.problem]
        lowest = min(counts, key=lambda p: p.forward_count) if counts else None
        self._heard[node] = liveness.Heard(
            now, message.boot_id, 0, lowest.forward_count if lowest else None,
            now - lowest.last_step_age_s if lowest else None, message.rank.active_state == "active",
            any(p.process_stopped for p in message.progress))
        with self._lock:
            self._snapshot_heard = dict(self._heard)
        if self._pause is not None and now > self._pause.resumed_at:
            self._first_after.setdefault(node, now)
        if node in self._lost:
            gone_for = now - self._lost.pop(node)
            self._log.info("node_back", f"{node}: heard from again after {gone_for:.1f} s", node_name=node,
                           silent_s=round(gone_for, 3))
        known = self._boots.get(node, "")
        if message.boot_id:
            self._boots[node] = message.boot_id
        if not liveness.rebooted(known, message.boot_id):
            return
        why = f"{node} booted again (boot {known} -> {message.boot_id}): its rank is gone"
        self._incident(node, IncidentKind.NODE_REBOOTED, why)
        if not react:
            return
        if self._activity is Activity.BRINGUP and self._ranks_run:
            raise StepFailed(self._step, node, why, transient=True, incident="")
        if self._watching_group():
            self._trouble = Trouble(IncidentKind.NODE_REBOOTED, node, why)

    def _note_work(self, message) -> None:
        """What the serving probe saw: whether the cluster has work it must be stepping on."""
        if isinstance(message, WorkSeen):
            if message.busy is not None:
                self._busy = message.busy
        elif isinstance(message, CanarySent):
            self._canary_out = True
        elif isinstance(message, CanaryDone) and message.ok:
            self._canary_out = False
        if self._busy or self._canary_out:
            if self._pending_since is None:
                self._pending_since = message.at
        else:
            self._pending_since = None

    def _lost_message(self, node: str, now: float) -> str:
        since = self._lost.get(node)
        when = time.strftime("%H:%M:%S", time.localtime(self._clock() - (now - since))) if since else "?"
        return (f"{node} lost: not heard from since {when} ({now - since:.1f} s, NODE_LEASE_S="
                f"{self.cfg.number('NODE_LEASE_S'):g})") if since else f"{node} lost"

    def _check_liveness(self, react: bool) -> None:
        """Leases and hangs. While starting or serving, a lapsed lease is a lost node; while serving,
        a rank that takes no step while work is pending is hung."""
        now = self._monotonic()
        lease = self.cfg.number("NODE_LEASE_S")
        self._watch_own_pause(now, lease)
        if react:
            self._react_to_drift()
        newly = []
        for node in self.clients:
            last = self._heard.get(node)
            if node not in self._lost and liveness.lapsed(last.at if last else None, now, lease,
                                                          self._watching_since, self._resumed_at):
                self._lost[node] = last.at if last else self._watching_since
                newly.append(node)
                self._log.warning("node_unheard", f"{node}: no heartbeat for {lease:g} s (NODE_LEASE_S)",
                                  node_name=node)
        if not react:
            return
        if newly and self._activity is Activity.BRINGUP and self._ranks_run:
            raise StepFailed(self._step, newly[0], self._lost_message(newly[0], now), transient=True,
                             unreachable=tuple(newly), incident=IncidentKind.NODE_LOST)
        if not self._watching_group():
            return
        if newly:
            self._trouble = Trouble(IncidentKind.NODE_LOST, newly[0], self._lost_message(newly[0], now))
            return
        if self._lost:
            return
        found = liveness.hung(self._heard, list(self.clients),
                              liveness.stall_counted_from(self._pending_since, self._resumed_at), now,
                              self.cfg.number("HANG_TIMEOUT_S"), self.cfg.number("HANG_FIRST_STEP_TIMEOUT_S"),
                              fresh_s=lease / 2)
        if found is not None:
            self._trouble = Trouble(IncidentKind.RANK_HUNG, found.node, (
                f"rank on {found.node} hung: no forward step for {found.stalled_s:.1f} s while work was pending "
                f"(at step {found.forward_count}; HANG_TIMEOUT_S={self.cfg.number('HANG_TIMEOUT_S'):g})"
                + ("; its rank process is stopped (SIGSTOP?)" if self._heard[found.node].process_stopped else "")))

    def _ranks_serve_or_start(self) -> bool:
        return ((self._activity is Activity.IDLE and self.snapshot().phase == Phase.SERVING)
                or (self._activity is Activity.BRINGUP and self._ranks_run))

    def _note_drift(self, node: str, wire_changes) -> None:
        """A change counts when reported while the ranks run: one before (a node whose link came back
        while it was waited for) is checked by the bring-up's fabric step anyway."""
        if self._ranks_serve_or_start():
            self._drift.note(node, wire_changes)
            return
        self._log.info("fabric_changed", f"{node}: the fabric changed while no rank runs ("
                       + "; ".join(c.describe() for c in fabricdrift.changes_of(wire_changes))
                       + "): the next bring-up checks it", node_name=node)

    def _react_to_drift(self, settled: dict | None = None) -> None:
        """A node's fabric changed while the ranks ran: an incident naming it and the changes, then a
        restart that can wait (coordinator/fabricdrift.py says why). `settled`: changes to record
        without waiting (a bring-up begins: its fabric step checks them)."""
        react = fabricdrift.Reaction.RECORD
        if settled is None:
            settled = self._drift.take_settled()
            react = fabricdrift.reaction(self._ranks_serve_or_start(),
                                         self._peek_request() is not None or self._trouble is not None)
        for node, found in settled.items():
            self._incident(node, IncidentKind.FABRIC_CHANGED,
                           fabricdrift.describe(node, found, react is fabricdrift.Reaction.RESTART))
        if settled and react is fabricdrift.Reaction.RESTART:
            nodes = ", ".join(settled)
            self._offer(Request(Action.RESTART, f"the fabric of {nodes} changed", source="fabric", drain=True))

    def _watch_own_pause(self, now: float, lease: float) -> None:
        """A gap between two checks is the coordinator's own pause (frozen, stopped, starved,
        suspended), not the nodes' silence: leases count again from its end, and it is told once,
        when every node has answered since or a lease has gone by."""
        tick = liveness.Tick(now, self._boottime())
        length = liveness.paused_for(self._last_check, tick, lease)
        if length is not None and self._last_check is not None:
            if self._pause is not None:  # paused again before the last one was told
                self._tell_pause(self._pause, self._after_pause(now, lease), now, lease)
            # the boots as before it: a heartbeat from a new boot may have been applied just before this check
            self._pause = liveness.Pause(self._last_check.monotonic, now, length, self._checked_boots)
            self._first_after = {}
            self._resumed_at = now
        self._last_check, self._checked_boots = tick, dict(self._boots)
        if self._pause is not None and (after := self._after_pause(now, lease)).over:
            self._tell_pause(self._pause, after, now, lease)

    def _after_pause(self, now: float, lease: float) -> liveness.AfterPause:
        return liveness.after_pause(self._pause, self._heard, self._first_after, list(self.clients), now, lease)

    def _tell_pause(self, pause: liveness.Pause, after: liveness.AfterPause, now: float, lease: float) -> None:
        self._pause = None
        began = time.strftime("%H:%M:%S", time.localtime(self._clock() - (now - pause.resumed_at) - pause.length_s))
        message = (f"the coordinator did not run for {pause.length_s:.1f} s (from {began}: frozen, stopped, starved "
                   f"or suspended); leases were counted again from its end")
        if after.answered:
            message += (f"; {', '.join(after.answered)} answered within {now - pause.resumed_at:.1f} s "
                        "in the same boot: kept")
        if after.rebooted:
            message += f"; {', '.join(after.rebooted)} booted again"
        if after.silent:
            message += f"; {', '.join(after.silent)} did not answer within NODE_LEASE_S={lease:g} s of it"
        self._log.warning("coordinator_paused", message, paused_s=round(pause.length_s, 3),
                          answered=",".join(after.answered), rebooted=",".join(after.rebooted),
                          silent=",".join(after.silent), answered_within_s=round(now - pause.resumed_at, 3))

    def _pump(self, seconds: float, until: Future | None = None, react: bool = True) -> None:
        """Waits `seconds` (or until `until` is done) applying inbox messages; raises Preempted when
        a request cancels the current activity, StepFailed when a rank exit fails the bring-up."""
        end = self._monotonic() + seconds
        while True:
            request = self._peek_request()
            if react and policy.preempts(request, self._activity):
                raise Preempted(request)
            if until is not None and until.done():
                return
            left = end - self._monotonic()
            try:
                # Past the end, only what is already there: _pump(0) drains the inbox without waiting.
                message = self._inbox.get(timeout=min(left, TICK_S)) if left > 0 else self._inbox.get_nowait()
            except queue.Empty:
                self._check_liveness(react)
                if left <= 0:
                    return
                continue
            self._apply(message, react)
            self._check_liveness(react)

    def _settle(self) -> None:
        self._pump(SETTLE_S, react=False)

    def _wait(self, seconds: float) -> None:
        self._pump(seconds)

    def _call(self, fn: Callable[[], Any], to_end: bool = False) -> Any:
        """fn() on a helper thread while the supervisor keeps applying its inbox. A call that changes
        a node (to_end) is waited for even when cancelled, before Preempted or StepFailed is raised."""
        future = spawn(fn, name="supervisor-call", on_done=lambda: self._inbox.put(Wake()))
        try:
            while not future.done():
                self._pump(3600.0, until=future)
        except (Preempted, StepFailed):
            if to_end:
                try:
                    future.result()
                except Exception:  # noqa: BLE001 - its outcome no longer matters; the cancellation does
                    pass
            raise
        return future.result()

    def _context(self, step: str) -> StepContext:
        return StepContext(step, self.cfg, self.clients, self._log, self._bring, wait=self._wait, call=self._call,
                           monotonic=self._monotonic, set_detail=lambda detail: self._set(detail=detail),
                           record_rank=self._record_rank, state_dir=self._state_dir, table_dir=self._table_dir,
                           api_key=self._api_key, base_url=self.base_url)

    # ------------------------------------------------------------------ bring-up

    def _bring_up_with_retries(self, reset_attempts: bool = False, first_cause: str | None = None) -> None:
        snap = self._set(restart_attempt=0) if reset_attempts else self.snapshot()
        attempts = policy.attempts_so_far(snap.restart_attempt, snap.serving_since, self._clock())
        cause = first_cause
        waited = False  # the last try stopped for an unreachable node: trying again spends no attempt
        while True:
            if cause is not None and not waited:
                max_attempts = self.cfg.integer("RESTART_MAX_ATTEMPTS")
                restart = policy.next_restart(attempts, max_attempts, self.cfg.number("RESTART_BACKOFF_S"))
                if restart.give_up:
                    self._set(phase=Phase.FAILED, restart_attempt=attempts,
                              detail=f"{cause} (gave up after {max_attempts} restart attempt(s))")
                    self._log.error("restart_exhausted", f"not restarting again: {cause}", attempts=max_attempts)
                    return
                attempts = restart.attempt
                self._set(phase=Phase.RESTARTING, restart_attempt=attempts,
                          detail=f"attempt {attempts}/{max_attempts} in {restart.delay_s:g} s after: {cause}")
                self._log.warning("restart_attempt", f"restart attempt {attempts}/{max_attempts} in "
                                  f"{restart.delay_s:g} s: {cause}", attempt=attempts, delay_s=restart.delay_s)
                self._activity = Activity.BACKOFF
                self._pump(restart.delay_s)
            waited = False
            try:
                self._bring_up()
                return
            except StepFailed as exc:
                self._activity = Activity.IDLE
                if self._bring.collective is not None:  # the gate's figures, the failing ones too
                    self._set(collective=self._bring.collective)
                if exc.incident is None and not exc.unreachable:
                    self._incident(exc.node or "cluster", step_failed(exc.step), exc.reason)
                elif exc.incident:
                    self._incident(exc.node or "cluster", exc.incident, exc.reason)
                step = bringup.BY_NAME.get(exc.step)
                ranks_ran = self._ranks_run
                self._stop_ranks(f"bring-up failed at {exc.step}", final_phase=None,
                                 wait_memory=ranks_ran and not exc.unreachable)
                if exc.unreachable:
                    if not self._wait_for_nodes(exc.unreachable, exc):
                        return  # NODE_WAIT_TIMEOUT_S passed: failed, and the phase says why
                    waited = True
                    continue
                self._set(phase=Phase.FAILED, detail=str(exc))
                if self._rollout is not None:
                    self._roll_back(f"the bring-up failed at {exc.step}: {exc.reason}", exc.node or "cluster")
                    return
                if not policy.retry_can_fix(step.retryable if step else False, exc.transient):
                    return  # a restart cannot fix configuration or a node that is not ready
                cause = str(exc)

    def _wait_for_nodes(self, nodes: tuple[str, ...], why: StepFailed) -> bool:
        """Phase `waiting` until every one of these nodes' agents answers again (a heartbeat on its
        stream, or a status call), without spending restart attempts; NODE_WAIT_TIMEOUT_S (0: no
        limit) fails it with the reason it was waited for."""
        self._activity = Activity.WAITING
        started = self._monotonic()
        limit = self.cfg.integer("NODE_WAIT_TIMEOUT_S")
        names = ", ".join(nodes)
        self._set(phase=Phase.WAITING, detail=f"waiting for {names}: {why.reason}; the bring-up resumes when "
                                          f"{'its agent answers' if len(nodes) == 1 else 'their agents answer'}")
        self._log.warning("node_waiting", f"waiting for {names} ({why.reason}); the bring-up resumes when "
                          "it answers" + (f", for up to {limit:g} s" if limit else ""), node_name=nodes[0])
        pending = list(nodes)
        while pending:
            self._pump(WAIT_POLL_S)
            heard = [n for n in pending if n in self._heard and self._heard[n].at > started]
            ask = [n for n in pending if n not in heard]
            answers = self._call(lambda: on_each(lambda n: self.clients[n].status(timeout=2.0), ask,
                                                 catch=(AgentUnavailable,))) if ask else {}
            pending = [n for n in ask if isinstance(answers.get(n), AgentUnavailable)]
            if pending and limit and self._monotonic() - started > limit:
                self._activity = Activity.IDLE
                failed = StepFailed(why.step, pending[0], f"{why.reason} (still unreachable after {limit:g} s)")
                self._incident(pending[0], step_failed(why.step), failed.reason)
                self._set(phase=Phase.FAILED, detail=str(failed))
                return False
        self._activity = Activity.IDLE
        self._log.info("node_answers", f"{names}: answering again after {self._monotonic() - started:.1f} s; "
                       "bringing the cluster up", node_name=nodes[0])
        return True

    def _bring_up(self) -> None:
        self._react_to_drift(self._drift.take_all())  # its fabric step checks what changed
        self._bring = BringUp()
        self._exits.clear()
        self._ranks_run = False
        with self._request_lock:  # a start that waited is this bring-up: it must not run a second one
            if self._pending is not None and self._pending.action is Action.START:
                self._pending = None
        for step in bringup.STEPS:
            if step.skip(self.cfg):
                if step.skip_warning[0]:
                    self._log.warning(step.skip_warning[0], step.skip_warning[1], step=step.name)
                continue
            self._activity = Activity.BRINGUP
            self._pump(0)  # a stop (or an exit) that came meanwhile is served before the step begins
            self._step = step.name
            if step.name == bringup.RANKS_RUN_FROM:
                self._ranks_run = True
                self._set(ranks_since=self._clock())  # the memory guard watches from here on
            self._set(phase=step.name, detail="")
            deadline = self.cfg.integer(step.deadline_key)
            started = self._monotonic()
            self._log.info("step_started", f"bring-up: {step.name}", step=step.name)
            step.run(self._context(step.name), deadline)
            took = self._monotonic() - started
            self._log.info("step_done", f"bring-up: {step.name} done in {took:.2f} s", step=step.name,
                           duration_s=round(took, 3))
            if self._bring.generation:
                self._set(generation=self._bring.generation, fabric=dict(self._bring.fabric),
                          fingerprints={p.node: p.fingerprint for p in self._bring.plans})
            if self._bring.collective is not None:
                self._set(collective=self._bring.collective)
        self._pump(0)  # an exit or a stop that came with the last answer
        self._activity = Activity.IDLE
        ranks = len(self._bring.plans)
        self._set(phase=Phase.SERVING, detail=f"serving on :{self.cfg.integer('PORT')}, {ranks}/{ranks} ranks",
                  serving_since=self._clock())
        self._log.info("serving", f"cluster serving at {self.base_url} ({ranks}/{ranks} ranks, generation "
                       f"{self.snapshot().generation})", generation=self.snapshot().generation)

    # ------------------------------------------------------------------ recovery and stop

    def _recover(self, trouble: Trouble) -> None:
        """The serving TP group is broken (a rank exited, a node was lost or booted again, a rank
        hung): record the first cause, stop it all, then bring it up again (waiting, in preflight,
        for a node that does not answer)."""
        served_since = self.snapshot().serving_since  # before the stop below clears it
        if trouble.kind is IncidentKind.RANK_EXIT:
            first = self._exits[trouble.node]
            self._set(phase=Phase.STOPPING, detail=f"rank on {first.node} exited: {first.describe()}")
            cause = self._blame_exits()
        else:
            self._set(phase=Phase.STOPPING, detail=trouble.message)
            cause = liveness.Cause(trouble.node, trouble.kind, trouble.message)
        if trouble.kind is not IncidentKind.NODE_REBOOTED:  # recorded when the new boot was seen
            self._incident(cause.node, cause.kind, cause.message)
        text = (f"rank on {cause.node} exited: {self._exits[cause.node].describe()}"
                if cause.kind in (IncidentKind.RANK_EXIT, IncidentKind.MEMORY_FLOOR)
                else cause.message.split("; then ")[0])
        # The group is broken: what is in flight cannot finish, and rank 0 would drain for the whole
        # RANK_STOP_TIMEOUT_S (seen on real SGLang with a worker's scheduler stopped) before its kill.
        self._stop_ranks(f"recovering: {text}", wait_memory=True, drain=False)
        # A node lost or booted again is not the group failing by itself: the bring-up after it spends
        # no restart attempt (it waits for the node instead); a rank that crashed or hung does.
        external = cause.kind in (IncidentKind.NODE_LOST, IncidentKind.NODE_REBOOTED)
        if self._rollout is not None and not external:  # a node going dark is not the change's doing
            self._roll_back(f"{text}, {self._clock() - served_since:.0f} s after serving",
                            cause.node)
            return
        self._log.info("recovering", f"bringing the cluster up again after: {text}"
                       + (" (no restart attempt spent)" if external else ""), cause=cause.kind, node_name=cause.node)
        self._bring_up_with_retries(first_cause=None if external else text)

    def _roll_back(self, why: str, node: str) -> None:
        rollout, self._rollout = self._rollout, None
        keys = ", ".join(rollout.keys)
        message = f"the configuration change of {keys} failed: {why}; bringing the configuration before it back"
        self._incident(node, IncidentKind.ROLLED_BACK, message)
        self._set(phase=Phase.FAILED, detail=message)
        rollout.roll_back(why)

    def _confirm_rollout(self) -> None:
        """A change that has served for its confirmation time is kept: a later fault is recovered from."""
        snap = self.snapshot()
        if (self._rollout is not None and snap.phase == Phase.SERVING
                and self._clock() - snap.serving_since >= self._rollout.confirm_s):
            keys = ", ".join(self._rollout.keys)
            self._log.info("config_confirmed", f"the configuration change of {keys} has served for "
                           f"{self._rollout.confirm_s:g} s: kept", keys=keys)
            self._rollout = None

    def _blame_exits(self) -> liveness.Cause:
        """Who caused the exits: wait for the others to follow (SETTLE_S), and for every node that
        has not exited to answer (its stream, or a status call); one that does not within its lease
        went dark, and ranks before the exits that followed it."""
        since = self._monotonic()
        self._settle()
        self._wait_for_the_cause()
        lease = self.cfg.number("NODE_LEASE_S")
        quiet = liveness.unaccounted(list(self.clients), self._exits, self._heard, since)
        if quiet:
            answers = self._call(lambda: on_each(lambda n: self.clients[n].status(timeout=lease), quiet,
                                                 catch=(AgentUnavailable,)))
            quiet = [n for n in quiet if isinstance(answers[n], AgentUnavailable)
                     and liveness.unaccounted([n], self._exits, self._heard, since)]
        lost = {n: (self._heard[n].at if n in self._heard else self._watching_since) for n in quiet}
        for node in lost:
            self._lost.setdefault(node, lost[node])
        return liveness.blame(self._with_engine_evidence(list(self._exits.values())), lost, self._monotonic())

    def _wait_for_the_cause(self) -> None:
        """When every exit so far is a rank whose engine said a peer went away, waits up to
        CAUSE_WAIT_S for another node's exit: blaming one of those would name a follower."""
        seen = len(self._exits)
        if not seen or seen == len(self.clients):
            return
        if not all(e.peer_failure for e in self._with_engine_evidence(list(self._exits.values()))):
            return
        end = self._monotonic() + CAUSE_WAIT_S
        while len(self._exits) == seen and self._monotonic() < end:
            self._pump(min(0.25, max(0.0, end - self._monotonic())), react=False)
        if len(self._exits) > seen:
            self._settle()  # and any that follow it

    def _with_engine_evidence(self, exits: list[RankExit]) -> list[RankExit]:
        """Each exit with what its rank's own output said about a peer (peerfailure.py), read from
        its journal around its loss; a node whose journal cannot be read gives none."""
        lost_at = {e.node: e.lost_at_unix_s for e in exits}

        def said(node: str) -> str:
            lines = self.clients[node].recent_journal(EVIDENCE_LINES, (RANK_UNIT,), timeout=EVIDENCE_TIMEOUT_S)
            return peer_failure(line.message for line in lines
                                if abs(line.at_unix_s - lost_at[node]) <= EVIDENCE_WINDOW_S)
        found = self._call(lambda: on_each(said, lost_at, catch=(AgentUnavailable,)))
        return [replace(e, peer_failure=found[e.node]) if isinstance(found[e.node], str) else e for e in exits]

    def _stop_ranks(self, why: str, final_phase: Phase | None = Phase.STOPPED, wait_memory: bool = False,
                    drain: bool = True) -> None:
        """Rank 0 first (it drains, unless `drain` is False), then the workers; then confirm on every
        node that nothing is left."""
        self._activity = Activity.STOPPING
        self._set(phase=Phase.STOPPING, detail=why)
        deadline = self.cfg.integer("RANK_STOP_TIMEOUT_S")
        stopping.stop_ranks(self.clients, self.cfg.head.name,
                            deadline if drain else min(deadline, stopping.WORKER_STOP_GRACE_S), self._log,
                            call=self._call, lost=set(self._lost))
        self._activity = Activity.IDLE
        self._set(ranks_since=0.0)
        if final_phase:
            self._set(phase=final_phase, detail=why, serving_since=0.0)
        if wait_memory:  # only a restart stacks new ranks on the memory the old ones held
            self._activity = Activity.MEMORY_WAIT
            self._wait_memory_back()
            self._activity = Activity.IDLE

    def _wait_memory_back(self) -> None:
        """A restart must not stack a new rank on memory the old one has not returned yet."""
        need = int(self.cfg.number("RANK_MEMORY_GIB") * GIB)
        end = self._monotonic() + self.cfg.integer("MEMORY_RECOVERY_TIMEOUT_S")
        short = sorted(n for n in self.clients if n not in self._lost)  # a lost node is waited for in preflight
        while short and self._monotonic() < end:
            def available(node: str) -> int | None:
                try:
                    return self.clients[node].status().memory.available_bytes
                except AgentUnavailable:
                    return None
            answers = self._call(lambda nodes=tuple(short): {n: available(n) for n in nodes})
            short = policy.memory_short(answers, need)
            if short:
                self._pump(MEMORY_POLL_S)
        for node in short:
            self._log.warning("memory_not_back", f"{node}: available memory still below RANK_MEMORY_GIB after the "
                              "stop", node_name=node)

    # ------------------------------------------------------------------ adoption

    def _adopt(self) -> bool:
        """A restarted coordinator takes over ranks that run the current plans instead of restarting them."""
        ctx = self._context("adopt")
        statuses = adopt.read_statuses(ctx)
        if statuses is None:
            return False
        for node, exit_info in adopt.floor_stops(statuses):
            at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(exit_info.at_unix_s))
            self._incident(node, IncidentKind.MEMORY_FLOOR,
                           f"found at start: the node's memory floor stopped its rank at {at}"
                           + (f" ({exit_info.cause_detail})" if exit_info.cause_detail else ""))
        found = adopt.find_running(ctx, statuses)
        if found is None:
            return False
        self._bring = BringUp(plans=found.plans, generation=generation_of(found.plans), launched=found.launched)
        with self._lock:
            self._snapshot = replace(self._snapshot, ranks=dict(found.ranks), generation=self._bring.generation,
                                     fingerprints={p.node: p.fingerprint for p in found.plans})
        self._set(phase=Phase.HEALTH, detail="re-adopting running ranks", ranks_since=self._clock())
        if not adopt.answers(ctx):
            return False
        self._call(lambda: self._lift_stale_drain("no restart follows it"))
        ranks = len(found.plans)
        self._set(phase=Phase.SERVING,
                  detail=f"serving on :{self.cfg.integer('PORT')}, {ranks}/{ranks} ranks (re-adopted)",
                  serving_since=self._clock())
        self._log.info("adopted", f"re-adopted a serving cluster ({ranks} ranks, generation "
                       f"{self._bring.generation}) without restarting it")
        if self._exits:  # a rank that exited while rank 0 was being asked
            self._trouble = Trouble(IncidentKind.RANK_EXIT, next(iter(self._exits)))
        return True

    # ------------------------------------------------------------------ jobs

    def _run_job(self, job) -> None:
        if not job.reply.set_running_or_notify_cancel():
            return  # its caller stopped waiting
        try:
            if isinstance(job, UnexportJob):
                result = unexport_mod.unexport(self.clients, self.cfg.head.name, self._log, self.snapshot().phase,
                                               self._incident, job.force, job.unmount)
            elif isinstance(job, PackStartJob):
                result = self._start_packs()
            elif isinstance(job, FabricTestJob):
                result = self._fabric_test()
            else:
                result = self._reset_autotune()
        except Exception as exc:  # the operator gets the error; the cluster's phase is untouched
            if not isinstance(exc, AgentUnavailable):
                self._log.error("job_error", f"{type(job).__name__} failed unexpectedly: {exc!r}")
            job.reply.set_exception(exc)
            return
        job.reply.set_result(result)

    def _fabric_test(self) -> tuple[bool, str]:
        phase = self.snapshot().phase
        if phase not in (Phase.STOPPED, Phase.FAILED):
            return False, (f"refused in phase {phase}: the test needs the ranks' rendezvous port and GPUs; run it "
                           "with the cluster stopped (dsv41ctl stop)")
        plans = plan_mod.render_cluster(self.cfg)
        ctx = StepContext("collective", self.cfg, self.clients, self._log,
                          BringUp(plans=plans, generation=generation_of(plans)), wait=lambda seconds: None,
                          call=lambda fn, to_end=False: fn(), monotonic=self._monotonic, set_detail=lambda d: None)
        passed, message = bringup.collective.on_demand(ctx, self.cfg.integer("COLLECTIVE_TIMEOUT_S"))
        if ctx.bring.collective is not None:
            self._set(collective=ctx.bring.collective)
        return passed, message

    def _start_packs(self) -> list[str]:
        started = []
        for node_plan in plan_mod.render_cluster(self.cfg):
            client = self.clients[node_plan.node]
            if incomplete(client.pack_state(node_plan)):
                client.start_pack(node_plan)
                started.append(node_plan.node)
        return started

    def _reset_autotune(self) -> tuple[bool, str]:
        removed, problems = 0, []
        for node, client in self.clients.items():
            try:
                removed += client.clear_caches("autotune").removed_files
            except AgentUnavailable as exc:
                problems.append(f"{node}: {exc.details}")
        if problems:
            return False, "; ".join(problems)
        return True, (f"removed {removed} autotune cache file(s) on {len(self.clients)} nodes: the next boot "
                      "retunes")
