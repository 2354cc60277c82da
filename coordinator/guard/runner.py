"""The memory guard at work: one thread per node reads its agent's memory stream, the policy
decides, the decision is carried out on rank 0 (POST /abort_request) or on the cluster (a clean
stop), and every action is one journal event (one per aborted request).

Streams run while ranks run: from `launch` through `health` and `smoke` to `serving` (there, what
cannot be aborted is stopped: the model load, the first forward's compilation and the warm-up are
guarded too) and `stopping` (rank 0 drains what is in flight for up to RANK_STOP_TIMEOUT_S: a
prefill that grows meanwhile is aborted like one served; a stop is not asked twice); each run of
the ranks (a bring-up, a re-adoption) starts with a fresh policy. After an abort a checker reads
the in-flight list every CONFIRM_POLL_S until the victims are gone (or overdue), journals which,
and sends an abort that had to wait for them. While serving, with a cost model, a looker reads it
every LOOK_S: a request that arrives and waits moves no memory, so no sample shows it, and one
that cannot fit is aborted before it starts (Guard.look). The guard never restarts anything itself: a stop
goes through the runtime's own supervisor like an operator's, so it cannot race the restart logic.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import grpc

from dsv41.journal import EventLog

from ..state import Phase
from .engine import EngineApi
from .events import confirmation_events, events_of
from .kinds import ACTIONS, Kind
from .policy import Guard
from .poolfit import pool_fit
from .settings import GuardSettings, log_fields
from .state import Decision

CONFIRM_POLL_S = 0.05
LOOK_S = 0.2  # the in-flight list read between samples while serving


class MemorySource(Protocol):
    node: str

    def watch_memory(self, interval_ms: int, psi_trigger: bool = True, min_change_bytes: int = 0,
                     heartbeat_ms: int = 0, replay_samples: int = 0, follow_samples: int = 0) -> Iterator: ...


@dataclass
class _Session:
    """One run of the ranks: its policy, its streams, its readers."""
    key: float
    guard: Guard
    serving: bool = False
    stopped: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    streams: dict = field(default_factory=dict)
    threads: list = field(default_factory=list)
    checker: threading.Thread | None = None
    pool_checked: set = field(default_factory=set)  # the nodes whose KV pool was checked against the guard


@dataclass
class GuardStats:
    samples: int = 0
    actions: int = 0
    failures: int = 0


class MemoryGuard:
    def __init__(self, settings: GuardSettings, sources: dict[str, MemorySource], engine: EngineApi, log: EventLog,
                 guarded: Callable[[], tuple[float, bool] | None], stop_cluster: Callable[[str], None],
                 monotonic: Callable[[], float] = time.monotonic, poll_s: float = 0.2,
                 stopping: Callable[[], bool] = lambda: False):
        """`guarded()` returns (a key of the current run of the ranks, e.g. when it began; whether the
        cluster serves) or None when no rank runs; `stop_cluster(reason)` asks for a clean stop;
        `stopping()` says whether one is under way already (then a stop is not asked again)."""
        if settings.mode == "off":
            raise ValueError("the memory guard is off (MEMORY_GUARD=off): nothing to run")
        self.settings = settings
        self._sources = sources
        self._engine = engine
        self._log = log
        self._guarded = guarded
        self._stop_cluster = stop_cluster
        self._stopping = stopping
        self._monotonic = monotonic
        self._poll_s = poll_s
        self._done = threading.Event()
        self._session: _Session | None = None
        self._thread = threading.Thread(target=self._supervise, name="memory-guard", daemon=True)
        self.stats = GuardStats()
        self._sample_listeners: list[Callable[[str, int], None]] = []

    def on_sample(self, listener: Callable[[str, int], None]) -> None:
        """listener(node, available_bytes) for every sample the guard reads (from its reader threads:
        it must be quick; the metrics keep the lowest)."""
        self._sample_listeners.append(listener)

    @classmethod
    def for_runtime(cls, runtime, log: EventLog, api_key: str | None = None) -> MemoryGuard | None:
        """The guard of a coordinator.runtime.ClusterRuntime; None when MEMORY_GUARD=off."""
        from .settings import from_config
        settings = from_config(runtime.cfg)
        if settings.mode == "off":
            log.warning("memory_guard_off", "memory guard off (MEMORY_GUARD=off): a runaway prefill can exhaust "
                        "a node's memory")
            return None
        return cls(settings, dict(runtime.clients), EngineApi(runtime.base_url, api_key), log, runtime.guarded_run,
                   lambda reason: runtime.request("stop", reason=f"memory guard: {reason}"),
                   stopping=lambda: runtime.snapshot().phase == Phase.STOPPING)

    # -- lifecycle

    def start(self) -> None:
        s = self.settings
        self._log.info("memory_guard_started", f"memory guard {s.mode}: keeps {s.guard_bytes / 1e9:.3f} GB available "
                       f"on {len(self._sources)} nodes, sampling every {s.interval_ms} ms (sent on a change of "
                       f"{s.send_change_bytes / 2**20:g} MiB or every {s.heartbeat_ms} ms), acting {s.lead_s:g} s "
                       "ahead of the predicted crossing", **log_fields(s))  # every setting, as DSV41_* fields
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(5.0)
        self._end_session()
        self._engine.close()

    def threads(self) -> list[threading.Thread]:
        """The guard's own threads (for measuring what it costs)."""
        session = self._session
        return [self._thread] + (list(session.threads) if session else [])

    # -- runs of the ranks

    def _phase(self) -> tuple[float, bool] | None:
        try:
            return self._guarded()
        except Exception as exc:  # the runtime's snapshot must not kill the guard
            self._log.warning("memory_guard_error", f"memory guard cannot read the cluster phase: {exc!r}")
            return None

    def _supervise(self) -> None:
        while not self._done.is_set():
            found = self._phase()
            key = found[0] if found else None
            current = self._session.key if self._session else None
            if key != current:
                self._end_session()
                if key is not None:
                    self._begin_session(key, found[1])
            if found and self._session is not None:
                self._session.serving = found[1]
            self._done.wait(self._poll_s)
        self._end_session()

    def _begin_session(self, key: float, serving: bool) -> None:
        session = _Session(key, Guard(self.settings), serving)
        for node, source in self._sources.items():
            thread = threading.Thread(target=self._read, args=(session, node, source), name=f"guard-{node}",
                                      daemon=True)
            session.threads.append(thread)
        if self.settings.cost.configured:
            session.threads.append(threading.Thread(target=self._look, args=(session,), name="guard-look",
                                                    daemon=True))
        self._session = session
        for thread in session.threads:
            thread.start()

    def _end_session(self) -> None:
        session, self._session = self._session, None
        if session is None:
            return
        session.stopped.set()
        for stream in list(session.streams.values()):
            stream.cancel()
        for thread in session.threads + ([session.checker] if session.checker else []):
            if thread is not threading.current_thread():
                thread.join(2.0)

    # -- reading

    def _read(self, session: _Session, node: str, source: MemorySource) -> None:
        lost = False
        while not session.stopped.is_set():
            try:
                stream = source.watch_memory(self.settings.interval_ms, psi_trigger=True,
                                             **self.settings.send_request())
                session.streams[node] = stream
                if session.stopped.is_set():
                    stream.cancel()
                    break
                for sample in stream:
                    if lost:
                        self._log.info("memory_guard_stream_back", f"memory guard: {node}'s memory stream is back",
                                       node_name=node)
                        lost = False
                    self._on_sample(session, node, sample)
            except grpc.RpcError as exc:
                if session.stopped.is_set():
                    break
                if not lost:
                    self._log.warning("memory_guard_stream_lost", f"memory guard: lost {node}'s memory stream "
                                      f"({exc.code().name}: {exc.details()}); reconnecting", node_name=node)
                    lost = True
            except Exception as exc:  # a bug in one sample must not end the guard on that node
                self._log.error("memory_guard_error", f"memory guard on {node}: {exc!r}", node_name=node)
            session.stopped.wait(1.0)

    def _on_sample(self, session: _Session, node: str, sample) -> None:
        with session.lock:
            if session.stopped.is_set():
                return
            for listener in self._sample_listeners:
                listener(node, int(sample.available_bytes))
            if session.serving and node not in session.pool_checked:
                session.pool_checked.add(node)
                misfit = pool_fit(node, int(sample.available_bytes), self.settings.guard_bytes, self.settings.cost,
                                  self.settings.context_tokens)
                if misfit is not None:
                    self._log.warning("kv_pool_too_large", misfit.message(), node_name=node,
                                      kv_pool_tokens=misfit.pool_tokens, kv_pool_bytes=misfit.pool_bytes,
                                      room_bytes=misfit.room_bytes, kv_pool_fits_tokens=misfit.fits_tokens)
            d = session.guard.observe(node, sample.at_monotonic_s, int(sample.available_bytes), self._monotonic(),
                                      self._engine.inflight, serving=session.serving)
            self._carry_out(session, d)
            self.stats.samples += 1  # counted once decided and carried out: a test may wait for it

    def _look(self, session: _Session) -> None:
        while not session.stopped.wait(LOOK_S):
            if not session.serving:
                continue
            try:
                listing = self._engine.inflight()
                with session.lock:
                    if session.stopped.is_set():
                        return
                    self._carry_out(session, session.guard.look(listing, self._monotonic(), serving=True))
            except Exception as exc:  # a bug in one look must not end the looks
                self._log.error("memory_guard_error", f"memory guard's look: {exc!r}")

    def _carry_out(self, session: _Session, d: Decision) -> None:
        """Under the session's lock."""
        if d.kind in ACTIONS:
            self._execute(session, d)
        elif d.kind in (Kind.REARM, Kind.HOLD):
            self._emit(d)
        if self.settings.mode != "observe" and session.guard.state.aborts.pending and \
                (session.checker is None or not session.checker.is_alive()):
            session.checker = threading.Thread(target=self._check_aborts, args=(session,), name="guard-confirm",
                                               daemon=True)
            session.checker.start()

    def _check_aborts(self, session: _Session) -> None:
        """Reads the in-flight list until the aborts sent are seen gone, or past their deadline."""
        while not session.stopped.wait(CONFIRM_POLL_S):
            with session.lock:
                asked = tuple(session.guard.state.aborts.pending)  # a victim chosen meanwhile is judged by the next look
            listing = self._engine.inflight()
            with session.lock:
                if session.stopped.is_set():
                    return
                guard = session.guard
                since = self._monotonic() - guard.state.aborts.pending_since
                seen, queued = guard.note_listing(listing, self._monotonic(), asked=asked)
                for e in confirmation_events(guard.acting_node(), seen.gone, seen.still, since):
                    self._log.event(e.kind, e.message, e.priority, **e.fields)
                if queued is not None:
                    self._execute(session, queued)
                if not guard.state.aborts.pending or guard.state.aborts.overdue_reported:
                    return

    def _execute(self, session: _Session, d: Decision) -> None:
        self.stats.actions += 1
        if self.settings.mode == "observe":
            self._emit(d)
            return
        found = self._phase()
        if found is None or found[0] != session.key:
            self._emit(d, "not carried out: the ranks stopped meanwhile")
            return
        if d.kind == Kind.STOP and self._stopping():
            # Asked again, it would be served after this stop (and undo a restart's bring-up).
            self._emit(d, "not carried out: the cluster is stopping already")
            return
        if d.kind == Kind.STOP:
            # Logged before the request: the stop is the supervisor's, asynchronous, and its own events
            # (and the phase `stopped`) must follow the guard's reason for it, never precede it.
            self._emit(d)
        try:
            if d.kind == Kind.ABORT:
                for victim in d.victims:
                    self._engine.abort(victim.request.rid)
            elif d.kind == Kind.ABORT_ALL:
                self._engine.abort(None)
            elif d.kind == Kind.STOP:
                self._stop_cluster(d.reason)
        except Exception as exc:  # an engine error, a refused stop: reported, and the guard goes on
            self.stats.failures += 1
            self._emit(d, f"failed: {exc}")
            return
        if d.kind != Kind.STOP:
            self._emit(d)

    def _emit(self, d: Decision, outcome: str = "") -> None:
        for e in events_of(d, self.settings.mode, outcome):
            self._log.event(e.kind, e.message, e.priority, **e.fields)
