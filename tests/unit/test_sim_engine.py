import queue
import threading

import pytest

from sim.allocator import SMALL_BUFFER, AnonymousMemory, CachingAllocator, CountedMemory, segment_size
from sim.engine import Engine, EngineConfig, Phase, Rejected, input_refusal, plan_chunk
from sim.kvpool import KvPool

pytestmark = pytest.mark.unit

MiB = 1 << 20


def rss_anon_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))


class SchedulerSteps:
    """A sleep that holds the scheduler thread until the test lets one prefill chunk finish; the
    decode steps (a microsecond each at the 1e6 tokens/s these tests decode at) go through."""

    def __init__(self):
        self.calls = queue.Queue()
        self._go = threading.Semaphore(0)

    def __call__(self, seconds):
        if threading.current_thread().name == "scheduler" and seconds > 1e-5:
            self.calls.put(seconds)
            self._go.acquire()

    def next_chunk(self):
        """Waits for the scheduler to start a chunk; returns its duration without letting it finish."""
        return self.calls.get(timeout=5)

    def finish(self):
        self._go.release()


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def make(chunk=256, max_running=8, bytes_per_token=4096, context_length=None, transient_bytes=0.0,
         empty_cache_tokens=0, backing=None):
    steps, clock, fatal = SchedulerSteps(), Clock(), []
    engine = Engine(EngineConfig(chunk_tokens=chunk, max_running=max_running, prefill_tokens_per_s=1000.0,
                                 decode_tokens_per_s=1e6, bytes_per_token=bytes_per_token, max_total_tokens=100000,
                                 context_length=context_length, transient_bytes=transient_bytes,
                                 empty_cache_tokens=empty_cache_tokens),
                    on_fatal=fatal.append, clock=clock, sleep=steps,
                    allocator=CachingAllocator(backing or CountedMemory()))
    engine.start()
    return engine, steps, clock, fatal


@pytest.mark.parametrize("pending, budget, batch", [
    ([("a", 1000), ("b", 300)], 768, [("a", 768)]),
    ([("a", 100), ("b", 1000)], 768, [("a", 100), ("b", 668)]),
    ([("a", 100), ("b", 1000)], -1, [("a", 100), ("b", 1000)]),
    ([("a", 0), ("b", 10)], 768, [("b", 10)]),
    ([], 768, []),
])
def test_plan_chunk_is_fcfs_within_the_budget(pending, budget, batch):
    assert plan_chunk(pending, budget) == batch


@pytest.mark.parametrize("pending, budget, free, chunked, batch", [
    # a new request goes in only while the free slots exceed its whole rest (not just its chunk)
    ([("a", 1000)], 768, 1001, False, [("a", 768)]),
    ([("a", 1000)], 768, 1000, False, []),
    ([("a", 100), ("b", 1000)], 768, 1200, False, [("a", 100), ("b", 668)]),
    ([("a", 100), ("b", 1000)], 768, 1100, False, [("a", 100)]),  # b's 1000 is not < 1000 left
    ([("a", 2000), ("b", 10)], 768, 1500, False, []),  # FCFS: b waits behind a
    # the chunked request goes on, cut to the free slots, or a whole chunk when none is free
    ([("a", 1000), ("b", 10)], 768, 500, True, [("a", 500)]),
    ([("a", 1000)], 768, 0, True, [("a", 768)]),
    ([("a", 1000)], 768, None, False, [("a", 768)]),  # no limit
])
def test_plan_chunk_with_the_kv_pool_admits_as_sglangs_prefill_adder(pending, budget, free, chunked, batch):
    assert plan_chunk(pending, budget, free, chunked) == batch


@pytest.mark.parametrize("prompt, context, pool, refused", [
    (99, 100, 0, "maximum allowed length (94 tokens)"),
    (100, 100, 0, "longer than the model's context length (100 tokens)"),  # the tokenizer's >=
    (93, 100, 0, None),  # context - 1 - 5 = 94
    (94, 100, 0, "exceeds the maximum allowed length (94 tokens)"),
    (993, None, 1000, None),
    (994, None, 1000, "exceeds the maximum allowed length (994 tokens)"),  # the pool - 1 - 5
    (994, 2000, 1000, "Use a shorter input or enable --allow-auto-truncate"),
    (10**9, None, 0, None),  # no limits given
])
def test_input_refusal_follows_sglangs_two_length_checks(prompt, context, pool, refused):
    got = input_refusal(prompt, context, pool)
    assert got is None if refused is None else (got is not None and refused in got)


