"""The guard's projection of the lowest available memory ahead (coordinator/guard/projection.py)
against the stand-in engine's own scheduler and caching allocator (sim/engine.py, sim/allocator.py:
another implementation of the same rules, with segments, splits and merges), and its rules one by
one."""

from __future__ import annotations

import dataclasses
import random
import statistics

import pytest

from coordinator.guard import projection
from coordinator.guard.engine import parse_inflight
from dsv41.admission import GateSettings
from dsv41.cost import CostModel
from dsv41.inflight import InflightRequest
from sim.allocator import CachingAllocator, CountedMemory
from sim.engine import Engine, EngineConfig
from sim.kvpool import KvPool

pytestmark = pytest.mark.unit

MB = 1_000_000
MiB = 1 << 20
# The integration test's and the scenario benchmark's shape: 16 KiB of KV a token, 4 bytes of
# indexer buffer per (chunk x prefix) token, 768-token chunks, the hook from 8192 tokens.
ENGINE = EngineConfig(chunk_tokens=768, max_running=64, prefill_tokens_per_s=20_000.0, decode_tokens_per_s=10.0,
                      bytes_per_token=16_384, max_total_tokens=0, context_length=None, transient_bytes=4.0,
                      empty_cache_tokens=8192)
MODEL = CostModel(token_bytes=16_384, transient_bytes=4.0, chunk_tokens=768, empty_cache_tokens=8192)
BASE = 10**10


def cold_hits(items: list[dict]) -> list[dict]:
    """The listing with each waiting prefix-cache hit listed as a cold prompt, as SGLang alone
    lists it under --schedule-policy fcfs (it matches a request only when it builds its first
    step), and rank 0 does where the adapter's own match failed (adapter/scheduler_requests.py)."""
    return [{**x, "prefilled_tokens": 0, "cached_tokens": 0} if x["state"] == "waiting" else x for x in items]


def error_mb(rng: random.Random, mid_step: bool, ended: bool = False, hook: bool = True,
             gate: int = 0, base: int = BASE, held: list | None = None, cold: bool = False,
             pool: bool = False, high_water: bool = True, pool_tokens: int = 0) -> float:
    """A random queue on the stand-in engine, some chunks in; the projection from its listing
    minus the lowest point the engine then really reaches (MB; above 0: the projection was kind).
    `ended`: the requests done prefilling by then end (their clients stop reading), so what they
    leave in the allocator is in no listing. `hook` False: the prefill_empty_cache hook off.
    `gate`: the admission gate's level on the engine and in the model, on a node of `base`; the
    requests still waiting at the end are appended to `held`. `cold`: a waiting prefix-cache hit
    listed as a cold prompt (cold_hits), not with its match. `pool`: the KV in a pool as SGLang
    keeps it, on the engine (sim/kvpool.py) and in the model; `high_water` False: its listing without
    the pool's high-water mark."""
    config, model = (ENGINE, MODEL) if hook else (dataclasses.replace(ENGINE, empty_cache_tokens=0),
                                                  dataclasses.replace(MODEL, empty_cache_tokens=0))
    if gate:
        config = dataclasses.replace(config, admission=GateSettings(gate, config.bytes_per_token, config.transient_bytes))
        model = dataclasses.replace(model, admission_guard_bytes=gate)
    if pool:
        config = dataclasses.replace(config, kv_pool=True, max_total_tokens=pool_tokens)
        model = dataclasses.replace(model, kv_pool=True, kv_pool_tokens=pool_tokens)
    backing = CountedMemory()
    engine = Engine(config, on_fatal=lambda why: None, clock=lambda: 1.0, allocator=CachingAllocator(backing),
                    node_room=lambda: base - backing.mapped,
                    kv_pool=KvPool(backing, config.bytes_per_token, capacity=pool_tokens) if pool else None)
    for i in range(rng.randint(1, 4)):
        kind = rng.choice(("short", "long", "cached"))
        if kind == "short":
            engine.submit(f"r{i}", rng.randint(300, 8191))
        elif kind == "long":
            engine.submit(f"r{i}", rng.randint(8192, 40_000))
        else:
            prompt = rng.randint(16_384, 90_000)
            engine.submit(f"r{i}", prompt, int(prompt * rng.uniform(0.5, 0.95)))
    for _ in range(rng.randint(0, 30)):
        batch = engine.next_prefill()
        if batch is None:
            break
        engine.end_chunk(batch, engine.allocate_chunk(batch))
    if ended:
        for item in engine.inflight():
            if item["state"] == "decoding":
                engine.finish(engine._requests[item["rid"]], "stop")
    batch = engine.next_prefill() if mid_step else None
    transients = engine.allocate_chunk(batch) if batch is not None else None
    level = base - backing.mapped
    items = cold_hits(engine.inflight()) if cold else engine.inflight()
    listing = parse_inflight({"requests": items, "step_launched_monotonic_s": engine.step_launched_at(),
                              "kv_pool_high_water_tokens": engine.kv_high_water() if high_water else None})
    projected = projection.projected_low(level, listing.requests, [], model,
                                     running_in_level=listing.step_launched_at is not None,
                                     kv_high_water_tokens=listing.kv_high_water_tokens)
    low = level
    if batch is not None:
        engine.end_chunk(batch, transients)
    while (batch := engine.next_prefill()) is not None:
        transients = engine.allocate_chunk(batch)
        low = min(low, base - backing.mapped)
        engine.end_chunk(batch, transients)
    if held is not None:
        held += [item["rid"] for item in engine.inflight() if item["state"] == "waiting"]
    return (projected - low) / MB


