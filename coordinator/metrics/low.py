"""The lowest value seen over a sliding time window (a monotonic deque: O(1) amortised per value),
for the memory guard's margin, which moves at the guard's sampling rate (milliseconds) while a
scrape comes every few seconds."""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable


class WindowLow:
    def __init__(self, window_s: float, monotonic: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._values: collections.deque[tuple[float, float]] = collections.deque()  # increasing values

    def add(self, value: float) -> None:
        now = self._monotonic()
        with self._lock:
            while self._values and self._values[-1][1] >= value:
                self._values.pop()
            self._values.append((now, value))
            self._expire(now)

    def lowest(self) -> float | None:
        """The lowest value added within the window, or None when none was."""
        with self._lock:
            self._expire(self._monotonic())
            return self._values[0][1] if self._values else None

    def _expire(self, now: float) -> None:
        while self._values and self._values[0][0] < now - self.window_s:
            self._values.popleft()
