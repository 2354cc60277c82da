"""How fast the scheduler prefills, from the guard's listings (coordinator/guard/progress.py), and
what the guard makes of it close to running out: a fall that is the end of a prefill is held
when that prefill ends well before memory would, whatever the cost model says."""

from __future__ import annotations

import dataclasses

import pytest

from coordinator.guard import policy as p
from coordinator.guard import progress
from dsv41.cost import CostModel
from tests.unit.test_guard_policy import SIM, actions, sim_engine
from tests.unit.test_guard_traces import MB, run_guard

pytestmark = pytest.mark.unit


def prefilling(rid: str, prompt: int, prefilled: int) -> p.InflightRequest:
    return p.InflightRequest(rid, prompt, prefilled, 1.0, "prefilling", 0, 768, 0)


def waiting(rid: str, prompt: int, cached: int = 0) -> p.InflightRequest:
    return p.InflightRequest(rid, prompt, 0, 0.1, "waiting", cached, 0, 0)


def decoding(rid: str, prompt: int) -> p.InflightRequest:
    return p.InflightRequest(rid, prompt, prompt, 5.0, "decoding", 0, 0, 0)


def test_a_request_is_tracked_from_its_first_sighting_and_a_reused_rid_is_seen_anew():
    first = progress.track((), p.InflightList((prefilling("a", 9000, 1536), waiting("b", 4000))), 10.0)
    assert first == (progress.Sighting("a", 10.0, 1536),)  # a waiting request is not prefilling yet
    later = progress.track(first, p.InflightList((prefilling("a", 9000, 4608), prefilling("b", 4000, 768))), 10.2)
    assert later == (progress.Sighting("a", 10.0, 1536), progress.Sighting("b", 10.2, 768))
    # "a" listed again with fewer tokens: a new request under the same rid; "b" is decoding now
    again = progress.track(later, p.InflightList((prefilling("a", 9000, 768), decoding("b", 4000))), 10.4)
    assert again == (progress.Sighting("a", 10.4, 768),)
    # a listing that could not be had says nothing: what was seen stays
    assert progress.track(again, p.InflightList(unavailable="rank 0 did not answer"), 10.6) == again


def test_a_prefill_ends_at_the_speed_it_was_seen_gaining_tokens():
    seen = (progress.Sighting("a", 10.0, 1536),)
    listing = p.InflightList((prefilling("a", 9000, 5536), decoding("chat", 2000)))
    end = progress.prefills_end(seen, listing, 10.2, 0.04)
    assert end.tokens_per_s == pytest.approx(20_000) and end.seconds == pytest.approx(3464 / 20_000)
    # an aborted request is not what ends, and with none prefilling no prefill ends the fall
    assert progress.prefills_end(seen, listing, 10.2, 0.04, aborted=("a",)).why == "no request is prefilling"
    # the queue behind it follows at the same speed (one request is prefilled at a time)
    queued = p.InflightList((prefilling("a", 9000, 5536), waiting("b", 4000), waiting("c", 600, cached=0)))
    assert progress.prefills_end(seen, queued, 10.2, 0.04).seconds == pytest.approx((3464 + 4600) / 20_000)


@pytest.mark.parametrize("case, seen, now, requests, why", [
    ("a prefix-cache hit waits: its first step is not a rate", (progress.Sighting("a", 10.0, 1536),), 10.2,
     (prefilling("a", 9000, 5536), waiting("b", 40_000, cached=36_000)), "a prefix-cache hit, waits to start"),
    ("seen too briefly", (progress.Sighting("a", 10.19, 1536),), 10.2, (prefilling("a", 9000, 5536),),
     "not seen progressing"),
    ("never seen before", (), 10.2, (prefilling("a", 9000, 5536),), "not seen progressing"),
    ("no token gained: stalled", (progress.Sighting("a", 10.0, 5536),), 10.2, (prefilling("a", 9000, 5536),),
     "not seen progressing"),
])
def test_when_a_prefills_end_cannot_be_told(case, seen, now, requests, why):
    end = progress.prefills_end(seen, p.InflightList(requests), now, 0.04)
    assert end.seconds is None and why in end.why, (case, end)