@pytest.mark.parametrize("mid_step", [False, True], ids=["between_steps", "a_step_running"])
def test_the_projection_follows_the_engine_to_the_byte(mid_step):
    # 300 seeded queues: short prompts (no hook), long ones and prefix-cache hits (the hook), the
    # waiting hits listed with their matches. The listed requests' prefill so far is replayed to rebuild the
    # allocator's free blocks, and the chunk budget is shared as the scheduler shares it: nothing
    # is left to err by.
    rng = random.Random(7)
    errors = [error_mb(rng, mid_step) for _ in range(300)]
    assert max(abs(e) for e in errors) == 0, sorted(errors)[:3] + sorted(errors)[-3:]


@pytest.mark.parametrize("mid_step", [False, True], ids=["between_steps", "a_step_running"])
def test_with_the_admission_gate_the_projection_holds_back_what_the_ranks_hold_back(mid_step):
    # Nodes of 0.4-1.5 GB and a gate at 150 MB: the ranks hold a request's first piece back while
    # it would go below it, which the projection steps the same way (a held request allocates
    # nothing). Where it differs, it is on purpose and low: a request that could not fit even
    # with every other request's KV given back is counted as starting, for the guard to abort.
    rng = random.Random(5)
    held: list[str] = []
    errors = [error_mb(rng, mid_step, gate=150 * MB, base=rng.randint(400, 1500) * MB, held=held) for _ in range(300)]
    assert max(errors) <= 0, sorted(errors)[-3:]
    assert sum(e == 0 for e in errors) >= 280, sorted(errors)[:20]  # 287 and 285 (exact in all 300 without the rule)
    assert len(held) >= 20  # the gate did hold requests back in these queues (91)


@pytest.mark.parametrize("mid_step", [False, True], ids=["between_steps", "a_step_running"])
def test_a_waiting_prefix_cache_hit_listed_cold_is_charged_as_a_cold_prompt_and_never_kindly(mid_step):
    # The same 300 queues as above, listed as SGLang alone lists them under fcfs (as rank 0 does
    # where the adapter's match failed): a waiting hit looks like a cold prompt of its length. Charged its whole prompt's KV and the buffers of a cold
    # prefill, it is projected lower than it goes (its own first step spans its cached prefix at
    # once, but the last step of a cold prompt of the same length spans as much): never kinder.
    rng = random.Random(7)
    errors = [error_mb(rng, mid_step, cold=True) for _ in range(300)]
    assert max(errors) <= 0, sorted(errors)[-3:]
    assert sum(e < -1 for e in errors) >= 40, sorted(errors)[:12]  # what not knowing the hits costs (85, 79)


