"""What this node contributes to `dsv41ctl bundle` (pure selection and formatting, plus small
readers with their roots as constructor arguments).

Never a secret: nothing here opens a key file; every file passes through a Redactor that removes
PEM private key blocks and the secrets the agent holds (the files the coordinator placed with mode
0600, such as the API key on the head).
"""

from __future__ import annotations

import collections
import datetime
import os
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Protocol

from dsv41.redact import Redactor

DEFAULT_JOURNAL_BYTES = 8 << 20
MAX_JOURNAL_BYTES = 64 << 20
DEFAULT_RANK_LINES = 500
MAX_RANK_LINES = 10_000
KERNEL_LINES = 5_000
PROC_FILES = ("meminfo", "buddyinfo", "pressure/cpu", "pressure/memory", "pressure/io")
UNIT_PREFIX = "dsv41-"
RANK_UNIT = "dsv41-rank.service"
# GPU driver (NVRM, Xid), out-of-memory kills and the ConnectX driver: what a hang or an abrupt rank
# death leaves in the kernel log.
KERNEL_PATTERN = re.compile(r"NVRM|\bXid\b|out of memory|oom[-_ ]?kill|invoked oom-killer|\bmlx5", re.IGNORECASE)


@dataclass(frozen=True)
class JournalEntry:
    at_unix_s: float
    unit: str
    priority: int
    message: str
    pid: str = ""

    def line(self) -> str:
        when = datetime.datetime.fromtimestamp(self.at_unix_s, datetime.timezone.utc).isoformat(timespec="microseconds")
        pid = f"[{self.pid}]" if self.pid else ""
        return f"{when} {self.unit}{pid} <{self.priority}> {self.message}"


class JournalSource(Protocol):
    def units(self) -> list[str]: ...
    def newest_first(self, unit: str) -> Iterator[JournalEntry]: ...
    def kernel_newest_first(self) -> Iterator[JournalEntry]: ...


def tail_lines(newest_first: Iterable[str], max_bytes: int, max_lines: int | None = None) -> str:
    """The newest lines (oldest first in the result) within max_bytes and max_lines, with a first line
    saying that earlier ones were left out when the limit cut them."""
    kept: collections.deque[str] = collections.deque()
    size = 0
    cut = False
    for line in newest_first:
        cost = len(line.encode("utf-8", "replace")) + 1
        if size + cost > max_bytes or (max_lines is not None and len(kept) >= max_lines):
            cut = True
            break
        kept.appendleft(line)
        size += cost
    head = [f"[earlier lines left out: more than {max_bytes} bytes or {max_lines or '-'} lines]"] if cut else []
    return "".join(f"{line}\n" for line in (*head, *kept))


def kernel_lines(newest_first: Iterable[JournalEntry], limit: int = KERNEL_LINES) -> str:
    matching = (e.line() for e in newest_first if KERNEL_PATTERN.search(e.message))
    return tail_lines(matching, MAX_JOURNAL_BYTES, limit)


def safe_unit_name(unit: str) -> str:
    return re.sub(r"[^A-Za-z0-9@._-]", "_", unit)[:200]


class NodeDiagnostics:
    def __init__(self, journal: JournalSource, status_json: Callable[[], str], redactor: Redactor,
                 proc_root: str = "/proc", extra_units: Callable[[], list[str]] = list):
        """`extra_units()`: units beyond the dsv41-* ones whose journals belong in (the agent's mount unit)."""
        self._journal = journal
        self._status_json = status_json
        self._redact = redactor
        self._proc = proc_root
        self._extra_units = extra_units

    def files(self, journal_bytes: int, rank_lines: int) -> Iterator[tuple[str, bytes]]:
        """(relative path, content) of every file, each redacted."""
        for name in PROC_FILES:
            yield f"proc/{name}", self._redact(self._read_proc(name))
        yield "agent-status.json", self._redact(self._status_json().encode())
        units = sorted({u for u in self._journal.units() if u.startswith(UNIT_PREFIX)} | set(self._extra_units()))
        for unit in units:
            text = tail_lines((e.line() for e in self._journal.newest_first(unit)), journal_bytes)
            if text:  # a unit known from an earlier boot only
                yield f"journal/{safe_unit_name(unit)}.log", self._redact(text.encode())
        rank = tail_lines((e.line() for e in self._journal.newest_first(RANK_UNIT)), journal_bytes, rank_lines)
        yield "rank-last-lines.log", self._redact(rank.encode())
        yield "kernel.log", self._redact(kernel_lines(self._journal.kernel_newest_first()).encode())

    def _read_proc(self, name: str) -> bytes:
        try:
            with open(os.path.join(self._proc, name), "rb") as f:
                return f.read(1 << 20)
        except OSError as exc:
            return f"cannot read /proc/{name}: {exc.strerror}\n".encode()


class SystemdJournal:
    """This boot's journal through python3-systemd."""

    def __init__(self, path: str | None = None):
        self._path = path

    def _reader(self):
        from systemd import journal  # only the diagnostics and ReadJournal need it
        reader = journal.Reader(path=self._path) if self._path else journal.Reader()
        reader.this_boot()
        return reader

    def units(self) -> list[str]:
        reader = self._reader()
        try:
            return sorted({str(u) for field in ("_SYSTEMD_UNIT", "UNIT") for u in reader.query_unique(field)})
        finally:
            reader.close()

    def newest_first(self, unit: str) -> Iterator[JournalEntry]:
        reader = self._reader()
        try:
            reader.add_match(_SYSTEMD_UNIT=unit)
            reader.add_disjunction()
            reader.add_match(UNIT=unit)  # systemd's own messages about the unit (started, exited, ...)
            yield from self._backwards(reader, unit)
        finally:
            reader.close()

    def kernel_newest_first(self) -> Iterator[JournalEntry]:
        reader = self._reader()
        try:
            reader.add_match(_TRANSPORT="kernel")
            yield from self._backwards(reader, "kernel")
        finally:
            reader.close()

    @staticmethod
    def _backwards(reader, label: str) -> Iterator[JournalEntry]:
        reader.seek_tail()
        while True:
            entry = reader.get_previous()
            if not entry:
                return
            when = entry.get("__REALTIME_TIMESTAMP")
            message = entry.get("MESSAGE", "")
            if isinstance(message, bytes):
                message = message.decode("utf-8", "replace")
            yield JournalEntry(when.timestamp() if when else 0.0, label, int(entry.get("PRIORITY", 6)),
                               str(message).replace("\n", " "), str(entry.get("_PID", "")))
