"""Sampled comparison of packed rows against the checkpoint (never a full re-read)."""

from __future__ import annotations

import os

from dsv41 import engram_format as fmt
from agent.pack.checkpoint import SourceRows


def sample_rows(lo: int, hi: int, count: int) -> list[int]:
    """Both ends of [lo, hi) and ``count`` rows spread evenly over it, ascending, no repeats."""
    if hi <= lo:
        return []
    n = hi - lo
    picks = {lo, hi - 1}
    picks.update(lo + (2 * i + 1) * n // (2 * count) for i in range(count))
    return sorted(picks)


def first_mismatch(fd: int, header: fmt.Header, source: SourceRows, rows: list[int]) -> int | None:
    """The first of ``rows`` whose packed bytes differ from the checkpoint, or None."""
    for row in rows:
        packed = os.pread(fd, fmt.ROW_BYTES, fmt.row_offset(header, row))
        if packed != source.row(header.layer, row):
            return row
    return None
