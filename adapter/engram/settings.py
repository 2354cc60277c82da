"""Row store settings: constructor arguments, or the DSV41_* variables of the rank's environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from dsv41 import rankadapters

MAX_IO_THREADS = 1024
MAX_CACHE_WAYS = 64


@dataclass(frozen=True)
class StoreSettings:
    io_threads: int = int(rankadapters.DSV41_IO_THREADS.default)
    cache_gib: float = float(rankadapters.DSV41_CACHE_GIB.default)  # 0 disables the cache
    cache_ways: int = int(rankadapters.DSV41_CACHE_WAYS.default)
    stats_seconds: float = float(rankadapters.DSV41_STATS_SECONDS.default)  # 0 disables the statistics line
    # The owned rows' 8 scale bytes held in memory (read once at open): a miss reads 256 bytes.
    resident_scales: bool = rankadapters.DSV41_RESIDENT_SCALES.default == "1"

    def __post_init__(self) -> None:
        if not 1 <= self.io_threads <= MAX_IO_THREADS:
            raise ValueError(f"io_threads must be in [1, {MAX_IO_THREADS}], got {self.io_threads}")
        if not self.cache_gib >= 0:
            raise ValueError(f"cache_gib must be >= 0 (0 disables the cache), got {self.cache_gib}")
        if not 1 <= self.cache_ways <= MAX_CACHE_WAYS:
            raise ValueError(f"cache_ways must be in [1, {MAX_CACHE_WAYS}], got {self.cache_ways}")
        if not self.stats_seconds >= 0:
            raise ValueError(f"stats_seconds must be >= 0 (0 disables), got {self.stats_seconds}")

    @property
    def cache_bytes(self) -> int:
        return int(self.cache_gib * 2**30)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> StoreSettings:
        """From DSV41_IO_THREADS, DSV41_CACHE_GIB, DSV41_CACHE_WAYS, DSV41_STATS_SECONDS and
        DSV41_RESIDENT_SCALES, as dsv41/rankadapters.py declares them (SettingError, a ValueError,
        for a value outside what they allow)."""
        env = os.environ if environ is None else environ
        return cls(io_threads=rankadapters.DSV41_IO_THREADS.read(env),
                   cache_gib=rankadapters.DSV41_CACHE_GIB.read(env),
                   cache_ways=rankadapters.DSV41_CACHE_WAYS.read(env),
                   stats_seconds=float(rankadapters.DSV41_STATS_SECONDS.read(env)),
                   resident_scales=rankadapters.DSV41_RESIDENT_SCALES.read(env))
