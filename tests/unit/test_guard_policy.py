"""The memory guard's policy on traces: closed loop against the chunked-prefill model of
test_guard_traces (an abort takes effect at the next chunk boundary), plus its small parts."""

from __future__ import annotations

import math

import pytest

from coordinator.guard import policy as p
from tests.unit.test_guard_traces import (GB, GB10_GUARD, MB, Engine, agent_send_policy, gb10_head, prompt_minutes,
                                          run_guard, run_poll)

pytestmark = pytest.mark.unit

# The stand-in engine's shape (tests/integration): 16 KiB per prefilled token, 20k tokens/s,
# 768-token chunks; a small guard on a node limited to ~700 MB.
SIM = p.GuardSettings(guard_bytes=150 * MB, lead_s=0.5, envelope_s=0.25, hysteresis_bytes=50 * MB)


def sim_engine(base: int, **kw) -> Engine:
    return Engine(base=base, chunk=768, rate=lambda prefix: 20_000.0, kv_per_token=16_384, decode_s=2.0, **kw)


def actions(out):
    return [(d.kind, d.victim.rid if d.victim else None) for _, d in out.decisions if d.kind in p.ACTIONS]


# ---------------------------------------------------------------- traces the issue lists

def test_a_slow_climb_that_levels_off_takes_no_action():
    # 5 GB taken over about a minute, levelling off 1.5 GB above the guard, with 20 MB noise.
    climb = lambda t: int(5 * GB * (1 - math.exp(-t / 20)))  # noqa: E731
    out = run_guard(Engine(base=8 * GB, chunk=768, rate=lambda _: 1.0, external=climb), GB10_GUARD, 120,
                    noise=20 * MB)
    assert out.decisions == []
    assert out.lowest < 3.1 * GB  # it did come down to within 1.6 GB of the guard


def test_a_runaway_prefill_is_aborted_before_the_guard_is_crossed():
    engine = sim_engine(700 * MB).add("small", 0, 2_000).add("runaway", 0.5, 60_000)
    out = run_guard(engine, SIM, 8)
    assert actions(out) == [(p.ABORT, "runaway")]
    t, d = out.first(p.ABORT)
    assert d.crossing_s is not None and d.crossing_s > 0  # predicted, not yet crossed
    assert out.lowest >= SIM.guard_bytes
    assert d.victim.prompt_tokens == 60_000 and 0 < d.victim.prefilled_tokens < 60_000
    # the small request was never touched and finished
    small = next(r for r in engine.requests if r.rid == "small")
    assert not small.abort and small.gone


def test_of_two_concurrent_long_prompts_the_larger_is_aborted_and_the_other_completes():
    engine = sim_engine(2_000 * MB, fair=True).add("a60k", 0, 60_000).add("b120k", 0.05, 120_000)
    out = run_guard(engine, SIM, 12)
    assert actions(out) == [(p.ABORT, "b120k")]
    _, d = out.first(p.ABORT)
    assert d.victim.prefilled_tokens > 0  # both were prefilling
    assert out.lowest >= SIM.guard_bytes
    a = next(r for r in engine.requests if r.rid == "a60k")
    assert not a.abort and a.prefilled == 60_000 and a.gone


def test_an_abort_that_does_not_help_escalates_to_abort_all_then_a_clean_stop_before_memory_runs_out():
    # The rank leaks 300 MB/s outside any request: aborting cannot help, stopping the ranks does.
    leak = lambda t: int(max(0.0, t - 1) * 300 * MB)  # noqa: E731
    engine = Engine(base=3_000 * MB, chunk=768, rate=lambda _: 2_000.0, kv_per_token=1_000, external=leak)
    out = run_guard(engine.add("x", 0, 500_000), SIM, 15)
    assert actions(out) == [(p.ABORT, "x"), (p.ABORT_ALL, None), (p.STOP, None)]
    times = [t for t, d in out.decisions if d.kind in p.ACTIONS]
    assert times == sorted(times)
    assert engine.stopped_at is not None
    assert out.lowest > 0  # the node never ran out
    stop = out.first(p.STOP)[1]
    assert "after abort_all" in stop.reason