def test_prefill_runs_in_chunks_at_the_rate_and_holds_memory_per_token():
    engine, steps, _, _ = make()
    request = engine.submit("r1", 1000)
    assert steps.next_chunk() == pytest.approx(0.256)  # 256 tokens at 1000 tokens/s
    # the chunk's KV is allocated when the chunk starts; its progress counts when it ends
    assert request.prefilled == 0 and request.held_bytes == 256 * 4096
    for done in (256, 512, 768):
        steps.finish()
        duration = steps.next_chunk()  # the next chunk started: the previous one is accounted
        assert request.prefilled == done and request.phase is Phase.PREFILL
        assert request.held_bytes == min(1000, done + 256) * 4096
    assert duration == pytest.approx(0.232)
    steps.finish()
    engine.wait_prefilled(request)
    assert request.phase is Phase.DECODE and request.prefilled == 1000
    assert request.held_bytes == 1000 * 4096
    assert engine.next_token(request) and request.generated == 1
    engine.finish(request, "stop")
    assert request.finish_reason == "stop" and request.held_bytes == 0 and engine.inflight() == []
    # the process keeps what the request held: the allocator caches it (its 1 MiB chunks are
    # small-pool requests: two 2 MiB segments, two chunks to each)
    memory = engine.allocator.stats()
    assert memory.allocated == 0 and memory.reserved == 2 * SMALL_BUFFER and memory.segments == 2
    engine.close()


def test_an_abort_takes_effect_at_the_next_chunk_boundary_and_leaves_the_memory_cached():
    engine, steps, _, _ = make()
    request = engine.submit("long", 10_000)
    steps.next_chunk()
    steps.finish()
    steps.next_chunk()  # second chunk in progress: two chunks' KV held
    assert request.held_bytes == 2 * 256 * 4096
    assert engine.abort("long") == ["long"]
    assert request.phase is Phase.PREFILL and [r["rid"] for r in engine.inflight()] == ["long"]
    steps.finish()  # the chunk boundary
    engine.wait_prefilled(request)
    assert request.finish_reason == "abort" and request.phase is Phase.FINISHED
    assert request.held_bytes == 0 and request.prefilled == 256
    assert engine.inflight() == []
    # SGLang's caching allocator keeps the blocks: available memory does not come back by itself
    # (the two 1 MiB chunks share one small-pool segment)
    memory = engine.allocator.stats()
    assert memory.allocated == 0 and memory.reserved == SMALL_BUFFER
    engine.close()


def test_a_repeated_abort_of_the_same_rid_is_dropped_like_the_tokenizer_manager_does():
    engine, steps, _, _ = make()
    engine.submit("long", 10_000)
    steps.next_chunk()
    assert engine.abort("long") == ["long"]
    assert engine.abort("long") == []  # abort_sent: SGLang drops it silently
    assert engine.abort("x", abort_all=True) == ["long"]  # abort_all is not a repeat of the rid
    steps.finish()
    engine.close()


def test_one_request_is_chunk_prefilled_at_a_time_and_the_list_says_who_waits_and_who_grows():
    engine, steps, _, _ = make(chunk=256)
    engine.submit("a", 600)
    engine.submit("b", 600)
    engine.submit("short", 40)
    steps.next_chunk()
    states = {r["rid"]: (r["state"], r["prefilled_tokens"], r["chunk_tokens"]) for r in engine.inflight()}
    assert states == {"a": ("prefilling", 0, 256), "b": ("waiting", 0, 0), "short": ("waiting", 0, 0)}
    steps.finish()
    steps.next_chunk()
    steps.finish()
    steps.next_chunk()  # a's last 88 tokens, then b is cut at the budget: b is the chunked request now
    states = {r["rid"]: (r["state"], r["prefilled_tokens"], r["chunk_tokens"]) for r in engine.inflight()}
    assert states == {"a": ("prefilling", 512, 88), "b": ("prefilling", 0, 168), "short": ("waiting", 0, 0)}
    steps.finish()
    steps.next_chunk()
    states = {r["rid"]: (r["state"], r["prefilled_tokens"], r["chunk_tokens"]) for r in engine.inflight()}
    assert states["a"] == ("decoding", 600, 0) and states["b"] == ("prefilling", 168, 256)
    assert states["short"] == ("waiting", 0, 0)  # it waits behind b's chunks
    engine.abort("", abort_all=True)
    steps.finish()
    engine.close()


