"""A clock that moves only when a test advances it, for code that takes its clocks as arguments."""

from __future__ import annotations

import threading
from typing import Callable

EPOCH = 1_796_000_000.0  # time() at monotonic() == 0: 2026-12-01, a fixed wall time


class FakeClock:
    """monotonic() stands still until advance(); time() is EPOCH plus it. Listeners run on every
    advance, in the advancing thread, after the time has moved (fake components that act on time:
    an agent's heartbeats); threads of fake components wait for it with wait()."""

    def __init__(self, start: float = 1000.0):
        self._now = start
        self._moved = threading.Condition()
        self._listeners: list[Callable[[float], None]] = []

    def monotonic(self) -> float:
        with self._moved:
            return self._now

    def time(self) -> float:
        return EPOCH + self.monotonic()

    def on_advance(self, listener: Callable[[float], None]) -> None:
        self._listeners.append(listener)

    def advance(self, seconds: float) -> float:
        with self._moved:
            self._now += seconds
            now = self._now
            self._moved.notify_all()
        for listener in list(self._listeners):
            listener(now)
        return now

    def wait(self, real_s: float) -> None:
        """Returns when the clock moves, or after real_s of real time (to see other changes)."""
        with self._moved:
            self._moved.wait(real_s)
