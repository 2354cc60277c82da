"""One-line messages from the adapters to the rank's stderr (the journal keeps them)."""

from __future__ import annotations

import sys
from typing import TextIO

PREFIX = "dsv41-adapter: "


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