def buffer_bytes(k):
    """Chunk k's indexer buffer at 128 bytes per (chunk token, prefix token), 256-token chunks:
    [256, 256 (k + 1)], i.e. 8 (k + 1) MiB."""
    return 128 * 256 * 256 * (k + 1)


def test_the_indexer_buffer_grows_with_the_prefix_and_is_cached_without_the_hook():
    engine, steps, _, _ = make(bytes_per_token=0, transient_bytes=128.0, chunk=256)
    engine.submit("p", 16 * 256)
    reserved = []
    for k in range(16):
        steps.next_chunk()
        memory = engine.allocator.stats()
        assert memory.allocated == buffer_bytes(k)  # the buffer, live during its chunk
        reserved.append(memory.reserved)
        steps.finish()
    engine.abort("p")
    # No cached block of an earlier, smaller chunk fits the next one: once the buffers outgrow the
    # first 20 MiB segment every chunk adds a segment of its own, and the pool keeps them all.
    assert [b - a for a, b in zip(reserved[1:], reserved[2:])] == [buffer_bytes(k) for k in range(2, 16)]
    assert reserved[-1] == 20 * MiB + sum(buffer_bytes(k) for k in range(2, 16))  # 1084 MiB for one prompt
    engine.close()


def test_with_the_empty_cache_hook_a_long_prompt_costs_one_chunk_and_gives_it_back():
    engine, steps, _, _ = make(bytes_per_token=0, transient_bytes=128.0, chunk=256, empty_cache_tokens=2048)
    request = engine.submit("p", 16 * 256)
    for k in range(16):
        steps.next_chunk()
        memory = engine.allocator.stats()
        assert memory.allocated == buffer_bytes(k)
        # only the chunk now running: the hook returned the previous chunks' buffers
        assert memory.reserved == segment_size(buffer_bytes(k))
        steps.finish()
    engine.wait_prefilled(request)
    memory = engine.allocator.stats()
    assert memory.peak_reserved == buffer_bytes(15) and memory.reserved == 0
    engine.close()


def test_the_hook_returns_what_an_aborted_request_left_in_the_cache_before_a_long_prompts_first_chunk():
    engine, steps, _, _ = make(bytes_per_token=64 * 1024, chunk=256, empty_cache_tokens=2048)
    short = engine.submit("short", 1000)  # below the threshold: no hook on its chunks
    for _ in range(4):
        steps.next_chunk()
        steps.finish()
    engine.wait_prefilled(short)
    engine.abort("short")
    assert not engine.next_token(short)
    cached = engine.allocator.stats()
    assert cached.allocated == 0 and cached.reserved >= 1000 * 64 * 1024  # kept by the allocator
    engine.submit("long", 4096)
    # The adapter runs before a long prompt's chunk is launched (adapter/prefill_empty_cache.py):
    # what the aborted short prompt left goes back before the long one's first chunk.
    steps.next_chunk()
    first = engine.allocator.stats()
    assert first.reserved < cached.reserved and first.reserved == first.allocated
    steps.finish()
    steps.next_chunk()  # and the first chunk's buffers before the second
    second = engine.allocator.stats()
    assert second.reserved == second.allocated
    engine.abort("long")
    steps.finish()
    engine.close()


def test_abort_matches_like_sglang_exact_rid_then_prefix():
    engine, steps, _, _ = make(max_running=1)
    a, b, c = engine.submit("req-1", 10_000), engine.submit("req-10", 10), engine.submit("other", 10)
    steps.next_chunk()
    assert engine.abort("req") == []  # no request is called "req": the tokenizer drops it
    assert engine.abort("") == []  # an empty rid without abort_all is ignored
    assert engine.abort("missing") == []
    assert sorted(engine.abort("req-1")) == ["req-1", "req-10"]
    # req-10 was waiting (max_running 1): finished at once; req-1 at the chunk boundary
    assert b.finish_reason == "abort" and a.finish_reason is None
    steps.finish()
    engine.wait_prefilled(a)
    assert a.finish_reason == "abort" and c.finish_reason is None
    assert engine.abort("x", abort_all=True) == ["other"]
    engine.close()


