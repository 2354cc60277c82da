import queue
import threading

import pytest

from sim.engine import Engine, EngineConfig, Phase, Rejected, plan_chunk
from sim.memory import ChunkMemory

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


def make(chunk=256, max_running=8, bytes_per_token=4096, context_length=None):
    steps, clock, fatal = SchedulerSteps(), Clock(), []
    engine = Engine(EngineConfig(chunk_tokens=chunk, max_running=max_running, prefill_tokens_per_s=1000.0,
                                 decode_tokens_per_s=1e6, bytes_per_token=bytes_per_token, max_total_tokens=10000,
                                 context_length=context_length),
                    on_fatal=fatal.append, clock=clock, sleep=steps)
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


def test_prefill_runs_in_chunks_at_the_rate_and_holds_memory_per_token():
    engine, steps, _, _ = make()
    request = engine.submit("r1", 1000)
    assert steps.next_chunk() == pytest.approx(0.256)  # 256 tokens at 1000 tokens/s
    assert request.prefilled == 0 and request.memory.nbytes == 0
    for done in (256, 512, 768):
        steps.finish()
        duration = steps.next_chunk()  # the next chunk started: the previous one is accounted
        assert request.prefilled == done and request.phase is Phase.PREFILL
        assert request.memory.nbytes == done * 4096
    assert duration == pytest.approx(0.232)
    steps.finish()
    engine.wait_prefilled(request)
    assert request.phase is Phase.DECODE and request.prefilled == 1000
    assert request.memory.nbytes == 1000 * 4096
    assert engine.next_token(request) and request.generated == 1
    engine.finish(request, "stop")
    assert request.finish_reason == "stop" and request.memory.nbytes == 0 and engine.inflight() == []
    engine.close()


def test_an_abort_takes_effect_at_the_next_chunk_boundary_and_frees_the_memory():
    engine, steps, _, _ = make()
    request = engine.submit("long", 10_000)
    steps.next_chunk()
    steps.finish()
    steps.next_chunk()  # second chunk in progress, first one holds memory
    assert request.memory.nbytes == 256 * 4096
    assert engine.abort("long") == ["long"]
    assert request.phase is Phase.PREFILL and [r["rid"] for r in engine.inflight()] == ["long"]
    steps.finish()  # the chunk boundary
    engine.wait_prefilled(request)
    assert request.finish_reason == "abort" and request.phase is Phase.FINISHED
    assert request.memory.nbytes == 0 and request.prefilled == 256
    assert engine.inflight() == []
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
    assert load["max_running_requests"] == 1 and load["max_total_num_tokens"] == 10000
    steps.finish()
    steps.next_chunk()
    load = engine.loads()
    assert load["num_used_tokens"] == 256 and load["token_usage"] == pytest.approx(0.0256)
    assert load["memory_bytes"] == 256 * 4096
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
    assert entry == {"rid": "r1", "prompt_tokens": 1000, "prefilled_tokens": 256, "age_s": 2.5}
    assert [type(entry[k]) for k in ("rid", "prompt_tokens", "prefilled_tokens", "age_s")] == [str, int, int, float]
    engine.abort("r1")
    steps.finish()
    engine.close()


def test_rejections():
    engine, steps, _, _ = make(context_length=100)
    with pytest.raises(Rejected) as too_long:
        engine.submit("big", 101)
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
    assert request.finish_reason == "abort" and request.memory.nbytes == 0 and request.generated == 1
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
    engine, steps, _, fatal = make(bytes_per_token=1 << 40)  # 256 TiB for the first chunk
    engine.submit("huge", 1000)
    steps.next_chunk()
    steps.finish()
    engine._thread.join(5)
    assert len(fatal) == 1 and "out of memory prefilling request huge" in fatal[0]


def test_chunk_memory_is_resident_and_goes_back_to_the_os():
    memory = ChunkMemory()
    before = rss_anon_kib()
    for _ in range(4):
        memory.grow(16 * MiB)
    grown = rss_anon_kib()
    assert memory.nbytes == 64 * MiB
    assert grown - before >= 60 * 1024
    memory.release()
    memory.release()  # idempotent
    assert memory.nbytes == 0
    assert rss_anon_kib() - before < 8 * 1024


def test_the_time_spent_touching_memory_counts_toward_the_next_chunk():
    engine, steps, clock, _ = make()

    class SlowTouch(Clock):
        # every reading on the scheduler thread is 0.1 s after the previous one
        def __call__(self):
            if threading.current_thread().name == "scheduler":
                self.now += 0.1
            return self.now

    engine._clock = SlowTouch()
    engine.submit("r", 1000)
    assert steps.next_chunk() == pytest.approx(0.256)
    steps.finish()
    assert steps.next_chunk() == pytest.approx(0.156)
    engine.abort("r")
    steps.finish()
    engine.close()