def test_a_stop_waits_for_the_deadline_when_memory_falls_slowly():
    leak = lambda t: int(max(0.0, t - 1) * 40 * MB)  # noqa: E731
    engine = Engine(base=1_000 * MB, chunk=768, rate=lambda _: 2_000.0, kv_per_token=100, external=leak)
    out = run_guard(engine.add("x", 0, 500_000), SIM, 40)
    kinds = actions(out)
    assert kinds == [(p.ABORT, "x"), (p.ABORT_ALL, None), (p.STOP, None)]
    t_all = out.first(p.ABORT_ALL)[0]
    t_stop = out.first(p.STOP)[0]
    assert t_stop - t_all >= SIM.stop_after_s
    assert out.lowest > 0


def test_noise_above_the_threshold_takes_no_action():
    base = GB10_GUARD.guard_bytes + 200 * MB
    out = run_guard(Engine(base=base, chunk=768, rate=lambda _: 1.0), GB10_GUARD, 60, noise=40 * MB, seed=7)
    assert out.decisions == []


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_noise_around_the_threshold_does_not_flap(seed):
    # Memory drifts down to the guard and sits there with +-40 MB of noise for two minutes.
    drift = lambda t: int(min(t * 10 * MB, 300 * MB))  # noqa: E731
    engine = Engine(base=GB10_GUARD.guard_bytes + 300 * MB, chunk=768, rate=lambda _: 1.0, external=drift)
    out = run_guard(engine, GB10_GUARD, 120, noise=40 * MB, seed=seed)
    assert len(actions(out)) <= 1, out.decisions
    assert p.STOP not in [k for k, _ in actions(out)]


@pytest.mark.parametrize("seed", range(8))
def test_one_burst_does_not_abort_a_healthy_batch(seed):
    # A batch takes 800 MB for 0.3 s, 1.2 GB above the guard, and gives it back.
    start = 5 + seed * 0.0037  # the burst at every phase against the sampling
    burst = lambda t: 800 * MB if start <= t < start + 0.3 else 0  # noqa: E731
    engine = Engine(base=GB10_GUARD.guard_bytes + 1_200 * MB, chunk=768, rate=lambda _: 1.0, external=burst)
    out = run_guard(engine, GB10_GUARD, 10, noise=5 * MB, seed=seed)
    assert out.decisions == []


def test_a_healthy_long_prompt_sawtooth_is_left_alone():
    # 100k at chunk 768 with the decode stack completes on the head (the configuration's note).
    out = run_guard(gb10_head(768).add("p100k", 0, 100_000), GB10_GUARD, 60 * prompt_minutes(100_000, 768) + 5,
                    noise=5 * MB)
    assert out.decisions == []


# ---------------------------------------------------------------- the example configuration's incidents

def test_incident_the_256k_prompt_that_went_20_mb_below_the_1_s_guard_is_aborted_above_the_guard():
    duration = 60 * prompt_minutes(256_000, 1024) + 5
    poll = run_poll(gb10_head(1024, decode_stack=False).add("p256k", 0, 256_000), GB10_GUARD.guard_bytes,
                    duration, phase=0.5)
    assert poll.lowest < GB10_GUARD.guard_bytes  # the replay reproduces the miss
    out = run_guard(gb10_head(1024, decode_stack=False).add("p256k", 0, 256_000), GB10_GUARD, duration,
                    noise=5 * MB)
    assert actions(out) == [(p.ABORT, "p256k")]
    assert out.lowest >= GB10_GUARD.guard_bytes
    _, d = out.first(p.ABORT)
    assert d.basis == "lows"  # seen coming from the chunks' lows, a chunk ahead
    assert d.victim.prompt_tokens == 256_000


