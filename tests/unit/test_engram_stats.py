"""Latency histogram used by the row store's statistics line."""

from __future__ import annotations

import random

import pytest

from adapter.engram.stats import LatencyHistogram, bucket_of, bucket_upper, format_duration

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
