"""The additive cost model (coordinator/guard/additive.py, CostModel.replay False): each request
charged its own bytes, summed, as the guard's projection when the allocator is not replayed."""

from __future__ import annotations

import dataclasses

import pytest

from coordinator.guard import charge
from coordinator.guard.additive import AdditiveProjection
from coordinator.guard.projection import Projection
from dsv41.cost import CostModel
from dsv41.inflight import DECODING, PREFILLING, WAITING, InflightList, InflightRequest

pytestmark = pytest.mark.unit

MB = 1_000_000
MODEL = CostModel(token_bytes=16_384, transient_bytes=4.0, chunk_tokens=768, empty_cache_tokens=8192, replay=False)
LEVEL = 2_000 * MB


def test_the_switch_picks_the_projection():
    listing = InflightList((InflightRequest("a", 4_000, 0, state=WAITING),))
    assert isinstance(charge.projector(listing, LEVEL, MODEL, False), AdditiveProjection)
    assert isinstance(charge.projector(listing, LEVEL, dataclasses.replace(MODEL, replay=True), False), Projection)


def test_low_is_the_kept_requests_bytes_summed():
    hooked = InflightRequest("long", 20_000, 0, state=WAITING)      # past the hook: its last chunk's buffers
    short = InflightRequest("short", 3_000, 0, state=WAITING)       # unhooked: every chunk's buffers
    low = AdditiveProjection(LEVEL, [hooked, short], MODEL).low([hooked, short], [])
    assert low == LEVEL - MODEL.kv_to_come(hooked) - MODEL.kv_to_come(short) \
        - MODEL.transient_peak(hooked) - MODEL.transient_peak(short)


def test_an_aborted_request_leaves_its_kv_to_the_others_kv_alone():
    done = InflightRequest("done", 10_000, 10_000, state=DECODING)
    small = InflightRequest("small", 1_000, 0, state=WAITING)
    projection = AdditiveProjection(LEVEL, [done, small], MODEL)
    # its KV covers the newcomer's KV, never its buffers
    assert projection.low([small], [done]) == LEVEL - MODEL.transient_peak(small)
    assert projection.low([small], []) == LEVEL - MODEL.to_come(small)


def test_the_running_chunk_in_the_level_is_not_charged_again():
    growing = InflightRequest("g", 4_000, 768, state=PREFILLING, chunk_tokens=768)
    before = AdditiveProjection(LEVEL, [growing], MODEL, running_in_level=False)
    after = AdditiveProjection(LEVEL, [growing], MODEL, running_in_level=True)
    assert after.low([growing], []) - before.low([growing], []) == MODEL.token_bytes * 768 \
        + int(MODEL.transient_bytes * 768 * 1536)  # its KV and its (unhooked, kept) buffers
    assert after.taken > before.taken


def test_the_guard_chooses_with_it():
    reqs = (InflightRequest("done", 20_000, 20_000, 9.0, DECODING),
            InflightRequest("big", 60_000, 0, 1.0, WAITING))
    choice = charge.choose(InflightList(reqs), 500 * MB, 150 * MB, MODEL)
    assert [v.request.rid for v in choice.victims] == ["big"]
    assert choice.projected_low >= 150 * MB > choice.projected_low_keeping_all


def test_the_gate_holds_a_waiting_request_that_would_leave_less_than_its_level():
    gated = dataclasses.replace(MODEL, admission_guard_bytes=150 * MB)
    growing = InflightRequest("g", 1_000, 768, 2.0, PREFILLING)      # its last 232 tokens share w's step
    waiting = InflightRequest("w", 500, 0, 1.0, WAITING)             # fits once g ends and gives its KV back
    listing = InflightList((growing, waiting))
    assert charge.held_back(listing, 155 * MB, gated) == {"w"}
    assert charge.held_back(listing, 2_000 * MB, gated) == set()


def test_a_pool_of_limited_slots_grows_no_further_than_its_size():
    pooled = dataclasses.replace(MODEL, kv_pool=True, kv_pool_tokens=10_000)
    waiting = [InflightRequest(f"w{i}", 8_000, 0, state=WAITING) for i in range(3)]
    projection = AdditiveProjection(LEVEL, waiting, pooled)
    unbounded = AdditiveProjection(LEVEL, waiting, dataclasses.replace(pooled, kv_pool_tokens=0))
    buffers = sum(pooled.transient_peak(r) for r in waiting)
    assert projection.low(waiting, []) == LEVEL - 10_000 * pooled.token_bytes - buffers
    assert unbounded.low(waiting, []) == LEVEL - 3 * 8_000 * pooled.token_bytes - buffers