def test_incident_the_200k_prompt_at_chunk_1024_that_hung_the_head_is_aborted_above_the_guard():
    duration = 60 * prompt_minutes(200_000, 1024) + 5
    assert gb10_head(1024).add("p200k", 0, 200_000).advance(duration) <= 0  # unguarded: out of memory
    out = run_guard(gb10_head(1024).add("p200k", 0, 200_000), GB10_GUARD, duration, noise=5 * MB)
    assert actions(out) == [(p.ABORT, "p200k")]
    assert out.lowest >= GB10_GUARD.guard_bytes


# ---------------------------------------------------------------- the agent sends only what moved

def _leak(rate_mb: float):
    return lambda t: int(max(0.0, t - 1) * rate_mb * MB)


SEND_TRACES = {
    "runaway": lambda: (sim_engine(700 * MB).add("small", 0, 2_000).add("runaway", 0.5, 60_000), SIM, 8, 0),
    "two prompts": lambda: (sim_engine(2_000 * MB, fair=True).add("a60k", 0, 60_000).add("b120k", 0.05, 120_000),
                            SIM, 12, 0),
    "abort does not help": lambda: (Engine(base=3_000 * MB, chunk=768, rate=lambda _: 2_000.0, kv_per_token=1_000,
                                           external=_leak(300)).add("x", 0, 500_000), SIM, 15, 0),
    "slow stop": lambda: (Engine(base=1_000 * MB, chunk=768, rate=lambda _: 2_000.0, kv_per_token=100,
                                 external=_leak(40)).add("x", 0, 500_000), SIM, 40, 0),
    "incident 200k": lambda: (gb10_head(1024).add("p200k", 0, 200_000), GB10_GUARD,
                              60 * prompt_minutes(200_000, 1024) + 5, 5 * MB),
    "incident 256k, quiet": lambda: (gb10_head(1024, decode_stack=False).add("p256k", 0, 256_000), GB10_GUARD,
                                     60 * prompt_minutes(256_000, 1024) + 5, 0),
    "healthy sawtooth": lambda: (gb10_head(768).add("p100k", 0, 100_000), GB10_GUARD,
                                 60 * prompt_minutes(100_000, 768) + 5, 0),
}


@pytest.mark.parametrize("name", sorted(SEND_TRACES))
def test_sending_only_changes_leaves_the_guards_actions_unchanged(name):
    engine, settings, duration, noise = SEND_TRACES[name]()
    every = run_guard(engine, settings, duration, noise=noise)
    engine, settings, duration, noise = SEND_TRACES[name]()
    changes = run_guard(engine, settings, duration, noise=noise, send=agent_send_policy(settings))
    assert actions(changes) == actions(every)
    acted = lambda out: [(t, d) for t, d in out.decisions if d.kind in p.ACTIONS]  # noqa: E731
    for (t_changes, _), (t_every, d) in zip(acted(changes), acted(every)):
        # A fall slower than min_change_bytes per sample reaches the guard when it adds up to
        # min_change_bytes: the guard acts on memory at most that much lower, never later otherwise.
        late_s = settings.send_change_bytes / abs(d.slope) if d.slope else 0.0
        assert 0 <= t_changes - t_every <= max(late_s, 0.0) + 2 * settings.interval_ms / 1000
    # where every sample kept memory above the guard, so does this; where it did not (a leak that
    # only a stop ends), memory goes at most min_change_bytes lower, acted on that much later
    assert changes.lowest >= min(every.lowest, settings.guard_bytes) - (
        0 if every.lowest >= settings.guard_bytes else settings.send_change_bytes)


