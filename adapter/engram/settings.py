"""Row store settings: constructor arguments, or the DSV41_* variables of the rank's environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

MAX_IO_THREADS = 1024
MAX_CACHE_WAYS = 64


@dataclass(frozen=True)
class StoreSettings:
    io_threads: int = 96
    cache_gib: float = 0.0  # 0 disables the cache
    cache_ways: int = 4
    stats_seconds: float = 60.0  # 0 disables the statistics line
    # The owned rows' 8 scale bytes held in memory (read once at open): a miss reads 256 bytes.
    resident_scales: bool = False

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
        DSV41_RESIDENT_SCALES."""
        env = os.environ if environ is None else environ
        default = cls()
        values = {
            "io_threads": _number(env, "DSV41_IO_THREADS", int, default.io_threads),
            "cache_gib": _number(env, "DSV41_CACHE_GIB", float, default.cache_gib),
            "cache_ways": _number(env, "DSV41_CACHE_WAYS", int, default.cache_ways),
            "stats_seconds": _number(env, "DSV41_STATS_SECONDS", float, default.stats_seconds),
            "resident_scales": _flag(env, "DSV41_RESIDENT_SCALES", default.resident_scales),
        }
        try:
            return cls(**values)
        except ValueError as e:
            raise ValueError(f"bad Engram row store environment: {e}") from None


def _number(env: Mapping[str, str], key: str, kind: type, default: float) -> float:
    raw = env.get(key, "").strip()
    if not raw:
        return default
    try:
        return kind(raw)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"{key}={raw!r}: expected {what}") from None


def _flag(env: Mapping[str, str], key: str, default: bool) -> bool:
    raw = env.get(key, "").strip()
    if not raw:
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{key}={raw!r}: expected 1 or 0")
