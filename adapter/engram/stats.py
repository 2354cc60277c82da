"""Row store statistics: lookups, cache hits and misses, read latency; one log line per interval."""

from __future__ import annotations

import threading
from array import array
from collections.abc import Callable, Iterable

_BUCKETS = 65 * 4  # quarter-octave buckets over the whole u64 nanosecond range


def bucket_of(ns: int) -> int:
    """Quarter-octave histogram bucket (about 19 % wide) of a latency in nanoseconds."""
    e = ns.bit_length()
    return e * 4 + ((ns >> (e - 3)) & 3) if e >= 3 else e * 4


def bucket_upper(b: int) -> int:
    """Largest latency (ns) that falls in bucket ``b``."""
    e, sub = divmod(b, 4)
    if e < 3:
        return (1 << e) - 1
    return ((5 + sub) << (e - 3)) - 1


class LatencyHistogram:
    def __init__(self) -> None:
        self.counts = array("Q", [0]) * _BUCKETS
        self.total = 0
        self.max_ns = 0

    def add_all(self, samples_ns: Iterable[int]) -> None:
        for ns in samples_ns:
            self.counts[bucket_of(ns)] += 1
            self.total += 1
            if ns > self.max_ns:
                self.max_ns = ns

    def percentile(self, q: float) -> int:
        """Upper edge of the bucket holding the q-quantile (0 when empty)."""
        if not self.total:
            return 0
        rank = max(1, int(q * self.total + 0.999999))
        seen = 0
        for b, count in enumerate(self.counts):
            seen += count
            if seen >= rank:
                return min(bucket_upper(b), self.max_ns)
        return self.max_ns


def format_duration(ns: float) -> str:
    if ns < 1_000_000:
        return f"{ns / 1000:.0f} µs"
    if ns < 1_000_000_000:
        return f"{ns / 1e6:.2f} ms"
    return f"{ns / 1e9:.2f} s"


class RowStats:
    """Accumulates one interval; ``maybe_report`` hands the line to ``log`` once it has elapsed."""

    def __init__(self, label: str, interval_s: float, clock: Callable[[], float],
                 log: Callable[[str], None], cache_enabled: bool) -> None:
        self.label = label
        self.cache_enabled = cache_enabled
        self.interval_s = interval_s
        self._clock = clock
        self._log = log
        self._lock = threading.Lock()
        self._reset(clock())

    def _reset(self, now: float) -> None:
        self._start = now
        self.lookups = 0
        self.hits = 0
        self.misses = 0
        self.batches = 0
        self.read_latency = LatencyHistogram()
        self.batch_latency = LatencyHistogram()

    def record(self, lookups: int, hits: int, misses: int, read_ns: Iterable[int],
               batch_ns: int) -> None:
        with self._lock:
            self.lookups += lookups
            self.hits += hits
            self.misses += misses
            self.batches += 1
            self.read_latency.add_all(read_ns)
            self.batch_latency.add_all((batch_ns,))
            now = self._clock()
            if self.interval_s > 0 and now - self._start >= self.interval_s:
                line = self.line(now)
                self._reset(now)
            else:
                line = None
        if line is not None:
            self._log(line)

    def line(self, now: float) -> str:
        elapsed = max(now - self._start, 1e-9)
        cached = self.hits + self.misses
        if not self.cache_enabled:
            hit_pct = "off"
        else:
            hit_pct = f"{100.0 * self.hits / cached:.1f} %" if cached else "n/a"
        r, b = self.read_latency, self.batch_latency
        return (f"{self.label}: {self.lookups / elapsed:.0f} rows/s in {self.batches} batches "
                f"over {elapsed:.1f} s, cache hit {hit_pct} ({self.hits} hits, "
                f"{self.misses} rows read), row read p50 {format_duration(r.percentile(0.5))} "
                f"p99 {format_duration(r.percentile(0.99))} max {format_duration(r.max_ns)}, "
                f"batch p50 {format_duration(b.percentile(0.5))} "
                f"p99 {format_duration(b.percentile(0.99))}")