def test_admission_is_bounded_by_max_running_and_loads_report_it():
    engine, steps, _, _ = make(max_running=1)
    engine.submit("a", 1000)
    engine.submit("b", 300)
    steps.next_chunk()
    load = engine.loads()
    assert (load["num_running_reqs"], load["num_waiting_reqs"], load["num_waiting_uncached_tokens"]) == (1, 1, 300)
    assert load["max_running_requests"] == 1 and load["max_total_num_tokens"] == 100000
    steps.finish()
    steps.next_chunk()
    load = engine.loads()
    assert load["num_used_tokens"] == 256 and load["token_usage"] == pytest.approx(0.00256)
    assert load["memory_bytes"] == 512 * 4096  # the second chunk's KV is allocated as it starts
    assert load["memory_reserved_bytes"] == SMALL_BUFFER  # two 1 MiB chunks in one small-pool segment
    engine.abort("", abort_all=True)
    steps.finish()
    engine.close()


def test_inflight_lists_rid_prompt_tokens_progress_and_age():
    engine, steps, clock, _ = make()
    engine.submit("r1", 1000)
    steps.next_chunk()
    clock.now += 2.5
    steps.finish()
    steps.next_chunk()
    (entry,) = engine.inflight()
    assert entry == {"rid": "r1", "prompt_tokens": 1000, "prefilled_tokens": 256, "cached_tokens": 0,
                     "state": "prefilling", "chunk_tokens": 256, "output_tokens": 0, "age_s": 2.5}
    assert [type(entry[k]) for k in ("rid", "prompt_tokens", "prefilled_tokens", "age_s")] == [str, int, int, float]
    engine.abort("r1")
    steps.finish()
    engine.close()


def test_rejections():
    engine, steps, _, _ = make(context_length=100)
    with pytest.raises(Rejected) as too_long:
        engine.submit("big", 100)
    assert too_long.value.status == 400 and "longer than the model's context length (100 tokens)" in str(too_long.value)
    engine.submit("r", 10)
    steps.next_chunk()
    with pytest.raises(Rejected) as duplicate:
        engine.submit("r", 10)
    assert duplicate.value.status == 400 and "Duplicate request ID: r" in str(duplicate.value)
    engine.stop_accepting()
    with pytest.raises(Rejected) as closed:
        engine.submit("late", 10)
    assert closed.value.status == 503
    engine.abort("", abort_all=True)
    steps.finish()
    engine.close()


def test_a_decoding_request_stops_at_the_next_token_when_aborted():
    engine, steps, _, _ = make()
    request = engine.submit("d", 10)
    steps.next_chunk()
    steps.finish()
    engine.wait_prefilled(request)
    assert engine.next_token(request)
    engine.abort("d")
    assert not engine.next_token(request)
    assert request.finish_reason == "abort" and request.held_bytes == 0 and request.generated == 1
    engine.close()


def test_wait_idle_reports_whether_requests_drained():
    engine, steps, _, _ = make()
    request = engine.submit("d", 10)
    steps.next_chunk()
    steps.finish()
    engine.wait_prefilled(request)
    assert not engine.wait_idle(0.05)
    engine.finish(request, "stop")
    assert engine.wait_idle(0.05)
    engine.close()


def test_memory_the_kernel_refuses_kills_the_rank_like_a_cuda_oom():
    # 256 TiB for the first chunk's KV: more than the address space
    engine, steps, _, fatal = make(bytes_per_token=1 << 40, backing=AnonymousMemory())
    engine.submit("huge", 1000)
    engine._thread.join(5)
    assert len(fatal) == 1 and "out of memory prefilling request huge" in fatal[0]