@pytest.mark.parametrize("mid_step", [False, True], ids=["between_steps", "a_step_running"])
def test_with_the_gate_a_waiting_hit_listed_cold_can_be_projected_kindly_in_a_few_queues(mid_step):
    # The gate's queues above, the waiting hits listed cold. The gate on the ranks sees the hit's
    # first piece (its buffers span the cached prefix) where the projection sees a cold prompt's
    # first chunk, so which step the gate holds differs, and where the projection has the queue
    # held for good while the rank lets it run, the projection is kind: seen in 3 of 300 queues,
    # by 27 to 71 MB (the guard's own level is 150 MB in the scenarios). This test pins that
    # measurement: more queues or more MB is a change to look at.
    rng = random.Random(5)
    errors = [error_mb(rng, mid_step, gate=150 * MB, base=rng.randint(400, 1500) * MB, cold=True) for _ in range(300)]
    kind = sorted(e for e in errors if e > 0)
    assert len(kind) <= 3 and max(errors) < 75, kind
    assert sum(e < -1 for e in errors) >= 40, sorted(errors)[:12]


def test_with_the_gate_a_request_that_fits_once_others_end_is_held_and_one_that_never_fits_is_counted():
    gated = dataclasses.replace(MODEL, admission_guard_bytes=150 * MB)
    running = InflightRequest("long", 40_000, 39_168, state="prefilling")  # its last chunk to come
    fits = waiting("hit", 61_000, 60_000)  # ~200 MB for its first piece: not now, once "long" is done
    never = waiting("runaway", 200_000)  # 3.3 GB of KV: more than the node and all the others hold
    level = 300 * MB
    alone = projection.projected_low(level, [running], [], gated)
    assert alone > 150 * MB
    assert projection.projected_low(level, [running, fits], [], gated) == alone  # held: it takes nothing ahead
    # without the gate it shares the last step of "long", and the guard would have to abort one of them
    assert projection.projected_low(level, [running, fits], [], MODEL) < 150 * MB
    assert projection.projected_low(level, [running, never], [], gated) < 0  # counted as starting: the guard aborts it


def test_with_the_gate_and_the_kv_pool_what_others_give_back_serves_kv_but_never_buffers():
    # A decoding request holds 30000 tokens of KV (480 MiB). The waiting hit's first piece needs
    # ~190 MB of buffers over its 60k-token prefix: not now. In the caching allocator the
    # decoding request's blocks come back when it ends, so the gate holds the hit until then. In
    # SGLang's pool they stay the pool's and serve KV alone: holding the hit gets it nothing, so
    # it counts as starting, below the guard, and the guard aborts it. With room for its buffers
    # it is held with the pool too.
    decoding = InflightRequest("decoding", 30_000, 30_000, state="decoding")
    hit = waiting("hit", 61_000, 60_000)
    for pool in (False, True):
        model = dataclasses.replace(MODEL, admission_guard_bytes=150 * MB, kv_pool=pool)
        assert projection.projected_low(200 * MB, [decoding], [], model) == 200 * MB  # nothing more to prefill
        low = projection.projected_low(200 * MB, [decoding, hit], [], model)
        assert low == 200 * MB if not pool else low < 150 * MB, (pool, low)
        # 190 MB above the gate: its 187 MB of buffers fit, its 1000 tokens of KV in the pages the
        # decoding request leaves (or its blocks); its first piece (199 MB) waits for that
        assert projection.projected_low(340 * MB, [decoding, hit], [], model) == 340 * MB, pool


@pytest.mark.parametrize("mid_step", [False, True], ids=["between_steps", "a_step_running"])
def test_what_ended_requests_left_is_not_known_and_the_projection_errs_low_by_it(mid_step):
    # Their KV and buffers stay cached and the next prompts reuse them: the projection, which
    # does not know them, takes new memory for those and errs low. Kinder only where a request
    # that ended shared its last step with the next one's first piece (the replay starts that
    # piece on its own): by one LARGE_BUFFER segment at most, in a few queues.
    rng = random.Random(11)
    errors = [error_mb(rng, mid_step, ended=True) for _ in range(300)]
    assert max(errors) <= projection.LARGE_BUFFER / MB + 0.01, sorted(errors)[-3:]
    assert sum(e > 1 for e in errors) <= 6, sorted(errors)[-8:]
    assert sum(e < -1 for e in errors) >= 20, sorted(errors)[:12]  # what is not known, it errs low by


