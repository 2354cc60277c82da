"""Journald-friendly logging: one event per line, a priority, structured DSV41_* fields.

Under systemd the entries go to the journal through python3-systemd with their fields
(`journalctl DSV41_EVENT=rank_exit`); elsewhere (tests, a terminal) one line on stderr with the
`<N>` priority prefix journald understands and the fields as key=value.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Callable, TextIO

# A listener gets (kind, priority, fields) of every event after it was written; fields hold the
# DSV41_* names as they went to the journal (DSV41_EVENT included), all as text.
Listener = Callable[[str, str, dict], None]

PRIORITIES = {"emerg": 0, "alert": 1, "crit": 2, "err": 3, "warning": 4, "notice": 5, "info": 6, "debug": 7}
JOURNAL_SOCKET = "/run/systemd/journal/socket"


def _journal_sender() -> Callable[..., None] | None:
    if not os.path.exists(JOURNAL_SOCKET) or not os.environ.get("JOURNAL_STREAM") and not os.environ.get(
            "INVOCATION_ID"):
        return None
    try:
        from systemd import journal
    except ImportError:
        return None
    return journal.send


class EventLog:
    """Writes events. `identifier` becomes SYSLOG_IDENTIFIER; `fields` go on every entry."""

    def __init__(self, identifier: str, fields: dict[str, str], stream: TextIO | None = None,
                 sender: Callable[..., None] | None = None, use_journal: bool = True):
        self._identifier = identifier
        self._fields = {k: str(v) for k, v in fields.items()}
        self._stream = stream or sys.stderr
        self._sender = sender if sender is not None else (_journal_sender() if use_journal else None)
        self._lock = threading.Lock()
        self._listeners: list[Listener] = []

    def with_fields(self, **fields: str) -> "EventLog":
        """The same log, its listeners included, with more fields on every entry (a group's DSV41_GROUP)."""
        child = EventLog(self._identifier, {**self._fields, **{_field_name(k): str(v) for k, v in fields.items()}},
                         self._stream, self._sender, use_journal=False)
        child._lock, child._listeners = self._lock, self._listeners
        return child

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Calls listener for every later event, in the thread that logs it (so it must be quick
        and must not block); returns the function that unsubscribes it."""
        with self._lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)
        return unsubscribe

    def event(self, kind: str, message: str, priority: str = "info", **fields: object) -> dict[str, str]:
        """Logs one event and returns its fields (DSV41_EVENT included)."""
        entry = {**self._fields, "DSV41_EVENT": kind}
        entry.update({_field_name(k): _text(v) for k, v in fields.items() if v is not None})
        message = _text(message)
        if self._sender is not None:
            self._sender(MESSAGE=message, PRIORITY=str(PRIORITIES[priority]),
                         SYSLOG_IDENTIFIER=self._identifier, **entry)
        else:
            extras = " ".join(f"{k}={v}" for k, v in entry.items())
            with self._lock:
                self._stream.write(f"<{PRIORITIES[priority]}>{message} [{extras}]\n")
                self._stream.flush()
        self._notify(kind, priority, entry)
        return entry

    def _notify(self, kind: str, priority: str, entry: dict[str, str]) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(kind, priority, dict(entry))
            except Exception as exc:  # a listener's bug must not cost the caller its event or its thread
                with self._lock:
                    self._stream.write(f"<4>{self._identifier}: event listener failed on {kind}: {exc!r}\n")
                    self._stream.flush()

    def info(self, kind: str, message: str, **fields: object) -> dict[str, str]:
        return self.event(kind, message, "info", **fields)

    def warning(self, kind: str, message: str, **fields: object) -> dict[str, str]:
        return self.event(kind, message, "warning", **fields)

    def error(self, kind: str, message: str, **fields: object) -> dict[str, str]:
        return self.event(kind, message, "err", **fields)


def _field_name(key: str) -> str:
    key = key.upper()
    return key if key.startswith("DSV41_") else f"DSV41_{key}"


def _text(value: object) -> str:
    # One event per line: a newline would split the entry on the stderr path.
    return str(value).replace("\n", " ")