def test_segments_are_resident_cached_when_freed_and_returned_to_the_os_by_empty_cache():
    allocator = CachingAllocator(AnonymousMemory())
    before = rss_anon_kib()
    blocks = [allocator.malloc(16 * MiB) for _ in range(4)]
    assert rss_anon_kib() - before >= 60 * 1024
    for block in blocks:
        allocator.free(block)
    allocator.free(blocks[0])  # a second free is a no-op
    assert allocator.stats().allocated == 0
    assert rss_anon_kib() - before >= 60 * 1024  # the cache keeps it
    assert allocator.empty_cache() == 64 * MiB
    assert rss_anon_kib() - before < 8 * 1024
    assert allocator.stats().reserved == 0


def test_the_allocator_reuses_the_best_fitting_cached_block_and_splits_only_a_large_rest():
    memory = CountedMemory()
    allocator = CachingAllocator(memory)
    small = allocator.malloc(3 * MiB)  # a 20 MiB segment for requests under 10 MiB
    assert memory.mapped == 20 * MiB and small.size == 3 * MiB
    other = allocator.malloc(5 * MiB)  # split from the same segment
    assert memory.mapped == 20 * MiB
    big = allocator.malloc(12 * MiB + 1)  # its own segment, rounded to 2 MiB
    assert memory.mapped == 20 * MiB + 14 * MiB
    allocator.free(big)
    again = allocator.malloc(13 * MiB)  # fits the cached 14 MiB block; the 1 MiB left is not split off
    assert again is big and memory.mapped == 34 * MiB and again.size == 14 * MiB
    bigger = allocator.malloc(15 * MiB)  # nothing cached is big enough
    assert memory.mapped == 34 * MiB + 16 * MiB
    allocator.free(small)
    assert allocator.empty_cache() == 0  # every segment still has a live block
    allocator.free(other)  # the 20 MiB segment's blocks merge back into one free block
    assert allocator.empty_cache() == 20 * MiB
    for block in (again, bigger):
        allocator.free(block)
    assert allocator.empty_cache() == 30 * MiB and memory.mapped == 0
    assert allocator.malloc(0) is None


def test_requests_of_up_to_1_mib_come_from_the_small_pool_alone():
    # c10's get_pool / get_allocation_size / should_split, as torch's own allocator does on a GPU
    # (bench/allocator_fidelity): 2 MiB segments, split down to 512 bytes, never a large block
    memory = CountedMemory()
    allocator = CachingAllocator(memory)
    big = allocator.malloc(12 * MiB)
    allocator.free(big)                      # cached, and free: a small request does not take it
    small = allocator.malloc(300_000)
    assert memory.mapped == 12 * MiB + SMALL_BUFFER and small.segment is not big.segment
    second = allocator.malloc(1 * MiB)       # 1 MiB exactly is still small: the same segment's rest
    assert memory.mapped == 12 * MiB + SMALL_BUFFER and second.segment is small.segment
    third = allocator.malloc(1 * MiB + 1)    # past it: the large pool's cached block
    assert third.segment is big.segment and memory.mapped == 12 * MiB + SMALL_BUFFER
    for block in (small, second):
        allocator.free(block)
    assert allocator.empty_cache() == SMALL_BUFFER and memory.mapped == 12 * MiB


def test_the_time_spent_touching_memory_is_part_of_the_chunk_and_the_excess_is_carried():
    engine, steps, clock, _ = make()

    class SlowTouch(Clock):
        """The first chunk's memory takes 0.3 s to touch: more than the chunk's 0.256 s."""
        readings = 0

        def __call__(self):
            if threading.current_thread().name == "scheduler":
                self.readings += 1
                if self.readings == 2:  # the reading after the first chunk's allocation
                    self.now += 0.3
            return self.now

    engine._clock = SlowTouch()
    engine.submit("r", 1000)
    # the first chunk spent its time touching memory (it sleeps 0); the 0.044 s it overran come
    # off the second chunk
    assert steps.next_chunk() == pytest.approx(0.256 - 0.044)
    engine.abort("r")
    steps.finish()
    engine.close()


def stepped(chunk=256, bytes_per_token=4096, transient_bytes=1.0, empty_cache_tokens=0):
    """An engine whose scheduler the caller steps on its own clock (no thread)."""
    clock, backing = Clock(), CountedMemory()
    engine = Engine(EngineConfig(chunk_tokens=chunk, max_running=8, prefill_tokens_per_s=1000.0,
                                 decode_tokens_per_s=1e6, bytes_per_token=bytes_per_token, max_total_tokens=10000,
                                 context_length=None, transient_bytes=transient_bytes,
                                 empty_cache_tokens=empty_cache_tokens),
                    on_fatal=lambda why: None, clock=clock, allocator=CachingAllocator(backing))
    return engine, clock, backing


