"""The configurations the coordinator ran, kept in its state directory: what runs now, what ran
before it (for a rollback), and a change it rolled back (so a restart does not bring it back while
cluster.env still holds it). Every file is replaced atomically: a crash leaves the old or the new."""

from __future__ import annotations

import enum
import hashlib
import json
import os
from dataclasses import dataclass

from dsv41.atomicfile import replace_file

APPLIED = "applied.env"
PREVIOUS = "previous.env"
REJECTED = "rolled-back.json"


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Rejected:
    sha256: str
    at_unix_s: float
    why: str


class ConfigStore:
    def __init__(self, root: str):
        self.root = root

    def _path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def _read(self, name: str) -> str | None:
        try:
            with open(self._path(name), encoding="utf-8") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def _write(self, name: str, text: str) -> None:
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        replace_file(self._path(name), text.encode(), 0o600)

    def applied(self) -> str | None:
        return self._read(APPLIED)

    def previous(self) -> str | None:
        return self._read(PREVIOUS)

    def rejected(self) -> Rejected | None:
        text = self._read(REJECTED)
        if text is None:
            return None
        try:
            data = json.loads(text)
            return Rejected(str(data["sha256"]), float(data["at_unix_s"]), str(data["why"]))
        except (ValueError, KeyError, TypeError):
            return None  # unreadable: as if none was rolled back (the file is the operator's to fix)

    def record_applied(self, text: str) -> None:
        """`text` runs now; what ran before it becomes the previous configuration."""
        current = self.applied()
        if current == text:
            return
        if current is not None:
            self._write(PREVIOUS, current)
        self._write(APPLIED, text)

    def record_rolled_back(self, bad: str, to: str, at_unix_s: float, why: str) -> None:
        """`bad` failed and `to` runs again; `bad` is remembered so that it is not started again by itself."""
        self._write(REJECTED, json.dumps({"sha256": digest(bad), "at_unix_s": at_unix_s, "why": why}) + "\n")
        self._write(APPLIED, to)
        self._write(PREVIOUS, bad)

    def forget_rejected(self) -> None:
        try:
            os.unlink(self._path(REJECTED))
        except FileNotFoundError:
            pass


class Source(enum.StrEnum):
    FILE = "cluster.env"
    APPLIED = "the configuration applied before"


@dataclass(frozen=True)
class StartChoice:
    source: Source
    why: str  # empty when the file is used as it is


def choose_at_start(file_valid: bool, file_text: str | None, applied: str | None,
                    rejected: Rejected | None, file_errors: str = "") -> StartChoice | None:
    """Which configuration a starting coordinator runs; None: neither is usable (the file is invalid
    and nothing was applied before)."""
    if not file_valid:
        if applied is None:
            return None
        return StartChoice(Source.APPLIED, f"cluster.env is invalid, so the ranks keep the configuration "
                           f"applied before; fix it and run `dsv41ctl config apply`:\n{file_errors}")
    if rejected is not None and file_text is not None and digest(file_text) == rejected.sha256 and applied:
        return StartChoice(Source.APPLIED, "cluster.env still holds the change that was rolled back "
                           f"({rejected.why}); running the configuration before it: fix cluster.env and run "
                           "`dsv41ctl config apply`")
    return StartChoice(Source.FILE, "")
