"""The node's last line: the agent stops its own rank before the node runs out of memory.

On GB10 host RAM is GPU memory: a node that runs out hangs until it is power-cycled, and a head
too wedged to run the coordinator cannot be saved by the coordinator's guard. So every agent
watches its own node while its rank unit runs, from the start (the model load included), with
nothing on the network in the loop: when available memory (the sampler's: the tighter of
MemAvailable and the node cgroup's headroom) goes below the floor the rank was started with
(MEMORY_FLOOR_GB, below the coordinator's guard), it sends SIGTERM to every process of the rank
unit (the scheduler children of SGLang have no handler and end at once; rank 0's launcher logs
and stops), then SIGKILL as soon as memory keeps falling, or when the deadline passes with the
unit still running (a worker's launcher only logs SIGTERM). The exit it causes carries
cause memory_floor, which the coordinator records as an incident naming the node.

floor_step() decides (pure); NodeFloor samples, signals and journals.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable

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


class NodeFloor:
    """One thread: while the rank unit runs, samples every spec.interval_s and acts on floor_step."""

    def __init__(self, rank, sampler, kill: Callable[[int], None], events, node: str,
                 monotonic: Callable[[], float] = time.monotonic, idle_poll_s: float = 0.1):
        """`rank` is the RankManager (its floor() and note_cause()), `sampler` a MemorySampler of its
        own, `kill(signal)` signals every process of the rank unit."""
        self._rank = rank
        self._sampler = sampler
        self._kill = kill
        self._events = events
        self._node = node
        self._monotonic = monotonic
        self._idle_poll_s = idle_poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-floor", daemon=True)
        self.actions: list[tuple[str, str]] = []  # (signal, invocation) sent, for tests and the footprint bench

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2.0)

    def _run(self) -> None:
        watched, state = "", FloorState()
        while not self._stop.is_set():
            invocation, spec = self._rank.floor()
            if not invocation or not spec.floor_bytes:
                watched, state = "", FloorState()
                self._stop.wait(self._idle_poll_s)
                continue
            if invocation != watched:  # a new run of the rank: a new watch
                watched, state = invocation, FloorState()
            try:
                available = self._sampler.sample(details=False).available
            except MeminfoInvalid as exc:
                self._events.warning("memory_floor_unreadable", f"memory floor: cannot read this node's memory: {exc}")
                self._stop.wait(1.0)
                continue
            before = state
            action, state = floor_step(spec, state, available, self._monotonic())
            if action is not None and not self._act(action, invocation, spec, state, available):
                state = before  # not sent: decided again on the next sample
            self._stop.wait(spec.interval_s)

    def _act(self, action: str, invocation: str, spec: FloorSpec, state: FloorState, available: int) -> bool:
        gb = lambda n: f"{n / 1e9:.3f} GB"  # noqa: E731
        if action == TERM:
            detail = (f"available {gb(available)} below MEMORY_FLOOR_GB {gb(spec.floor_bytes)}: SIGTERM to every "
                      f"process of the rank, SIGKILL if memory keeps falling or after {spec.kill_after_s:g} s")
            signum = signal.SIGTERM
        else:
            fell = available < state.termed_level - fall_band(spec)
            detail = (f"available {gb(state.termed_level)} below MEMORY_FLOOR_GB {gb(spec.floor_bytes)}: SIGTERM; "
                      f"{'memory kept falling' if fell else 'the rank still ran'} "
                      f"{self._monotonic() - state.termed_at:.2f} s later (available {gb(available)}): SIGKILL")
            signum = signal.SIGKILL
        self._rank.note_cause(invocation, MEMORY_FLOOR, detail)  # before the signal: the exit can be quick
        try:
            self._kill(signum)
        except Exception as exc:  # a unit that is gone already, systemd busy: journalled, tried again next tick
            self._events.error("memory_floor_failed", f"{self._node}: memory floor: {signum.name} to the rank "
                               f"failed: {exc}", node_name=self._node)
            return False
        self._events.error("memory_floor", f"{self._node}: memory floor: {detail}", node_name=self._node,
                           available_bytes=available, floor_bytes=spec.floor_bytes, signal=signum.name,
                           invocation=invocation)
        self.actions.append((action, invocation))
        return True