@pytest.mark.parametrize("mid_step", [False, True], ids=["between_steps", "a_step_running"])
@pytest.mark.parametrize("hook", [True, False], ids=["hook", "no_hook"])
def test_with_the_kv_pool_the_projection_follows_the_engine_to_the_byte(mid_step, hook):
    # The same kind of queues with the KV in SGLang's kind of pool on both sides: the KV takes
    # pool pages (never given back, reused by KV alone), the buffers the allocator's segments.
    # Without the hook the long prompts' chunks past UNHOOKED_EXACT_CHUNKS are counted at once,
    # as above: exact for the KV, low for the buffers.
    rng = random.Random(7)
    errors = [error_mb(rng, mid_step, hook=hook, pool=True) for _ in range(300)]
    if hook:
        assert max(abs(e) for e in errors) == 0, sorted(errors)[:3] + sorted(errors)[-3:]
    else:
        assert max(errors) <= 0 and statistics.median(errors) == 0, sorted(errors)[-3:]


@pytest.mark.parametrize("mid_step", [False, True], ids=["between_steps", "a_step_running"])
def test_with_a_sized_kv_pool_requests_wait_for_slots_in_the_projection_as_on_the_engine(mid_step):
    # Pools of 91k-100k slots (every prompt of up to 90k tokens is taken) under queues of up to
    # four prompts: the engine keeps a request that has not started waiting while its rest does
    # not fit in the free slots (SGLang's PrefillAdder), and the projection steps the same rule:
    # still exact. (Before the projection checked the rule ahead of a prompt's middle chunks,
    # one of these queues was projected 870 MB low.)
    rng = random.Random(13)
    held: list[str] = []
    errors = [error_mb(rng, mid_step, pool=True, pool_tokens=rng.randint(91_000, 100_000), held=held)
              for _ in range(300)]
    assert max(abs(e) for e in errors) == 0, sorted(errors)[:3] + sorted(errors)[-3:]
    assert len(held) >= 5, len(held)  # requests did wait for slots in these queues (7)


@pytest.mark.parametrize("mid_step", [False, True], ids=["between_steps", "a_step_running"])
def test_with_the_kv_pool_ended_requests_slots_are_known_from_the_pools_high_water_mark(mid_step):
    # Their slots stay in the pool, free, and the next prompts' KV takes them at no cost. Without
    # the route's kv_pool_high_water_tokens the projection, which does not know them, charges new
    # pages and errs low; with it, it knows the pages are there. Either way kinder only by the
    # buffers of a last step shared with the next prompt's first piece (one LARGE_BUFFER at most),
    # as with the allocator.
    rng = random.Random(11)
    blind = [error_mb(rng, mid_step, ended=True, pool=True, high_water=False) for _ in range(300)]
    assert max(blind) <= 0 and sum(e < -1 for e in blind) >= 60, sorted(blind)[:12]  # 95 and 91, to -308 MB
    rng = random.Random(11)
    known = [error_mb(rng, mid_step, ended=True, pool=True) for _ in range(300)]
    assert max(known) <= projection.LARGE_BUFFER / MB + 0.01, sorted(known)[-3:]
    assert sum(abs(e) > 1 for e in known) <= 4, sorted(known)[:3] + sorted(known)[-3:]  # 3 and 1


def test_with_the_kv_pool_an_aborted_requests_kv_serves_later_kv_but_no_buffer():
    pooled = dataclasses.replace(MODEL, kv_pool=True)
    held = InflightRequest("held", 50_000, 30_720, state="prefilling")  # 480 MiB of KV in the pool
    short = waiting("short", 6_000)                                        # no hook: its buffers stay
    base = 2_000 * MB
    alone = projection.projected_low(base, [short], [], pooled)
    freed = projection.projected_low(base, [short], [held], pooled)
    # its 6000 tokens of KV come from the aborted request's slots: only its buffers take memory
    buffers = base - freed
    assert 0 < buffers < base - alone
    assert base - alone == buffers + 6_000 * 16_384 + (-(6_000 * 16_384) % projection.POOL_PAGE)  # new pages, whole


