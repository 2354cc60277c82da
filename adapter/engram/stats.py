"""Row store statistics: lookups, cache hits and misses, read latency; one log line per interval."""

from __future__ import annotations

import threading
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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

    def add_counts(self, total: int, max_ns: int, counts: Sequence[int]) -> None:
        """Add a histogram given as its bucket counts (the native reader's)."""
        if len(counts) != _BUCKETS:
            raise ValueError(f"a latency histogram has {_BUCKETS} buckets, got {len(counts)}")
        for b, count in enumerate(counts):
            if count:
                self.counts[b] += count
        self.total += total
        self.max_ns = max(self.max_ns, max_ns)

    def add(self, other: LatencyHistogram) -> None:
        for b, count in enumerate(other.counts):
            if count:
                self.counts[b] += count
        self.total += other.total
        self.max_ns = max(self.max_ns, other.max_ns)

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


@dataclass(frozen=True)
class Interval:
    """One store's counters over one statistics interval (RowStats.take)."""

    seconds: float
    lookups: int  # rows asked for, owned or not
    hits: int
    misses: int  # rows read from the shard
    batches: int
    read_latency: LatencyHistogram
    batch_latency: LatencyHistogram


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
        # Counters kept elsewhere (the native reader's), added in whenever the interval is read.
        self._source: Callable[[], Any] | None = None
        self._reset(clock())

    def attach(self, source: Callable[[], Any]) -> None:
        """``source()`` returns the counters since its last call (adapter.engram.native.Counters)
        or None; they are added at every take, poll and line."""
        self._source = source

    def _drain(self) -> None:
        # Under self._lock.
        counts = self._source() if self._source is not None else None
        if counts is None or not counts.batches:
            return
        self.lookups += counts.lookups
        self.hits += counts.hits
        self.misses += counts.misses
        self.batches += counts.batches
        self.read_latency.add_counts(*counts.reads)
        self.batch_latency.add_counts(*counts.batch)

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
            line = self._due_line()
        if line is not None:
            self._log(line)

    def poll(self) -> None:
        """Log the line when the interval has passed (after reads that did not call record)."""
        with self._lock:
            self._drain()
            line = self._due_line()
        if line is not None:
            self._log(line)

    def _due_line(self) -> str | None:
        # Under self._lock.
        now = self._clock()
        if self.interval_s > 0 and now - self._start >= self.interval_s:
            line = self._line(now)
            self._reset(now)
            return line
        return None

    def take(self, now: float) -> Interval:
        """The counters since the last take (or line), and start the next interval."""
        with self._lock:
            self._drain()
            taken = Interval(max(now - self._start, 1e-9), self.lookups, self.hits, self.misses,
                             self.batches, self.read_latency, self.batch_latency)
            self._reset(now)
        return taken

    def line(self, now: float) -> str:
        with self._lock:
            self._drain()
            return self._line(now)

    def _line(self, now: float) -> str:
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


def rank_line(label: str, seconds: float, layers: Mapping[int, Interval], cache_enabled: bool) -> str:
    """One statistics line for a rank over its layers' intervals (the engram_offload adapter)."""
    seconds = max(seconds, 1e-9)
    rows = sum(i.lookups for i in layers.values())
    batches = sum(i.batches for i in layers.values())
    hits = sum(i.hits for i in layers.values())
    misses = sum(i.misses for i in layers.values())
    reads = LatencyHistogram()
    for i in layers.values():
        reads.add(i.read_latency)
    if not cache_enabled:
        hit = "off"
    else:
        hit = f"{100.0 * hits / (hits + misses):.1f} %" if hits + misses else "n/a"
    per_layer = ", ".join(
        f"layer {layer} {i.lookups / seconds:.0f} rows/s, read per lookup p50 "
        f"{format_duration(i.batch_latency.percentile(0.5))} p99 "
        f"{format_duration(i.batch_latency.percentile(0.99))}" for layer, i in sorted(layers.items()))
    return (f"{label}: {batches / seconds:.1f} lookups/s, {rows / seconds:.0f} rows/s over "
            f"{seconds:.1f} s, cache hit {hit} ({hits} hits, {misses} rows read), row read p50 "
            f"{format_duration(reads.percentile(0.5))} p99 {format_duration(reads.percentile(0.99))} "
            f"max {format_duration(reads.max_ns)}; {per_layer}")


class RankStats:
    """One line per interval for all of a rank's stores (their own RowStats lines stay off)."""

    def __init__(self, label: str, interval_s: float, clock: Callable[[], float],
                 log: Callable[[str], None], cache_enabled: bool) -> None:
        self.label = label
        self.interval_s = interval_s
        self.cache_enabled = cache_enabled
        self._clock = clock
        self._log = log
        self._lock = threading.Lock()
        self._stores: dict[int, RowStats] = {}
        self._start = clock()
        self._timer: threading.Thread | None = None
        self._stop = threading.Event()

    def add(self, layer: int, stats: RowStats) -> None:
        with self._lock:
            self._stores[layer] = stats
            stats.take(self._start)  # the store's interval starts with the rank's

    def maybe_report(self) -> None:
        """Log the line once the interval has passed (called after reads, and by the timer). An
        interval without a lookup logs nothing."""
        if self.interval_s <= 0:
            return
        now = self._clock()
        with self._lock:
            if now - self._start < self.interval_s:
                return
            intervals = {layer: stats.take(now) for layer, stats in self._stores.items()}
            seconds, self._start = now - self._start, now
        if any(i.batches for i in intervals.values()):
            self._log(rank_line(self.label, seconds, intervals, self.cache_enabled))

    def start_timer(self) -> None:
        """Report from a thread of its own every interval too: reads that a replayed CUDA graph's
        host functions do natively run no Python that could report them."""
        if self.interval_s <= 0 or self._timer is not None:
            return
        self._timer = threading.Thread(target=self._tick, name="engram-stats", daemon=True)
        self._timer.start()

    def _tick(self) -> None:
        while True:
            with self._lock:
                left = self.interval_s - (self._clock() - self._start)
            # Until the interval ends (another report may have restarted it), at least 1 % of it.
            if self._stop.wait(min(self.interval_s, max(left, self.interval_s / 100))):
                return
            self.maybe_report()

    def stop_timer(self) -> None:
        self._stop.set()
        if self._timer is not None:
            self._timer.join()
            self._timer = None
