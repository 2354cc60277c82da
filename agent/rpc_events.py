"""WatchEvents: the agent's events as they happen, after the last few it kept."""

from __future__ import annotations

import queue

from dsv41.v1 import agent_pb2 as pb

from .events import EventHub

REPLAY_EVENTS = 64


class EventRpcs:
    """WatchEvents, from the agent's event hub."""

    def __init__(self, node: str, events: EventHub):
        self._node = node
        self._events = events

    def WatchEvents(self, request, context):
        events, unsubscribe = self._events.subscribe(replay=REPLAY_EVENTS)
        try:
            while context.is_active():
                try:
                    event = events.get(timeout=1.0)
                except queue.Empty:
                    continue
                yield pb.Event(at_unix_s=event.at_unix_s, node=self._node, kind=event.kind,
                               priority=event.priority, message=event.message, fields=event.fields)
        finally:
            unsubscribe()