def test_the_pools_high_water_mark_covers_later_kv_and_is_not_taken_again():
    pooled = dataclasses.replace(MODEL, kv_pool=True)
    short = waiting("short", 6_000)
    level = 2_000 * MB
    blind = level - projection.projected_low(level, [short], [], pooled)
    # 20000 tokens once held (requests that ended since): the short prompt's KV fits in those pages
    known = level - projection.projected_low(level, [short], [], pooled, kv_high_water_tokens=20_000)
    assert blind - known == 6_000 * 16_384 + (-(6_000 * 16_384) % projection.POOL_PAGE)
    # what the listed requests hold is in the level already: the mark takes nothing from it
    decoding = InflightRequest("done", 9_000, 9_000, state="decoding")
    plain = projection.Projection(level, [decoding], pooled)
    marked = projection.Projection(level, [decoding], pooled, kv_high_water_tokens=50_000)
    assert plain.taken == marked.taken > 0
    # the allocator's model has no pool: the mark means nothing to it
    assert projection.projected_low(level, [short], [], MODEL, kv_high_water_tokens=20_000) == \
        projection.projected_low(level, [short], [], MODEL)


def test_without_the_hook_long_prompts_are_counted_at_once_and_never_kindly():
    # Past projection.UNHOOKED_EXACT_CHUNKS chunks a prompt without the hook is not stepped (a
    # decision projects many sets): every chunk's KV and buffers count as new segments that stay.
    rng = random.Random(5)
    errors = [error_mb(rng, mid_step=True, hook=False) for _ in range(100)]
    assert max(errors) <= 0, sorted(errors)[-3:]
    assert statistics.median(errors) == 0 and min(errors) < -100  # the short ones exact, the long ones low


def waiting(rid: str, prompt: int, cached: int = 0) -> InflightRequest:
    return InflightRequest(rid, prompt, cached, 0.0, "waiting", cached, 0, 0)


def test_a_short_prompt_reuses_the_buffers_the_one_before_it_left_at_the_same_prefixes():
    one = projection.projected_low(BASE, [waiting("a", 6144)], [], MODEL)
    two = projection.projected_low(BASE, [waiting("a", 6144), waiting("b", 6144)], [], MODEL)
    kv = 8 * segment(768 * MODEL.token_bytes)
    buffers = sum(int(4.0 * 768 * p) for p in range(768, 6145, 768))  # 85 MB over 8 chunks
    extra = (one - two) - kv
    # the second adds its KV and only what its KV took of the first's cached buffers (best fit;
    # here one 20 MiB segment), as the stand-in's allocator has it
    assert 0 <= extra < buffers / 4, (extra, buffers)
    assert BASE - two == engine_peak([6144, 6144]) and BASE - one == engine_peak([6144])


def test_a_long_prompt_starts_from_an_empty_cache_and_its_low_is_at_its_last_chunk():
    long = waiting("l", 30 * 768)
    alone = projection.projected_low(BASE, [long], [], MODEL)
    kv = 30 * segment(768 * MODEL.token_bytes)
    assert alone == BASE - kv - segment(int(4.0 * 768 * 30 * 768))
    # a long prompt after it: the hook returned the first one's buffers before its chunks
    second = waiting("m", 20 * 768)
    both = projection.projected_low(BASE, [long, second], [], MODEL)
    assert both == BASE - kv - 20 * segment(768 * MODEL.token_bytes) - segment(int(4.0 * 768 * 20 * 768))
    # a short prompt before a long one leaves its buffers cached, but none of them is stacked on
    # the long one's peak beyond the segments they share with its KV
    after_short = projection.projected_low(BASE, [waiting("s", 4 * 768), long], [], MODEL)
    assert alone - 4 * segment(768 * MODEL.token_bytes) - 2 * projection.LARGE_BUFFER <= after_short \
        <= alone - 4 * segment(768 * MODEL.token_bytes)