def test_a_quiet_node_costs_one_message_per_heartbeat_and_a_runaway_every_sample():
    quiet = run_guard(Engine(base=GB10_GUARD.guard_bytes + 2 * GB, chunk=768, rate=lambda _: 1.0), GB10_GUARD, 30,
                      send=agent_send_policy(GB10_GUARD))
    heartbeats = 30 / (GB10_GUARD.heartbeat_ms / 1000)
    assert heartbeats <= len(quiet.observed) <= heartbeats + 2  # one per heartbeat, not 50 a second
    out = run_guard(sim_engine(700 * MB).add("runaway", 0.5, 60_000), SIM, 3, send=agent_send_policy(SIM))
    aborted_at = out.first(p.ABORT)[0]
    falling = [at for at in out.observed if 0.5 <= at <= aborted_at]
    # the fall is streamed at the sampling rate (the gaps are the sampling's jitter)
    assert len(falling) >= (aborted_at - 0.5) * 1000 / SIM.interval_ms * 0.85
    assert max(b - a for a, b in zip(falling, falling[1:])) < 1.2 * SIM.interval_ms / 1000


# ---------------------------------------------------------------- who is aborted and when

def feed(guard: p.Guard, node: str, levels, t0: float = 0.0, step: float = 0.02, inflight=None):
    decisions = []
    t = t0
    for level in levels:
        t += step
        d = guard.observe(node, t, int(level), t, inflight or (lambda: p.InflightList()))
        decisions.append(d)
    return decisions, t


def ramp(start: float, rate_per_s: float, seconds: float, step: float = 0.02):
    return [start - rate_per_s * step * i for i in range(int(seconds / step))]


def test_without_an_in_flight_list_the_guard_aborts_all_and_says_why():
    guard = p.Guard(SIM)
    decisions, _ = feed(guard, "spark1", ramp(700 * MB, 400 * MB, 2.0),
                        inflight=lambda: p.InflightList(unavailable="GET /dsv41/inflight: 404 (route missing)"))
    acted = [d for d in decisions if d.kind in p.ACTIONS]
    assert acted[0].kind == p.ABORT_ALL and "404" in acted[0].reason and "404" in acted[0].unavailable


def test_when_nothing_is_prefilling_the_guard_aborts_all():
    decoding = p.InflightList((p.InflightRequest("a", 1000, 1000), p.InflightRequest("b", 5000, 5000)))
    guard = p.Guard(SIM)
    decisions, _ = feed(guard, "spark1", ramp(700 * MB, 400 * MB, 2.0), inflight=lambda: decoding)
    acted = [d for d in decisions if d.kind in p.ACTIONS]
    assert acted[0].kind == p.ABORT_ALL and "no request is prefilling" in acted[0].reason


def test_the_in_flight_list_is_only_fetched_when_an_action_needs_it():
    calls = []

    def inflight():
        calls.append(1)
        return p.InflightList((p.InflightRequest("r", 100_000, 10_000),))
    guard = p.Guard(SIM)
    feed(guard, "spark1", [700 * MB] * 200, inflight=inflight)
    assert calls == []
    decisions, _ = feed(guard, "spark1", ramp(700 * MB, 400 * MB, 2.0), t0=5.0, inflight=inflight)
    # one fetch for the abort; the escalations that follow (the ramp ignores it) need no victim
    assert len(calls) == 1 and [d.kind for d in decisions if d.kind in p.ACTIONS] == [p.ABORT, p.ABORT_ALL, p.STOP]


def test_danger_on_a_worker_aborts_and_rearming_waits_for_every_node():
    guard = p.Guard(SIM)
    victim = lambda: p.InflightList((p.InflightRequest("r", 100_000, 10_000),))  # noqa: E731
    t = 0.0
    kinds = []
    for i in range(200):  # the head stays flat at 600 MB; spark2 runs down at 400 MB/s, then the abort works
        t += 0.02
        head = guard.observe("spark1", t, 600 * MB, t, victim)
        level = 700 * MB - 400 * MB * t if t < 1.0 else 650 * MB
        worker = guard.observe("spark2", t, int(level), t, victim)
        kinds += [(d.node, d.kind) for d in (head, worker) if d.kind != p.NONE]
    assert kinds[0] == ("spark2", p.ABORT)
    assert [k for k in kinds if k[1] in p.ACTIONS] == [("spark2", p.ABORT)]
    assert kinds[-1][1] == p.REARM and guard.state.phase == p.ARMED


