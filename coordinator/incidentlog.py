"""The coordinator's incident history on disk, so that `dsv41ctl events`, status's last incident and
the metrics' incident counters carry on across the coordinator's restarts (a crash, kill -9, an
upgrade, `systemctl restart`).

One JSON object per line in /var/lib/dsv41/coordinator/incidents.jsonl (root, mode 0600: operators read it through
`dsv41ctl events`), each appended and fsync'd when the incident is recorded:

    {"v": 1, "at_unix_s": 1796000000.5, "node": "spark3", "kind": "rank_exit", "message": "..."}

Bounded: the newest KEEP incidents are kept. The file grows to twice that before it is rewritten
atomically with the newest KEEP, headed by one line that counts, by kind and node, the incidents the
rewrites have dropped, so that the metrics' counters never go back:

    {"v": 1, "dropped": [{"kind": "rank_exit", "node": "spark3", "count": 12}, ...]}

A line that cannot be read (the torn end of a write a crash cut short, or corruption) is skipped
with one warning naming the file and its line numbers, and the file is rewritten without it; a file
that cannot be read at all starts an empty history with an error event. Neither stops the
coordinator, and nor does a history it cannot write (one error event until a write works again).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field

from dsv41.atomicfile import replace_file
from dsv41.journal import EventLog

from .state import Incident, IncidentKind

FORMAT_VERSION = 1
HISTORY_NAME = "incidents.jsonl"  # in the coordinator's state directory
HISTORY_PATH = f"/var/lib/dsv41/coordinator/{HISTORY_NAME}"
# 1000 incidents: weeks of a cluster that fails every few minutes, years of a healthy one, and the
# file (at most 2 * KEEP lines of at most MESSAGE_CHARS each, a few hundred bytes in practice) stays
# a few MiB at worst and loads in milliseconds.
KEEP = 1000
MESSAGE_CHARS = 4096  # longer messages are cut on disk, so that one line cannot grow the file unbounded
FILE_MODE = 0o600
SHOWN_BAD_LINES = 10  # line numbers named in the warning about unreadable lines

Counts = dict[tuple[str, str], int]  # (kind, node) -> incidents


@dataclass(frozen=True)
class Loaded:
    incidents: list[Incident] = field(default_factory=list)  # oldest first, at most KEEP
    counts: Counts = field(default_factory=dict)  # every incident recorded, those dropped by the bound included


@dataclass(frozen=True)
class Parsed:
    """What the lines of a history file hold."""
    incidents: list[Incident]
    dropped: Counts
    bad_lines: list[int]  # 1-based numbers of lines that could not be read


def record_of(incident: Incident) -> dict:
    return {"v": FORMAT_VERSION, "at_unix_s": incident.at_unix_s, "node": incident.node,
            "kind": str(incident.kind), "message": incident.message[:MESSAGE_CHARS]}


def dropped_record(dropped: Counts) -> dict:
    return {"v": FORMAT_VERSION, "dropped": [{"kind": kind, "node": node, "count": count}
                                              for (kind, node), count in sorted(dropped.items())]}


def incident_of(record: dict) -> Incident:
    """A record's incident; ValueError/KeyError/TypeError for one that is not a version-1 incident."""
    if record.get("v") != FORMAT_VERSION:
        raise ValueError(f"format version {record.get('v')!r}, this coordinator reads {FORMAT_VERSION}")
    at, node, kind, message = record["at_unix_s"], record["node"], record["kind"], record["message"]
    if not isinstance(at, (int, float)) or not all(isinstance(v, str) for v in (node, kind, message)):
        raise TypeError("at_unix_s must be a number; node, kind and message text")
    try:
        known: IncidentKind | str = IncidentKind(kind)
    except ValueError:
        # Written by a newer coordinator before a downgrade: kept as its text, so that events and
        # the counters show it as it was recorded.
        known = kind
    return Incident(float(at), node, known, message)


def parse_lines(lines: list[bytes]) -> Parsed:
    incidents: list[Incident] = []
    dropped: Counts = {}
    bad: list[int] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise TypeError("not an object")
            if "dropped" in record and record.get("v") == FORMAT_VERSION:
                for (kind, node), count in [((str(e["kind"]), str(e["node"])), int(e["count"]))
                                            for e in record["dropped"]]:
                    dropped[(kind, node)] = dropped.get((kind, node), 0) + count
            else:
                incidents.append(incident_of(record))
        except (ValueError, KeyError, TypeError):
            bad.append(number)
    return Parsed(incidents, dropped, bad)


def count_of(incidents: list[Incident], dropped: Counts) -> Counts:
    counts = dict(dropped)
    for incident in incidents:
        key = (str(incident.kind), incident.node)
        counts[key] = counts.get(key, 0) + 1
    return counts


def compacted(incidents: list[Incident], dropped: Counts, keep: int) -> tuple[list[Incident], Counts]:
    """The newest `keep` incidents, and the dropped counts grown by the older ones."""
    cut = max(0, len(incidents) - keep)
    return incidents[cut:], count_of(incidents[:cut], dropped)


