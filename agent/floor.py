"""The node's last line: the agent stops its own rank before the node runs out of memory.

On GB10 host RAM is GPU memory: a node that runs out hangs until it is power-cycled, and a head
too wedged to run the coordinator cannot be saved by the coordinator's guard. So every agent
watches its own node while its rank unit runs, from the start (the model load included), with
nothing on the network in the loop: when available memory (the sampler's: the tighter of
MemAvailable and the node cgroup's headroom) goes below the floor the rank was started with
(MEMORY_FLOOR_GB, below the coordinator's guard), it sends SIGTERM to every process of the rank
unit (the scheduler children of SGLang have no handler and end at once; rank 0's launcher logs
and stops), then SIGKILL as soon as memory keeps falling, or when the deadline passes with the
unit still running (a worker's launcher only logs SIGTERM). In the host runtime the unit's cgroup
holds the server's processes. In the container runtime (RANK_RUNTIME=container, the default) it
holds the `docker run` client, and the server runs in the container's cgroup: each signal goes
also to every process of the container, found by the id the client wrote to its --cidfile
(agent/container.py), so the schedulers doing the load end on the SIGTERM as they do on the host.
The exit it causes carries cause memory_floor, which a coordinator running that rank records as an
incident naming the node; the cause is the rank's stopping_cause only once its signal was sent.

A pass that fails (a corrupt meminfo line, a bug) is journalled once (memory_floor_failed) and the
floor goes on guarding; memory that cannot be read is journalled once per episode
(memory_floor_unreadable, then memory_floor_readable).

floor_step() decides (pure); NodeFloor samples and signals; FloorJournal writes its journal lines
off the sampling thread, so a slow journal never delays a SIGKILL.
"""

from __future__ import annotations

import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, TextIO

from .memory import MeminfoInvalid
from .rank import MEMORY_FLOOR
from .rankspec import FloorSpec

WATCHING, TERMINATED, KILLED = "watching", "terminated", "killed"
TERM, KILL = "sigterm", "sigkill"
MAX_FALL_BAND = 32 << 20


@dataclass(frozen=True)
class FloorState:
    phase: str = WATCHING
    termed_at: float = 0.0
    termed_level: int = 0


