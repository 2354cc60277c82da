"""One-line messages from the adapters to the rank's stderr (the journal keeps them), and what the
coordinator's health step reads back from them: written by adapter/, read by coordinator/."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Iterable, TextIO

PREFIX = "dsv41-adapter: "
# The lines that say an adapter is not in effect (stays_out, Installer's "could not patch" and
# "failed in"): the coordinator fails a bring-up on them (AdapterReport).
_INSTALLED = re.compile(r"^(\S+) installed \(")
_LEFT_OUT = re.compile(r"^(\S+) (stays out: |could not patch |failed in )")


class AdapterLog:
    """Writes `dsv41-adapter: <message>` lines; the stream is a constructor argument for tests."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream

    def line(self, message: str) -> None:
        stream = self._stream if self._stream is not None else sys.stderr
        # One write per line so concurrent ranks' lines do not interleave mid-line.
        try:
            stream.write(PREFIX + message.replace("\n", " ") + "\n")
            stream.flush()
        except (OSError, ValueError):
            pass  # a closed stderr must never break the rank

    def installed(self, name: str, detail: str) -> None:
        self.line(f"{name} installed ({detail})")

    def stays_out(self, name: str, reason: str) -> None:
        self.line(f"{name} stays out: {reason}")


@dataclass(frozen=True)
class AdapterReport:
    """What one rank's output says of its adapters: which reported installed (in any of its
    processes), and every line saying one is not in effect, as written."""
    installed: frozenset[str]
    left_out: tuple[str, ...]


def read_report(lines: Iterable[str]) -> AdapterReport:
    installed, left_out = set(), []
    for line in lines:
        if not line.startswith(PREFIX):
            continue
        message = line[len(PREFIX):]
        if match := _INSTALLED.match(message):
            installed.add(match.group(1))
        elif _LEFT_OUT.match(message) and message not in left_out:
            left_out.append(message)
    return AdapterReport(frozenset(installed), tuple(left_out))
