"""The KV pool's check against the guard (coordinator/guard/poolfit.py), and the runner's warning."""

from __future__ import annotations

import dataclasses

import pytest

from coordinator.guard import policy as p
from coordinator.guard.poolfit import largest_fit, pool_fit
from dsv41.cost import CostModel
from dsv41.v1 import agent_pb2 as pb
from tests.unit.test_guard_runner import SETTINGS, rig, wait_all_handled  # noqa: F401 - the runner's rig

pytestmark = pytest.mark.unit
GB = 1_000_000_000
# The head as the example configuration has it: 12 kB of KV a token, 20 B of indexer buffer per
# (chunk x prefix) token, 768-token chunks, a 750k-token pool, 262144-token prompts.
HEAD = CostModel(12_000, 20.0, 768, 8192, kv_pool=True, kv_pool_tokens=750_000)


def test_the_example_pool_does_not_fit_a_head_with_6_gb_above_the_guard_and_the_largest_that_does_is_given():
    misfit = pool_fit("spark1", 7_500_000_000, 1_500_000_000, HEAD, 262_144)
    assert misfit is not None and misfit.room_bytes == 6 * GB
    assert misfit.pool_bytes == 9 * GB and misfit.buffers_bytes == 20 * 768 * 262_144
    # the largest pool: its KV and its own longest prompt's last chunk (768 x N x 20 B) in 6 GB
    n = misfit.fits_tokens
    assert n * 12_000 + 20 * 768 * n <= 6 * GB < (n + 1) * 12_000 + 20 * 768 * (n + 1)
    assert n == 219_298  # near the 208k-token prompt the example's notes say the head holds
    text = misfit.message()
    assert "750000 tokens (MAX_TOTAL_TOKENS) takes 9.00 GB" in text and "6.00 GB above the guard" in text
    assert "at most 219298 tokens fits: set MAX_TOTAL_TOKENS (and CONTEXT_LENGTH, which may not exceed it)" in text


def test_a_pool_that_fits_says_nothing_nor_does_a_pool_that_is_not_sglangs():
    small = dataclasses.replace(HEAD, kv_pool_tokens=150_000)
    assert pool_fit("spark1", 7_500_000_000, 1_500_000_000, small, 150_000) is None  # 1.8 + 2.3 GB in 6
    assert pool_fit("spark1", 1_600_000_000, 1_500_000_000, dataclasses.replace(HEAD, kv_pool=False), 262_144) is None
    assert pool_fit("spark1", 1_600_000_000, 1_500_000_000, dataclasses.replace(HEAD, kv_pool_tokens=0), 262_144) is None


def test_with_room_for_a_whole_context_the_rest_is_pool():
    # 20 GB of room: a 262144-token prompt's buffers (4 GB) and a pool of (20 - 4) GB / 12 kB
    assert largest_fit(20 * GB, HEAD, 262_144) == (20 * GB - 20 * 768 * 262_144) // 12_000
    assert largest_fit(-1, HEAD, 262_144) == 0  # below the guard already: nothing fits


def test_the_runner_warns_once_per_node_when_serving_begins(rig):  # noqa: F811
    settings = p.GuardSettings(**{**SETTINGS.__dict__, "cost": HEAD, "context_tokens": 262_144})
    guard, rank0, source, journal, stops, state = rig([], settings=settings)
    assert source.opened.wait(2)
    for i in range(3):
        source.streams[-1].q.put(pb.MemorySample(at_monotonic_s=i * 0.02, available_bytes=7 * GB))
    event = journal.wait_for("kv_pool_too_large")
    assert event["PRIORITY"] == "4" and event["DSV41_KV_POOL_FITS_TOKENS"] == str(largest_fit(7 * GB - 150_000_000,
                                                                                             HEAD, 262_144))
    wait_all_handled(guard, 3)
    assert journal.kinds().count("kv_pool_too_large") == 1 and rank0.aborts == []