def fall_band(spec: FloorSpec) -> int:
    """How much further memory must fall after SIGTERM to count as still falling: a quarter of
    the floor, 32 MiB at most (sampling noise is far below either)."""
    return min(MAX_FALL_BAND, spec.floor_bytes // 4)


def floor_step(spec: FloorSpec, state: FloorState, available: int, now: float) -> tuple[str | None, FloorState]:
    """The signal to send now (TERM, KILL or None) for one sample of the node's available memory."""
    if state.phase == WATCHING:
        if available < spec.floor_bytes:
            return TERM, FloorState(TERMINATED, now, available)
        return None, state
    if state.phase == TERMINATED:
        if available < state.termed_level - fall_band(spec) or now - state.termed_at >= spec.kill_after_s:
            return KILL, replace(state, phase=KILLED)
    return None, state


class FloorJournal:
    """The floor's journal lines, written from a thread of their own: a journal that is slow or
    failing never delays the floor's next sample (the SIGKILL decision after a SIGTERM)."""

    def __init__(self, events, stream: TextIO | None = None):
        self._events = events
        self._stream = stream
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="memory-floor-journal", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def write(self, priority: str, kind: str, message: str, **fields: object) -> None:
        self._queue.put((priority, kind, message, fields))

    def close(self, timeout_s: float = 2.0) -> None:
        """Writes what is queued (for at most timeout_s), then ends the thread."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            priority, kind, message, fields = item
            try:
                self._events.event(kind, message, priority, **fields)
            except Exception as exc:  # the journal itself failed: stderr is all that is left
                print(f"<3>memory floor: cannot journal {kind} ({message}): {exc!r}", file=self._stream or sys.stderr,
                      flush=True)


class NodeFloor:
    """One thread: while the rank unit runs, samples every spec.interval_s and acts on floor_step."""

    def __init__(self, rank, sampler, kill: Callable[[int], str | None], events, node: str,
                 monotonic: Callable[[], float] = time.monotonic, idle_poll_s: float = 0.1,
                 retry_s: float = 1.0):
        """`rank` is the RankManager (its floor(), note_cause() and withdraw_cause()), `sampler` a
        MemorySampler of its own, `kill(signal)` signals every process of the rank (and may return
        a note for the journal line: what it signalled beside the unit), `events` an EventLog (its
        event()), written to from a thread of its own."""
        self._rank = rank
        self._sampler = sampler
        self._kill = kill
        self._journal = FloorJournal(events)
        self._node = node
        self._monotonic = monotonic
        self._idle_poll_s = idle_poll_s
        self._retry_s = retry_s  # the wait after a pass that could not read memory or failed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-floor", daemon=True)
        self.actions: list[tuple[str, str]] = []  # (signal, invocation) sent, for tests and the footprint bench

    def start(self) -> None:
        self._journal.start()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self._journal.close()

    def _run(self) -> None:
        watch = _Watch()
        while not self._stop.is_set():
            try:
                wait_s = self._pass(watch)
                watch.failure = ""
            except Exception as exc:  # a bug or a surprise (a corrupt meminfo line): journalled, still guarding
                self._failed(watch, exc)
                wait_s = self._retry_s
            self._stop.wait(wait_s)

    def _pass(self, watch: "_Watch") -> float:
        """One sample and what it decides; returns how long to wait before the next one."""
        invocation, spec = self._rank.floor()
        if not invocation or not spec.floor_bytes:
            watch.reset("")
            return self._idle_poll_s
        if invocation != watch.invocation:  # a new run of the rank: a new watch
            watch.reset(invocation)
        watch.floor_bytes = spec.floor_bytes
        try:
            available = self._sampler.sample(details=False).available
        except MeminfoInvalid as exc:
            if not watch.unreadable_since:
                watch.unreadable_since = self._monotonic()
                self._journal.write("warning", "memory_floor_unreadable", f"{self._node}: memory floor: cannot read "
                                    f"this node's memory ({exc}); last read {_gb(watch.last_available)}, "
                                    f"MEMORY_FLOOR_GB {_gb(spec.floor_bytes)}: tried again every "
                                    f"{self._retry_s:g} s", node_name=self._node,
                                    last_available_bytes=watch.last_available,
                                    floor_bytes=spec.floor_bytes, invocation=invocation)
            return self._retry_s
        if watch.unreadable_since:
            unreadable_s = self._monotonic() - watch.unreadable_since
            watch.unreadable_since = 0.0
            self._journal.write("info", "memory_floor_readable", f"{self._node}: memory floor: this node's memory "
                                f"reads again after {unreadable_s:.1f} s: available {_gb(available)}, "
                                f"MEMORY_FLOOR_GB {_gb(spec.floor_bytes)}", node_name=self._node,
                                available_bytes=available, floor_bytes=spec.floor_bytes,
                                unreadable_s=round(unreadable_s, 3), invocation=invocation)
        watch.last_available = available
        before = watch.state
        action, watch.state = floor_step(spec, watch.state, available, self._monotonic())
        if action is not None and not self._act(action, invocation, spec, watch, available):
            watch.state = before  # not sent: decided again on the next sample
        return spec.interval_s

    def _failed(self, watch: "_Watch", exc: Exception) -> None:
        """Journals a failure once for as long as the same one repeats."""
        what = f"{type(exc).__name__}: {exc}"
        if what == watch.failure:
            return
        watch.failure = what
        self._journal.write("err", "memory_floor_failed", f"{self._node}: memory floor: a pass failed ({what}); "
                            f"still guarding, tried again every {self._retry_s:g} s", node_name=self._node,
                            error=what, available_bytes=watch.last_available,
                            floor_bytes=watch.floor_bytes or None, invocation=watch.invocation or None)

    def _act(self, action: str, invocation: str, spec: FloorSpec, watch: "_Watch", available: int) -> bool:
        state = watch.state
        if action == TERM:
            detail = (f"available {_gb(available)} below MEMORY_FLOOR_GB {_gb(spec.floor_bytes)}: SIGTERM to every "
                      f"process of the rank, SIGKILL if memory keeps falling or after {spec.kill_after_s:g} s")
            signum = signal.SIGTERM
        else:
            fell = available < state.termed_level - fall_band(spec)
            detail = (f"available {_gb(state.termed_level)} below MEMORY_FLOOR_GB {_gb(spec.floor_bytes)}: SIGTERM; "
                      f"{'memory kept falling' if fell else 'the rank still ran'} "
                      f"{self._monotonic() - state.termed_at:.2f} s later (available {_gb(available)}): SIGKILL")
            signum = signal.SIGKILL
        # Held before the signal (the exit can be quick and its record must carry it), shown as the
        # run's stopping_cause only once the signal was sent.
        self._rank.note_cause(invocation, MEMORY_FLOOR, detail, publish=False)
        try:
            also = self._kill(signum) or ""
        except Exception as exc:  # a unit that is gone already, systemd busy: journalled, tried again next tick
            self._rank.withdraw_cause(invocation)
            what = f"{signum.name}: {type(exc).__name__}: {exc}"
            if what != watch.send_failure:
                watch.send_failure = what
                self._journal.write("err", "memory_floor_failed", f"{self._node}: memory floor: {signum.name} to "
                                    f"the rank failed: {exc} (available {_gb(available)}, MEMORY_FLOOR_GB "
                                    f"{_gb(spec.floor_bytes)}); tried again every sample", node_name=self._node,
                                    available_bytes=available, floor_bytes=spec.floor_bytes, signal=signum.name,
                                    error=str(exc), invocation=invocation)
            return False
        watch.send_failure = ""
        self._rank.note_cause(invocation, MEMORY_FLOOR, detail)
        self._journal.write("err", "memory_floor", f"{self._node}: memory floor: {detail}{also}", node_name=self._node,
                            available_bytes=available, floor_bytes=spec.floor_bytes, signal=signum.name,
                            invocation=invocation)
        self.actions.append((action, invocation))
        return True


class _Watch:
    """The floor thread's own state (one instance per thread, touched by it alone)."""

    def __init__(self) -> None:
        self.reset("")
        self.failure = ""  # the failure of a pass last journalled, "" after a pass that went well
        self.send_failure = ""  # the failure to signal last journalled, "" after a signal sent

    def reset(self, invocation: str) -> None:
        self.invocation = invocation
        self.state = FloorState()
        self.floor_bytes = 0
        self.last_available: int | None = None
        self.unreadable_since = 0.0


def _gb(n: int | None) -> str:
    return "unknown" if n is None else f"{n / 1e9:.3f} GB"
