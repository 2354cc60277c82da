"""The cost model's account of a fall between two listings (coordinator/guard/account.py): what
the replay of the listed requests takes from the system, against the stand-in engine's own
allocator, and what the guard makes of it close to running out."""

from __future__ import annotations

import dataclasses
import random

import pytest

from coordinator.guard import account
from coordinator.guard import policy as p
from coordinator.guard.engine import parse_inflight
from coordinator.guard.projection import Projection
from sim.allocator import CachingAllocator, CountedMemory
from sim.engine import Engine
from tests.unit.test_guard_policy import SIM
from tests.unit.test_guard_progress import CONFIRMED, GROWING, LEVEL, URGENT, decoding
from tests.unit.test_guard_projection import ENGINE, MODEL

pytestmark = pytest.mark.unit

MB = 1_000_000


def test_what_the_replay_takes_is_what_the_engines_allocator_took_to_the_byte():
    # Random queues (short prompts, long ones, prefix-cache hits) stepped on the stand-in's engine:
    # between steps the replay of the listing takes from the system exactly what the engine's
    # caching allocator mapped, so the difference of two listings' accounts is the fall the node
    # shows when nothing else moves.
    rng = random.Random(3)
    checked = 0
    for _ in range(100):
        backing = CountedMemory()
        engine = Engine(ENGINE, on_fatal=lambda why: None, clock=lambda: 1.0, allocator=CachingAllocator(backing))
        for i in range(rng.randint(1, 4)):
            prompt = rng.choice((rng.randint(300, 8191), rng.randint(8192, 40_000)))
            engine.submit(f"r{i}", prompt, int(prompt * rng.uniform(0.5, 0.95)) if rng.random() < 0.3 else 0)
        for _ in range(rng.randint(1, 40)):
            batch = engine.next_prefill()
            if batch is None:
                break
            engine.end_chunk(batch, engine.allocate_chunk(batch))
            listing = parse_inflight({"requests": engine.inflight(), "step_launched_monotonic_s": None})
            assert Projection(10**10, listing.requests, MODEL).taken == backing.mapped
            checked += 1
    assert checked > 500


def at(t: float, level_mb: float, taken_mb: float, node: str = "spark1") -> account.Account:
    return account.Account(node, t, int(level_mb * MB), int(taken_mb * MB))


@pytest.mark.parametrize("case, before, now, explained, says", [
    ("fell what was charged", at(1.0, 900, 100), at(1.2, 800, 200), True, "as the model charges"),
    ("within the slack", at(1.0, 900, 100), at(1.2, 786, 200), True, "as the model charges"),
    ("twice what was charged", at(1.0, 900, 100), at(1.2, 700, 200), False, "more than the 0.100 GB"),
    ("nothing charged", at(1.0, 900, 100), at(1.2, 850, 100), False, "more than the 0.000 GB"),
    ("no fall", at(1.0, 800, 100), at(1.2, 800, 200), False, "did not fall"),
    ("another node's", at(1.0, 900, 100, "spark2"), at(1.2, 800, 200), False, "no earlier listing"),
    ("none before", None, at(1.2, 800, 200), False, "no earlier listing"),
])
def test_a_fall_is_explained_when_the_node_fell_no_further_than_the_model_charged(case, before, now, explained,
                                                                                   says):
    ok, text = account.explains(before, now)
    assert (ok, says in text) == (explained, True), (case, text)


def urgent_with(fell_mb: float, charged_mb: float, state: p.GuardState = CONFIRMED):
    # The urgent moment of test_guard_progress (memory gone in 0.42 s at this rate, the model
    # saying the request growing fits), with no prefill seen progressing, and the last listing
    # 0.1 s before: the node fell fell_mb since, where the model charges the steps charged_mb.
    listing = p.InflightList((GROWING, decoding("chat", 2000)))
    mine = account.account("spark1", 5.0, LEVEL, listing, SIM.cost, running_in_level=False)
    before = account.Account("spark1", 4.9, LEVEL + int(fell_mb * MB), mine.taken - int(charged_mb * MB))
    return p.decide(SIM, state.evolve(accounts=(before,)), URGENT, 5.0, listing)


def test_close_to_running_out_a_fall_the_model_has_just_accounted_for_is_held():
    d, state = urgent_with(fell_mb=50, charged_mb=50)
    assert d.kind == p.Kind.HOLD, d
    assert "memory fell 0.050 GB in 0.10 s, as the model charges the steps listed (0.050 GB)" in d.reason, d.reason
    assert "though memory would run out in 0.42 s at this rate" in d.reason, d.reason
    # the listing's own account is kept for the next check
    (kept,) = state.looks.accounts
    assert (kept.node, kept.at, kept.level) == ("spark1", 5.0, LEVEL)


@pytest.mark.parametrize("case, fell_mb, charged_mb, state", [
    ("the node fell twice what the model charged", 100, 50, CONFIRMED),
    ("the model charged nothing", 50, 0, CONFIRMED),
    ("the model failed earlier in this fall", 50, 50, CONFIRMED.evolve(model_failed=True)),
])
def test_close_to_running_out_a_fall_the_model_does_not_account_for_aborts_the_request_growing(case, fell_mb,
                                                                                             charged_mb, state):
    d, _ = urgent_with(fell_mb, charged_mb, state)
    assert d.kind == p.Kind.ABORT and d.victim.rid == "short", (case, d)
    assert "as the model charges" not in d.reason
