"""The agent's events: written to the journal and fanned out to WatchEvents subscribers."""

from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from dsv41.journal import EventLog


@dataclass(frozen=True)
class Event:
    at_unix_s: float
    kind: str
    priority: str
    message: str
    fields: dict[str, str]


class EventHub:
    """Same interface as EventLog; also keeps the last events and feeds subscribers' queues."""

    def __init__(self, log: EventLog, history: int = 256, clock: Callable[[], float] = time.time):
        self._log = log
        self._clock = clock
        self._lock = threading.Lock()
        self._history: collections.deque[Event] = collections.deque(maxlen=history)
        self._subscribers: list[queue.Queue] = []

    def event(self, kind: str, message: str, priority: str = "info", **fields: object) -> dict[str, str]:
        entry = self._log.event(kind, message, priority, **fields)
        event = Event(self._clock(), kind, priority, message, entry)
        with self._lock:
            self._history.append(event)
            subscribers = list(self._subscribers)
        for q in subscribers:
            try:
                q.put_nowait(event)
            except queue.Full:
                pass  # a subscriber that does not read loses events rather than the agent's memory
        return entry

    def info(self, kind: str, message: str, **fields: object) -> dict[str, str]:
        return self.event(kind, message, "info", **fields)

    def warning(self, kind: str, message: str, **fields: object) -> dict[str, str]:
        return self.event(kind, message, "warning", **fields)

    def error(self, kind: str, message: str, **fields: object) -> dict[str, str]:
        return self.event(kind, message, "err", **fields)

    def subscribe(self, replay: int = 0) -> tuple[queue.Queue, Callable[[], None]]:
        q: queue.Queue = queue.Queue(maxsize=1024)
        with self._lock:
            for event in list(self._history)[-replay:] if replay else []:
                q.put_nowait(event)
            self._subscribers.append(q)

        def unsubscribe() -> None:
            with self._lock:
                if q in self._subscribers:
                    self._subscribers.remove(q)
        return q, unsubscribe