def test_a_node_still_low_keeps_the_guard_from_rearming():
    guard = p.Guard(SIM)
    victim = lambda: p.InflightList((p.InflightRequest("r", 100_000, 10_000),))  # noqa: E731
    feed(guard, "spark1", ramp(700 * MB, 400 * MB, 1.0), inflight=victim)
    assert guard.state.phase == p.ABORTED
    feed(guard, "spark2", [100 * MB] * 20, t0=1.5)       # a worker sits below the guard, not falling
    feed(guard, "spark1", [700 * MB] * 20, t0=2.0)       # the head is back
    assert guard.state.phase == p.ABORTED                 # not every node is back above guard + band


def test_a_stopped_guard_does_nothing_more():
    state = p.GuardState(phase=p.STOPPED)
    a = p.Assessment("spark1", 0, True, 0, "slope", -1e9, 0.0, 0.5, 0.0)
    for _ in range(5):
        d, state = p.decide(SIM, state, a, 1.0, p.InflightList())
        assert d.kind == p.NONE


def test_choose_victim_takes_the_largest_prefill_and_skips_aborted_and_decoding():
    reqs = p.InflightList((
        p.InflightRequest("decoding-huge", 500_000, 500_000, 9.0),
        p.InflightRequest("mid", 100_000, 50_000, 3.0),
        p.InflightRequest("big-old", 200_000, 190_000, 8.0),
        p.InflightRequest("big-young", 200_000, 190_000, 1.0),
        p.InflightRequest("aborted", 300_000, 1_000, 1.0),
    ))
    assert p.choose_victim(reqs, exclude=["aborted"]).rid == "big-young"
    assert p.choose_victim(reqs, exclude=["aborted", "big-young", "big-old"]).rid == "mid"
    assert p.choose_victim(p.InflightList(reqs.requests[:1])) is None
    assert p.choose_victim(p.InflightList(reqs.requests, unavailable="down")) is None
    tie = p.InflightList((p.InflightRequest("less-left", 1000, 900), p.InflightRequest("more-left", 1000, 100)))
    assert p.choose_victim(tie).rid == "more-left"


# ---------------------------------------------------------------- the trend estimate

def test_fit_line_recovers_a_line_and_has_no_error_on_it():
    fit = p.fit_line([(t / 10, 1e9 - 2e8 * t / 10) for t in range(10)])
    assert fit.slope == pytest.approx(-2e8) and fit.se < 1e-6 * abs(fit.slope)
    assert fit.falling(3.0)
    assert p.fit_line([(0, 1), (1, 2), (2, 3)]) is None
    assert p.fit_line([(1, 1)] * 5) is None


def test_a_step_is_not_a_sustained_fall_but_a_ramp_is():
    trend = p.Trend(SIM)
    readings = [trend.add(i * 0.02, 1_000 * MB if i < 15 else 600 * MB) for i in range(25)]
    assert not any(r.sustained for r in readings)
    trend = p.Trend(SIM)
    readings = [trend.add(i * 0.02, 1_000 * MB - i * 5 * MB) for i in range(25)]
    assert readings[-1].sustained and readings[-1].slope.slope == pytest.approx(-250 * MB)
    assert readings[-1].fall_s >= SIM.window_s


def test_the_lows_follow_the_minimum_of_each_span():
    trend = p.Trend(SIM)
    # a sawtooth: 100 ms period, lows falling 10 MB per 250 ms span
    r = None
    for i in range(200):
        t = i * 0.02
        r = trend.add(t, int(1_000 * MB - (i % 4) * 50 * MB - 40 * MB * t))
    assert r.lows is not None and r.lows.slope == pytest.approx(-40 * MB, rel=0.1)
    assert r.low <= r.level


def test_settings_refuse_nonsense():
    with pytest.raises(ValueError, match="mode"):
        p.GuardSettings(mode="loud")
    with pytest.raises(ValueError, match="lead_s"):
        p.GuardSettings(lead_s=0)
    with pytest.raises(ValueError, match="confirm_samples"):
        p.GuardSettings(confirm_samples=0)