def test_a_prefix_cache_hit_is_prefilled_from_the_start_holds_no_kv_for_it_and_its_buffers_span_the_prefix():
    engine, clock, backing = stepped()
    request = engine.submit("hit", 1000, cached_tokens=900)
    (entry,) = engine.inflight()
    # listed with its match while it waits, as the adapter lists a waiting request on SGLang
    assert (entry["prefilled_tokens"], entry["cached_tokens"], entry["state"]) == (900, 900, "waiting")
    batch = engine.next_prefill()
    assert [(r.rid, take) for r, take in batch] == [("hit", 100)]
    transients = engine.allocate_chunk(batch)
    assert request.held_bytes == 100 * 4096  # the KV of its 100 new tokens only
    assert [b.size for b in transients] == [-(-100 * 1000 // 512) * 512]  # [chunk, whole prefix]
    assert engine.inflight()[0]["chunk_tokens"] == 100 and engine.chunk_seconds(batch) == pytest.approx(0.1)
    engine.end_chunk(batch, transients)
    assert request.phase is Phase.DECODE and request.prefilled == 1000
    assert engine.inflight()[0]["cached_tokens"] == 900
    # a prompt wholly in the cache still computes its last token
    assert engine.submit("all", 50, cached_tokens=50).prefilled == 49


def test_the_scheduler_stepped_by_its_caller_prefills_one_request_at_a_time_and_aborts_at_the_boundary():
    engine, clock, backing = stepped(chunk=256)
    a, b = engine.submit("a", 600), engine.submit("b", 300)
    batch = engine.next_prefill()
    assert [(r.rid, take) for r, take in batch] == [("a", 256)]
    transients = engine.allocate_chunk(batch)
    engine.abort("a")
    assert a.phase is Phase.PREFILL  # the chunk runs to its end
    engine.end_chunk(batch, transients)
    batch = engine.next_prefill()  # the boundary: a is finished, its KV back to the allocator's cache
    assert a.phase is Phase.FINISHED and a.finish_reason == "abort" and a.prefilled == 0
    assert [(r.rid, take) for r, take in batch] == [("b", 256)]
    assert backing.mapped == engine.allocator.stats().reserved > engine.allocator.stats().allocated


def test_the_engine_says_when_the_prefill_step_now_running_was_launched():
    now = [100.0]
    config = EngineConfig(chunk_tokens=256, max_running=8, prefill_tokens_per_s=1000.0, decode_tokens_per_s=10.0,
                          bytes_per_token=1024, max_total_tokens=0, context_length=None)
    engine = Engine(config, on_fatal=lambda why: None, clock=lambda: now[0], allocator=CachingAllocator(CountedMemory()))
    engine.submit("r", 600)
    assert engine.step_launched_at() is None
    batch = engine.next_prefill()
    assert engine.step_launched_at() is None  # planned, its memory not taken yet
    now[0] = 100.5
    transients = engine.allocate_chunk(batch)
    assert engine.step_launched_at() == 100.5
    engine.end_chunk(batch, transients)
    assert engine.step_launched_at() is None


def test_the_kv_pool_keeps_what_it_touched_and_reuses_freed_slots_for_kv_alone():
    backing = CountedMemory()
    pool = KvPool(backing, bytes_per_token=4096)
    assert pool.take(512) == 512 and backing.mapped == 2 * MiB  # 2 MiB of slots: one page
    pool.give_back(512)
    assert pool.in_use == 0 and backing.mapped == 2 * MiB  # the pool is never freed
    pool.take(200)  # the freed slots again: nothing new taken
    assert backing.mapped == 2 * MiB
    pool.take(400)  # past the high-water mark: one more page
    assert backing.mapped == 4 * MiB and pool.touched_bytes == 4 * MiB and pool.in_use == 600


def test_with_the_kv_pool_an_aborted_requests_kv_never_comes_back_and_serves_no_buffer():
    clock, backing = Clock(), CountedMemory()
    engine = Engine(EngineConfig(chunk_tokens=256, max_running=8, prefill_tokens_per_s=1000.0,
                                 decode_tokens_per_s=1e6, bytes_per_token=64 * 1024, max_total_tokens=10000,
                                 context_length=None, transient_bytes=16.0, empty_cache_tokens=512, kv_pool=True),
                    on_fatal=lambda why: None, clock=clock, allocator=CachingAllocator(backing),
                    kv_pool=KvPool(backing, 64 * 1024))
    a = engine.submit("a", 1024)
    for _ in range(2):
        batch = engine.next_prefill()
        engine.end_chunk(batch, engine.allocate_chunk(batch))
    assert a.held_bytes == 512 * 64 * 1024 and engine.allocator.stats().reserved == 0  # the hook gave the buffers back
    touched = backing.mapped
    assert touched == engine.kv_pool.touched_bytes == 32 * MiB
    engine.abort("a")
    b = engine.submit("b", 600)
    batch = engine.next_prefill()  # the boundary: a's slots go back to the pool, not to the node
    assert a.phase is Phase.FINISHED and engine.kv_pool.in_use == 0 and backing.mapped == touched
    transients = engine.allocate_chunk(batch)  # b's KV takes a's slots; its buffer is new memory all the same
    assert engine.kv_pool.in_use == 256 and backing.mapped == touched + engine.allocator.stats().reserved
    assert engine.allocator.stats().reserved > 0 and b.held_bytes == 256 * 64 * 1024
    engine.end_chunk(batch, transients)  # the hook: the buffer goes back, the pool stays
    assert backing.mapped == touched


def pooled(capacity, bytes_per_token=1024):
    clock, backing = Clock(), CountedMemory()
    engine = Engine(EngineConfig(chunk_tokens=256, max_running=8, prefill_tokens_per_s=1000.0,
                                 decode_tokens_per_s=1e6, bytes_per_token=bytes_per_token, max_total_tokens=capacity,
                                 context_length=None, kv_pool=True),
                    on_fatal=lambda why: None, clock=clock, allocator=CachingAllocator(backing),
                    kv_pool=KvPool(backing, bytes_per_token, capacity=capacity))
    return engine, backing


def step(engine):
    batch = engine.next_prefill()
    if batch is not None:
        engine.end_chunk(batch, engine.allocate_chunk(batch))
    return [(r.rid, take) for r, take in batch or []]


def test_with_a_sized_kv_pool_a_request_waits_until_its_whole_prompt_fits_then_takes_the_freed_slots():
    engine, backing = pooled(capacity=1000)
    assert engine.kv_pool.capacity == 1000
    with pytest.raises(Rejected) as refused:
        engine.submit("huge", 994)  # SGLang's scheduler refuses what the pool can never hold
    assert refused.value.status == 400 and "maximum allowed length (994 tokens)" in str(refused.value)
    a = engine.submit("a", 600)
    b = engine.submit("b", 500)
    assert step(engine) == [("a", 256)] and step(engine) == [("a", 256)]
    assert step(engine) == [("a", 88)]  # b's 500 does not fit in the 400 slots a leaves: b waits
    assert b.phase is Phase.WAITING and a.phase is Phase.DECODE and engine.kv_pool.in_use == 600
    assert step(engine) == [] and b.phase is Phase.WAITING  # still waiting while a holds its slots
    engine.finish(a, "stop")
    assert step(engine) == [("b", 256)]  # a's slots are free again: b goes in and takes them
    assert engine.kv_pool.in_use == 256 and engine.kv_pool.high_water == 600
    assert backing.mapped == engine.kv_pool.touched_bytes  # nothing new touched: a's pages serve b


def test_with_a_sized_kv_pool_a_step_that_wants_more_slots_than_are_free_ends_the_rank():
    engine, _ = pooled(capacity=1000)
    a = engine.submit("a", 900)
    step(engine)  # a: 256 of 900, chunk-prefilled on
    engine.kv_pool.take(744)  # the rest of the pool taken behind the scheduler's back
    batch = engine.next_prefill()  # a must make progress: a whole chunk is asked for
    assert [(r.rid, take) for r, take in batch] == [("a", 256)]
    with pytest.raises(MemoryError, match="Prefill out of memory: 256 KV slots asked for, 0 of 1000 free"):
        engine.allocate_chunk(batch)
    assert a.phase is Phase.PREFILL