def file_bytes(incidents: list[Incident], dropped: Counts) -> bytes:
    lines = ([dropped_record(dropped)] if dropped else []) + [record_of(i) for i in incidents]
    return b"".join(json.dumps(r, sort_keys=True).encode() + b"\n" for r in lines)


def read_incidents(path: str) -> list[Incident]:
    """The incidents of the history file at `path`, read only (dsv41ctl's bundle, when the coordinator
    is not running): unreadable lines are left out, a missing or unreadable file gives none."""
    try:
        with open(path, "rb") as f:
            return parse_lines(f.read().split(b"\n")).incidents
    except OSError:
        return []


class IncidentHistory:
    """The history file at `path`: load() once at the coordinator's start, then append() every
    incident (from any thread; each append is on disk when it returns)."""

    def __init__(self, path: str, log: EventLog, keep: int = KEEP):
        if keep < 1:
            raise ValueError(f"keep={keep}: the history must keep at least 1 incident")
        self.path = path
        self.keep = keep
        self._log = log
        self._lock = threading.Lock()
        self._incidents: list[Incident] = []  # what the file holds, oldest first
        self._dropped: Counts = {}
        self._failing = False  # an error event was logged; the next one waits for a write that works

    def load(self) -> Loaded:
        """The history on disk; a missing or unreadable file gives an empty one (and an event)."""
        with self._lock:
            try:
                with open(self.path, "rb") as f:
                    raw = f.read()
            except FileNotFoundError:
                self._log.info("incident_history_empty", f"no incident history at {self.path} yet: it starts "
                               "empty", path=self.path)
                return Loaded()
            except OSError as exc:
                self._log.error("incident_history_unreadable", f"cannot read the incident history {self.path}: "
                                f"{exc.strerror or exc}; it starts empty (earlier incidents are not shown)",
                                path=self.path)
                return Loaded()
            parsed = parse_lines(raw.split(b"\n"))
            self._incidents, self._dropped = parsed.incidents, parsed.dropped
            if parsed.bad_lines:
                self._warn_bad_lines(parsed.bad_lines)
            if parsed.bad_lines or len(self._incidents) > self.keep:
                self._rewrite()  # without the bad lines, so that appends never follow a torn one
            self._log.info("incident_history_loaded", f"{len(self._incidents)} earlier incident(s) from "
                           f"{self.path}", path=self.path, incidents=len(self._incidents))
            return Loaded(list(self._incidents), count_of(self._incidents, self._dropped))

    def append(self, incident: Incident) -> None:
        """Appends one line and fsyncs it; rewrites the file once it holds twice the bound. A write
        that fails is logged, not raised: the coordinator goes on without its history."""
        line = json.dumps(record_of(incident), sort_keys=True).encode() + b"\n"
        with self._lock:
            self._incidents.append(incident)
            # After a failed write the file lacks incidents: the rewrite puts every one back.
            if self._failing or len(self._incidents) >= 2 * self.keep:
                self._rewrite()
                return
            try:
                self._append_line(line)
            except OSError as exc:
                self._failed(exc)
                return
            self._recovered()

    # -- effects, under the lock

    def _append_line(self, line: bytes) -> None:
        directory = os.path.dirname(self.path) or "."
        os.makedirs(directory, mode=0o700, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, FILE_MODE)
        try:
            size = os.fstat(fd).st_size
            created = size == 0
            if size and os.pread(fd, 1, size - 1) != b"\n":
                line = b"\n" + line  # after a torn line that load() could not rewrite away: never glued to it
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        if created:  # the new file's name survives a power cut too
            dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    def _rewrite(self) -> None:
        self._incidents, self._dropped = compacted(self._incidents, self._dropped, self.keep)
        try:
            os.makedirs(os.path.dirname(self.path) or ".", mode=0o700, exist_ok=True)
            replace_file(self.path, file_bytes(self._incidents, self._dropped), FILE_MODE)
        except OSError as exc:
            self._failed(exc)
            return
        self._recovered()

    def _warn_bad_lines(self, bad: list[int]) -> None:
        shown = ", ".join(str(n) for n in bad[:SHOWN_BAD_LINES]) + (", ..." if len(bad) > SHOWN_BAD_LINES else "")
        self._log.warning("incident_history_bad_lines", f"{self.path}: skipped {len(bad)} unreadable line(s) "
                          f"(line {shown}): cut short by a crash or corrupt; the other incidents are kept",
                          path=self.path, lines=shown, skipped=len(bad))

    def _failed(self, exc: OSError) -> None:
        if not self._failing:
            self._failing = True
            self._log.error("incident_history_failed", f"cannot write the incident history {self.path}: "
                            f"{exc.strerror or exc}; incidents are still recorded in memory, but a restart of "
                            "the coordinator will not show them", path=self.path)

    def _recovered(self) -> None:
        if self._failing:
            self._failing = False
            self._log.info("incident_history_written", f"the incident history {self.path} is written again",
                           path=self.path)
