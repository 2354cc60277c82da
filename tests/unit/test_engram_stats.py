"""Latency histogram used by the row store's statistics line."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from adapter.engram.stats import LatencyHistogram, RowStats, bucket_of, bucket_upper, format_duration

pytestmark = pytest.mark.unit


def test_bucket_bounds_hold_their_samples() -> None:
    for ns in list(range(0, 5000)) + [random.Random(1).randrange(2**40) for _ in range(5000)]:
        b = bucket_of(ns)
        assert ns <= bucket_upper(b)
        assert b == 0 or ns > bucket_upper(b - 1)


def test_percentiles_within_a_bucket_width() -> None:
    h = LatencyHistogram()
    samples = [80_000] * 98 + [300_000, 5_000_000]
    h.add_all(samples)
    assert 80_000 <= h.percentile(0.5) <= 80_000 * 1.25
    assert 300_000 <= h.percentile(0.99) <= 300_000 * 1.25
    assert h.percentile(1.0) == h.max_ns == 5_000_000
    assert LatencyHistogram().percentile(0.5) == 0


def test_durations_have_units() -> None:
    assert format_duration(85_000) == "85 µs"
    assert format_duration(1_200_000) == "1.20 ms"
    assert format_duration(2_500_000_000) == "2.50 s"


def _stats(clock, lines, label="engram layer 1 rank 0/3"):
    from adapter.engram.stats import RowStats

    return RowStats(label, 0, clock, lines.append, cache_enabled=False)


def test_take_returns_the_interval_and_starts_the_next() -> None:
    now = [10.0]
    lines: list[str] = []
    stats = _stats(lambda: now[0], lines)
    stats.record(24, 0, 20, [1000] * 20, 50_000)
    now[0] = 12.5
    first = stats.take(now[0])
    assert (first.seconds, first.lookups, first.misses, first.batches) == (2.5, 24, 20, 1)
    second = stats.take(13.0)
    assert (second.seconds, second.lookups, second.batches, second.read_latency.total) == (0.5, 0, 0, 0)
    assert lines == []  # an interval of 0 never logs on its own


def test_rank_line_covers_both_layers_once_per_interval() -> None:
    from adapter.engram.stats import RankStats

    now = [100.0]
    lines: list[str] = []
    l1, l14 = _stats(lambda: now[0], []), _stats(lambda: now[0], [])
    rank = RankStats("engram_offload: rank 1/3", 60, lambda: now[0], lines.append, cache_enabled=False)
    rank.add(1, l1)
    rank.add(14, l14)
    for _ in range(3):
        l1.record(576, 0, 500, [20_000] * 500, 900_000)
        l14.record(576, 0, 400, [40_000] * 400, 800_000)
        now[0] += 10
        rank.maybe_report()
    assert lines == []
    now[0] += 30
    rank.maybe_report()
    assert len(lines) == 1
    line = lines[0]
    assert line.startswith("engram_offload: rank 1/3: 0.1 lookups/s, 58 rows/s over 60.0 s, cache hit off "
                           "(0 hits, 2700 rows read), row read p50 "), line
    assert "layer 1 29 rows/s, read per lookup p50 " in line and "layer 14 29 rows/s" in line
    rank.maybe_report()
    assert len(lines) == 1  # the next interval has only begun


def test_merged_histograms_keep_every_sample() -> None:
    a, b = LatencyHistogram(), LatencyHistogram()
    a.add_all([1000] * 10)
    b.add_all([900_000] * 10)
    a.add(b)
    assert a.total == 20 and a.max_ns == 900_000
    assert a.percentile(0.25) <= 1250 and a.percentile(0.99) >= 900_000


def test_counts_from_elsewhere_add_into_the_interval() -> None:
    buckets = [0] * len(LatencyHistogram().counts)
    buckets[bucket_of(3000)] = 2
    batch = [0] * len(buckets)
    batch[bucket_of(9000)] = 1
    drained = [SimpleNamespace(lookups=5, hits=1, misses=2, batches=1, reads=(2, 3100, buckets), batch=(1, 9000, batch))]
    stats = RowStats("engram layer 1 rank 0/1", 0, lambda: 10.0, lambda _line: None, cache_enabled=True)
    stats.attach(lambda: drained.pop() if drained else None)
    taken = stats.take(11.0)
    assert (taken.lookups, taken.hits, taken.misses, taken.batches) == (5, 1, 2, 1)
    assert taken.read_latency.total == 2 and taken.read_latency.max_ns == 3100
    assert taken.read_latency.percentile(0.5) <= 3100 and taken.batch_latency.max_ns == 9000
    assert stats.take(12.0).lookups == 0  # drained once
    with pytest.raises(ValueError, match="a latency histogram has 260 buckets, got 3"):
        LatencyHistogram().add_counts(1, 1, [0, 1, 0])
