"""A set-associative cache of packed rows in anonymous memory (pages touched only when filled)."""

from __future__ import annotations

import mmap
import threading
from array import array

from dsv41.engram_format import ROW_BYTES

_MIX = 0x9E3779B97F4A7C15  # Fibonacci hashing: spreads runs of nearby row ids over the sets
_MASK = (1 << 64) - 1


class RowCache:
    """``sets`` x ``ways`` slots of one row each; least recently used way is replaced."""

    def __init__(self, capacity_bytes: int, ways: int) -> None:
        if ways < 1:
            raise ValueError(f"ways must be >= 1, got {ways}")
        self.sets = capacity_bytes // (ROW_BYTES * ways)
        if self.sets < 1:
            raise ValueError(f"a cache of {capacity_bytes} bytes cannot hold one set of {ways} "
                             f"rows of {ROW_BYTES} bytes")
        self.ways = ways
        slots = self.sets * ways
        self._data = mmap.mmap(-1, slots * ROW_BYTES)
        self._view = memoryview(self._data)
        self._tags = array("q", [-1]) * slots
        self._used = array("Q", [0]) * slots
        self._tick = 0
        self._lock = threading.Lock()

    @property
    def capacity_rows(self) -> int:
        return self.sets * self.ways

    def _first_slot(self, row: int) -> int:
        return (((row * _MIX) & _MASK) >> 32) % self.sets * self.ways

    def get_into(self, rows: list[int], out: memoryview, positions: list[int]) -> list[int]:
        """Copy cached rows to ``out`` at their positions; return the indexes of ``rows`` missed."""
        missed = []
        tags, used, data = self._tags, self._used, self._view
        with self._lock:
            for k, row in enumerate(rows):
                base = self._first_slot(row)
                for slot in range(base, base + self.ways):
                    if tags[slot] == row:
                        self._tick += 1
                        used[slot] = self._tick
                        at = positions[k] * ROW_BYTES
                        out[at:at + ROW_BYTES] = data[slot * ROW_BYTES:(slot + 1) * ROW_BYTES]
                        break
                else:
                    missed.append(k)
        return missed

    def put_from(self, rows: list[int], src: memoryview, positions: list[int]) -> None:
        """Insert rows whose bytes sit in ``src`` at the given positions."""
        tags, used, data = self._tags, self._used, self._view
        with self._lock:
            for row, pos in zip(rows, positions):
                base = self._first_slot(row)
                victim = base
                for slot in range(base, base + self.ways):
                    if tags[slot] == row:
                        victim = slot
                        break
                    if used[slot] < used[victim]:
                        victim = slot
                self._tick += 1
                used[victim] = self._tick
                tags[victim] = row
                at = pos * ROW_BYTES
                data[victim * ROW_BYTES:(victim + 1) * ROW_BYTES] = src[at:at + ROW_BYTES]

    def close(self) -> None:
        self._view.release()
        self._data.close()