# Close to running out: 60 MB above the 150 MB guard, falling 500 MB/s, so memory would be gone in
# 0.42 s, within the 0.5 s lead. The cost model says the request growing takes 23 MB more (1392
# tokens of 16 KiB): no abort is needed by it, but that is the model the urgency does not trust.
LEVEL = SIM.guard_bytes + 60 * MB
URGENT = p.Assessment("spark1", LEVEL, True, LEVEL, "slope", -500 * MB, 0.12, 0.77, LEVEL / (500 * MB), at=5.0)
CONFIRMED = p.GuardState.of(marks=(("spark1", p.NodeMark(1, LEVEL, True)),))
GROWING = prefilling("short", 6000, 4608)


def decide_with(seen: tuple[progress.Sighting, ...], *others: p.InflightRequest, state=CONFIRMED):
    return p.decide(SIM, state.evolve(sightings=seen), URGENT, 5.0,
                    p.InflightList((GROWING, *others)))


def test_close_to_running_out_a_prefill_seen_ending_well_before_memory_would_is_held():
    # seen gaining 20k tokens/s: the 1392 tokens left take 0.07 s, twice that is within the 0.42 s
    d, state = decide_with((progress.Sighting("short", 4.9, 2608),), decoding("chat", 2000))
    assert d.kind == p.Kind.HOLD, d
    assert "the prefills growing end in 0.07 s at the 20000 tokens/s seen" in d.reason, d.reason
    assert state.phase == p.Phase.ARMED and state.trust.hold_low is not None
    # a short prompt waiting behind it adds its own tokens at that speed: 0.12 s, still in time
    d, _ = decide_with((progress.Sighting("short", 4.9, 2608),), waiting("next", 1000))
    assert d.kind == p.Kind.HOLD and "end in 0.12 s" in d.reason, d.reason
    # and seen at 10k tokens/s alone: 0.14 s
    d, _ = decide_with((progress.Sighting("short", 4.8, 2608),))
    assert d.kind == p.Kind.HOLD and "end in 0.14 s" in d.reason, d.reason


@pytest.mark.parametrize("case, seen, others, state", [
    # 2k tokens/s: 0.70 s left, memory gone before
    ("seen prefilling slowly", (progress.Sighting("short", 4.0, 2608),), (), CONFIRMED),
    ("a prefix-cache hit waits", (progress.Sighting("short", 4.9, 2608),), (waiting("next", 2500, cached=2000),),
     CONFIRMED),
    # seen at 10k tokens/s: its own 1392 tokens (0.14 s) would be in time, with a 1000-token prompt
    # behind it (0.24 s) twice that is not
    ("the queue behind takes too long", (progress.Sighting("short", 4.8, 2608),), (waiting("next", 1000),),
     CONFIRMED),
    ("never seen progressing", (), (), CONFIRMED),
    # the model erred before in this fall: not trusted at all, whatever the prefill's end
    ("the model failed", (progress.Sighting("short", 4.9, 2608),), (),
     CONFIRMED.evolve(model_failed=True)),
])
def test_close_to_running_out_the_request_growing_is_aborted_unless_its_end_is_seen_in_time(case, seen, others,
                                                                                           state):
    d, _ = decide_with(seen, *others, state=state)
    assert d.kind == p.Kind.ABORT and d.victim.rid == "short", (case, d)
    assert "ends in" not in d.reason


def test_a_cost_model_that_charges_an_eighth_of_the_truth_still_does_not_let_the_node_run_out():
    # 40k tokens at 16 KiB (655 MB) prefilled at 60k tokens/s (0.98 GB/s) on a node 520 MB above
    # the guard; the model charges 2 KiB a token (82 MB: "it fits"). At the first danger memory
    # would run out within the lead, and the prefill's end (0.37 s away) is not within half the
    # time left: the request growing is aborted then, not held until memory has fallen below what
    # the model projected (which, without the urgency, comes 0.14 s and 126 MB later).
    wrong = dataclasses.replace(SIM, cost=CostModel(2_048, 0.0, 768, 8192))
    engine = sim_engine(670 * MB, rate=lambda prefix: 60_000.0).add("big", 0, 40_000)
    out = run_guard(engine, wrong, 5)
    acted = [d for _, d in out.decisions if d.kind in (*p.ACTIONS, p.Kind.HOLD)]
    assert [(d.kind, d.victim.rid if d.victim else None) for d in acted] == [(p.Kind.ABORT, "big")], \
        [d.reason for d in acted]
    assert "do not explain the whole fall" in acted[0].reason and "ends in" not in acted[0].reason
    assert out.lowest >= SIM.guard_bytes + 150 * MB, (out.lowest - SIM.guard_bytes) / MB