def test_an_aborted_requests_kv_is_reused_by_the_kept_ones():
    held = InflightRequest("gone", 40 * 768, 20 * 768, 0.0, "prefilling", 0, 0, 0)
    kept = [waiting("w", 20 * 768)]
    assert projection.projected_low(BASE, kept, [held], MODEL) == BASE - projection.segment_size(int(4.0 * 768 * 20 * 768))


def test_the_running_step_counts_as_taken_only_when_the_level_was_sampled_after_its_launch():
    running = InflightRequest("r", 40 * 768, 10 * 768, 0.0, "prefilling", 0, 768, 0)
    before = projection.projected_low(BASE, [running], [], MODEL)
    after = projection.projected_low(BASE, [running], [], MODEL, running_in_level=True)
    # after its launch the level holds the chunk's KV, and its buffers' segment, which the hook
    # returns once the step ends (the chunk before's went back when it ended)
    chunk_kv = segment(768 * MODEL.token_bytes)
    buffers = segment(int(4.0 * 768 * 11 * 768))
    assert after - before == chunk_kv + buffers
    # before it, what the level holds is the chunk before's buffers (the hook returns them next)
    nothing_done = InflightRequest("r", 40 * 768, 0, 0.0, "prefilling", 0, 768, 0)
    assert projection.projected_low(BASE, [nothing_done], [], MODEL) < before


def test_small_kv_chunks_share_segments():
    def kv_only(token_bytes, chunk, tokens):
        model = CostModel(token_bytes=token_bytes, transient_bytes=0.0, chunk_tokens=chunk, empty_cache_tokens=0)
        return BASE - projection.projected_low(BASE, [waiting("k", tokens)], [], model)
    assert kv_only(10_000, 1000, 4000) == 2 * projection.LARGE_BUFFER  # 10 MB a chunk, two to a segment
    assert kv_only(16_384, 768, 768 * 3) == 3 * 12 * MiB                # 12 MiB chunks, their own
    # the last token's 16 KiB is a small-pool request: a 2 MiB segment, as torch's allocator makes
    # (bench/allocator_fidelity on a GPU), not a 20 MiB large one
    assert kv_only(16_384, 768, 768 * 3 + 1) == 3 * 12 * MiB + projection.SMALL_BUFFER
    assert kv_only(16_384, 768, 768 * 3 + 64) == 3 * 12 * MiB + projection.SMALL_BUFFER  # 1 MiB: still small
    assert kv_only(16_384, 768, 768 * 3 + 65) == 3 * 12 * MiB + projection.LARGE_BUFFER  # past it: large


def test_small_requests_come_from_the_small_pool_alone():
    memory = projection._Allocator(0)
    big = memory.malloc(12 * MiB)       # a large segment of its own
    memory.free(big)                    # free and cached: a small request does not take it
    small = memory.malloc(300_000)
    assert -memory.available == 12 * MiB + projection.SMALL_BUFFER
    second = memory.malloc(700_000)     # the rest of the small segment serves it (split down to 512 bytes)
    assert -memory.available == 12 * MiB + projection.SMALL_BUFFER
    memory.malloc(2 * MiB)              # large: the cached 12 MiB block, split
    assert -memory.available == 12 * MiB + projection.SMALL_BUFFER
    memory.free(small)
    memory.free(second)
    memory.empty_cache()                # the wholly free small segment goes back; the split large one stays
    assert -memory.available == 12 * MiB


def segment(nbytes: int) -> int:
    return projection.segment_size(nbytes)


def engine_peak(prompts: list[int]) -> int:
    """What the stand-in engine takes at its highest prefilling these prompts queued together."""
    backing = CountedMemory()
    engine = Engine(ENGINE, on_fatal=lambda why: None, clock=lambda: 1.0, allocator=CachingAllocator(backing))
    for i, n in enumerate(prompts):
        engine.submit(f"r{i}", n)
    peak = 0
    while (batch := engine.next_prefill()) is not None:
        transients = engine.allocate_chunk(batch)
        peak = max(peak, backing.mapped)
        engine.end_chunk(batch, transients)
    return peak
