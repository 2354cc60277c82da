"""The memory guard's choices against an oracle, on randomized multi-request workloads.

Each scenario is a node with some memory above the guard and a few prompts arriving close
together: short ones (no prefill_empty_cache hook: every chunk's indexer buffer stays in the
allocator), long ones (the hook returns the cache after each chunk), prefix-cache hits (a long
prefix, little KV of their own, large buffers), and sometimes a runaway that cannot fit even
alone. Several fit alone but not together.

The engine is the stand-in's own (sim/engine.py: its scheduler, one request chunk-prefilled at a
time, an abort taking effect at the next chunk boundary, SGLang's exact-rid /abort_request; and
sim/allocator.py, PyTorch's caching allocator that keeps freed blocks), stepped here on a
simulated clock with memory counted, not allocated. Available memory is what the node has minus
what the allocator holds from the OS.

The guard is the real policy (coordinator.guard.policy.Guard with charge.py's cost model, the
stand-in's own cost per token and per chunk-prefix token), fed what the runner feeds it: a sample
every interval (with jitter and noise) through the agent's send filter (agent.memory.ChangeFilter,
the send policy the runner asks for), the in-flight list parsed by the runner's own parser when a
decision needs it, the runner's confirmation check every 50 ms and its look every 0.2 s (a
waiting request that arrived and cannot fit), its actions reaching the engine 2 ms later.

The oracle knows every request's true peak: it replays the scenario without the guard for every
set of requests aborted on arrival, smallest sets first, and keeps the first size at which the
lowest available stays at or above the guard; of the sets of that size it is compared with the
one closest to the guard's choice. An aborted request "the oracle would have kept" is one the
guard aborted (by rid, by abort_all or by a stop) that is in none of those sets. This oracle
also knows the future: which prompts arrive later and when each client stops reading.

The same-moment oracle (needless_at_decisions) knows only what the guard could: at each of the
guard's actions it sees the requests in flight then, and knows their true peaks (the engine's
own run from that moment, allocator and all), but no later arrival and no client stopping early.
A victim of the guard's it would have kept was aborted because the cost model's projection was
wrong, not because the future was unknown.

Rank 0 lists a waiting prefix-cache hit with its match because the adapter matches each waiting
request itself (adapter/scheduler_requests.py); SGLang 0.5.23 under fcfs matches a request only
when it builds its first step. `cold_waiting_hits` runs the guard on the listing SGLang alone
would give (as rank 0 gives where the adapter's match fails): a waiting hit looks like a cold
prompt, charged a cold prompt's KV, which measures what that match is worth.

The engine with its KV in a pool as SGLang keeps it (POOLED, sim/kvpool.py): the KV's memory taken
once, never given back, reused by later requests' KV alone. Rows: the guard's cost model charging
the KV through the allocator (where an aborted request's blocks serve anything and the hook may
give them back), and knowing the pool (as with RANK_ENGINE=sglang; rank 0's listing gives the
pool's high-water mark), without and with the admission gate. The pool here has no size limit
(SGLang's --max-total-tokens; the guard's kv_pool_too_large says what fits), so the memory its
first requests touch never comes back to later ones.

The guard with a wrong model (wrong_model): its cost model charging a fraction of what the engine
takes, the engine unchanged; what the guard's distrust of its model keeps of the node.

Deterministic for a seed: no threads, no wall clock.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field, replace
from typing import Callable

from agent.memory import NO_PRESSURE, ChangeFilter, Sample, SendPolicy
from coordinator.guard import charge
from coordinator.guard import policy as p
from coordinator.guard.engine import parse_inflight
from coordinator.guard.poolfit import largest_fit
from dsv41.admission import LONE_WAIT_S, GateSettings
from dsv41.cost import CostModel
from dsv41.inflight import DECODING, PREFILLING, WAITING
from sim.allocator import CachingAllocator, CountedMemory
from sim.engine import Engine, EngineConfig, Phase, Rejected
from sim.kvpool import KvPool

MB = 1_000_000
MiB = 1 << 20

# The integration test's shape (tests/integration/test_guard_memory.py): the stand-in's defaults
# (16 KiB of KV per token, 4 bytes of indexer buffer per chunk x prefix token, 20k tokens/s,
# 768-token chunks, the hook from 8192 tokens) and its guard settings.
TOKEN_BYTES = 16_384
TRANSIENT_BYTES = 4.0
CHUNK = 768
HOOK_TOKENS = 8192
ENGINE = EngineConfig(chunk_tokens=CHUNK, max_running=64, prefill_tokens_per_s=20_000.0, decode_tokens_per_s=10.0,
                      bytes_per_token=TOKEN_BYTES, max_total_tokens=0, context_length=None,
                      transient_bytes=TRANSIENT_BYTES, empty_cache_tokens=HOOK_TOKENS)
# The same engine with the admission gate (adapter/admission_gate.py, MEMORY_GUARD_ADMISSION=1): the
# coordinator passes the guard's level and cost model to the rank.
GATED = replace(ENGINE, admission=GateSettings(150 * MB, TOKEN_BYTES, TRANSIENT_BYTES))
# The same engine with its KV in a pool as SGLang's (sim/kvpool.py, DSV41_SIM_KV_POOL=1).
POOLED = replace(ENGINE, kv_pool=True)
POOLED_GATED = replace(GATED, kv_pool=True)
SETTINGS = p.GuardSettings(guard_bytes=150 * MB, lead_s=0.5, envelope_s=0.25, hysteresis_bytes=50 * MB,
                           cost=CostModel(TOKEN_BYTES, TRANSIENT_BYTES, CHUNK, HOOK_TOKENS), rank0_node="node")
GATED_SETTINGS = replace(SETTINGS, cost=replace(SETTINGS.cost, admission_guard_bytes=SETTINGS.guard_bytes))
# The guard's model knowing the pool (as with RANK_ENGINE=sglang), without and with the gate.
POOL_SETTINGS = replace(SETTINGS, cost=replace(SETTINGS.cost, kv_pool=True))
POOL_GATED_SETTINGS = replace(GATED_SETTINGS, cost=replace(GATED_SETTINGS.cost, kv_pool=True))
LATENCY_S = 0.002   # an action's HTTP call on the node's loopback
CONFIRM_POLL_S = 0.05
LOOK_S = 0.2        # the runner's look at the in-flight list while serving (MemoryGuard's poll)
NOISE = 1 * MB      # sample noise, each way
SETTLE_S = 2.0      # simulated after the last request ended


@dataclass(frozen=True)
class Spec:
    rid: str
    kind: str          # short | long | cached | runaway
    arrival: float
    prompt: int
    cached: int
    decode_s: float    # how long its client reads the answer once the prefill is done


@dataclass(frozen=True)
class Scenario:
    index: int
    base: int          # available on the node when it starts
    requests: tuple[Spec, ...]


def generate(rng: random.Random, index: int) -> Scenario:
    """A node with 500-1100 MiB above its idle use (the guard 150 MB of it) and 2-6 prompts, most
    arriving within half a second of each other."""
    base = rng.randint(500, 1100) * MiB
    room = (base - SETTINGS.guard_bytes) // TOKEN_BYTES  # tokens of KV that fit above the guard
    n = rng.randint(2, 6)
    specs = []
    burst = rng.uniform(0.0, 0.5)
    for i in range(n):
        kind = rng.choices(("short", "long", "cached", "runaway"), (0.3, 0.35, 0.2, 0.15))[0]
        if kind == "short":
            prompt, cached = rng.randint(300, HOOK_TOKENS - 1), 0
        elif kind == "long":
            prompt, cached = rng.randint(HOOK_TOKENS, max(HOOK_TOKENS + 1, int(room * 0.9))), 0
        elif kind == "cached":
            prompt = rng.randint(2 * HOOK_TOKENS, max(2 * HOOK_TOKENS + 1, 3 * room))
            cached = int(prompt * rng.uniform(0.5, 0.95))
        else:
            prompt, cached = rng.randint(int(room * 1.3), int(room * 4)), 0
        arrival = burst + rng.uniform(0.0, 0.5) if rng.random() < 0.7 else rng.uniform(0.0, 5.0)
        specs.append(Spec(f"s{index}-{kind}-{i}", kind, round(arrival, 3), prompt, cached,
                          round(rng.uniform(0.3, 3.0), 2)))
    specs.sort(key=lambda s: s.arrival)
    return Scenario(index, base, tuple(specs))


@dataclass
class Run:
    lowest: int
    completed: set[str] = field(default_factory=set)
    aborted: set[str] = field(default_factory=set)      # by the guard (a rid, abort_all, or a stop)
    decisions: list[tuple[float, p.Decision]] = field(default_factory=list)
    stopped: bool = False
    t_end: float = 0.0
    lowest_at_first_chunk: bool = False  # the lowest point came with a request's first chunk
    live: set[str] = field(default_factory=set)  # with a fork: the requests in flight at it
    idle_lowest: int | None = None  # the lowest available with no request in flight (None: never idle)
    refused: set[str] = field(default_factory=set)  # refused by the engine (longer than its KV pool takes)

    def kinds(self, kind: str) -> int:
        return sum(1 for _, d in self.decisions if d.kind == kind)


@dataclass(frozen=True)
class Fork:
    """Where a guarded run stops being the guard's: at its `decision`-th action (0 first) the
    requests in `aborts` are aborted instead (with the same latency), and from then on nothing
    acts, no request arrives and every client reads its answer to the end: what is left is what
    the requests in flight at that moment go on to take."""
    decision: int
    aborts: frozenset[str]


def simulate(scenario: Scenario, guarded: bool, skip: frozenset[str] = frozenset(), seed: int = 0,
             settings: p.GuardSettings = SETTINGS, fork: Fork | None = None, engine_config: EngineConfig = ENGINE,
             cold_waiting_hits: bool = False,
             allocator_of: Callable[[CountedMemory], CachingAllocator] = CachingAllocator) -> Run:
    """One scenario on the stand-in's engine; with `guarded` the policy in the loop, else nothing
    acts. Requests in `skip` are aborted on arrival (the oracle's choice): they hold nothing.
    With `fork`, the run from the guard's fork.decision-th action on (Run.lowest from there, and
    Run.live the requests in flight then). `cold_waiting_hits`: the guard's listings show a waiting
    prefix-cache hit as a cold prompt (nothing prefilled or cached), as SGLang alone lists it.
    `allocator_of` makes the engine's allocator over the counted memory (bench/allocator_fidelity
    records what it serves)."""
    rng = random.Random(seed)
    clock = [0.0]
    backing = CountedMemory()
    def available() -> int:
        return scenario.base - backing.mapped
    engine = Engine(engine_config, on_fatal=lambda why: None, clock=lambda: clock[0],
                    allocator=allocator_of(backing), node_room=available,
                    kv_pool=KvPool(backing, engine_config.bytes_per_token, capacity=engine_config.max_total_tokens)
                    if engine_config.kv_pool else None)
    run = Run(lowest=available())
    arrivals = [s for s in scenario.requests]
    requests = {}
    decode_until: dict[str, float] = {}
    batch, transients, chunk_end = None, [], math.inf
    guard = p.Guard(settings) if guarded else None
    acted = [0]             # the guard's actions so far
    forked = [False]
    asked = settings.send_request()
    gate = ChangeFilter(SendPolicy(asked["min_change_bytes"], asked.get("heartbeat_ms", 5000) / 1000,
                                   asked.get("replay_samples", 0), asked.get("follow_samples", 0)))
    step = settings.interval_ms / 1000
    next_sample = rng.uniform(0.0, step) if guarded else math.inf
    actions: list[tuple[float, p.Decision]] = []
    next_poll = math.inf
    next_look = LOOK_S / 2 if guarded else math.inf  # (not from rng: the samples keep their noise)
    last_arrival = max(s.arrival for s in arrivals)

    def listing() -> p.InflightList:
        items = engine.inflight()
        if cold_waiting_hits:
            items = [{**x, "prefilled_tokens": 0, "cached_tokens": 0} if x["state"] == "waiting" else x for x in items]
        return parse_inflight({"requests": items, "step_launched_monotonic_s": engine.step_launched_at(),
                               "kv_pool_high_water_tokens": engine.kv_high_water()})

    def apply(d: p.Decision) -> None:
        if d.kind == p.Kind.ABORT:
            for v in d.victims:
                engine.abort(v.request.rid)
        elif d.kind == p.Kind.ABORT_ALL:
            engine.abort("", abort_all=True)
        elif d.kind == p.Kind.STOP:
            run.stopped = True
        for r in requests.values():
            # a decoding request's client sees the abort at its next token (the HTTP side finishes it)
            if r.abort_requested and r.phase is Phase.DECODE:
                engine.finish(r, "abort")

    def decide(d: p.Decision, now: float) -> None:
        if forked[0]:
            return
        if d.kind in p.ACTIONS and fork is not None and acted[0] == fork.decision:
            forked[0] = True
            run.lowest = available()
            run.live = {rid for rid, r in requests.items() if r.phase is not Phase.FINISHED and not r.abort_requested}
            arrivals.clear()
            for rid in decode_until:
                decode_until[rid] = math.inf
            if fork.aborts:
                victims = tuple(charge.Victim(charge.InflightRequest(rid, 0, 0), p.Why.HOLDS, 0) for rid in sorted(fork.aborts))
                actions.append((now + LATENCY_S, p.Decision(p.Kind.ABORT, "node", "the oracle's", victims=victims)))
            return
        if d.kind != p.Kind.NONE:
            run.decisions.append((now, d))
        if d.kind in p.ACTIONS:
            acted[0] += 1
            actions.append((now + LATENCY_S, d))

    while True:
        unfinished = [r for r in requests.values() if r.phase is not Phase.FINISHED]
        if not unfinished and batch is None and requests:
            run.idle_lowest = available() if run.idle_lowest is None else min(run.idle_lowest, available())
        if run.stopped:
            break
        if not arrivals and not unfinished and batch is None and not actions:
            if clock[0] >= max(last_arrival, run.t_end) + SETTLE_S or not guarded:
                break
        t = min([chunk_end, next_sample, next_poll, next_look] + [a.arrival for a in arrivals[:1]] + [x[0] for x in actions]
                + list(decode_until.values()) + [max(last_arrival, clock[0]) + SETTLE_S])
        if t > 600:
            raise RuntimeError(f"scenario {scenario.index} did not end")
        clock[0] = t
        while arrivals and arrivals[0].arrival <= t:
            s = arrivals.pop(0)
            try:
                requests[s.rid] = r = engine.submit(s.rid, s.prompt, s.cached)
            except Rejected:
                run.refused.add(s.rid)
                continue
            if s.rid in skip:
                engine.abort(s.rid)
        if batch is not None and t >= chunk_end:
            engine.end_chunk(batch, transients)
            for r, _ in batch:
                if r.phase is Phase.DECODE and r.rid not in decode_until:
                    decode_until[r.rid] = math.inf if forked[0] else \
                        t + next(s.decode_s for s in scenario.requests if s.rid == r.rid)
            batch, transients, chunk_end = None, [], math.inf
        for rid, until in list(decode_until.items()):
            r = requests[rid]
            if r.phase is Phase.FINISHED:
                del decode_until[rid]
            elif t >= until:
                engine.finish(r, "stop")
                del decode_until[rid]
        for x in [x for x in actions if x[0] <= t]:
            actions.remove(x)
            apply(x[1])
        if run.stopped:
            break
        if batch is None:
            batch = engine.next_prefill()
            if batch is not None:
                first = any(r.prefilled == r.cached for r, _ in batch)
                transients = engine.allocate_chunk(batch)
                chunk_end = t + engine.chunk_seconds(batch)
                if available() < run.lowest:
                    run.lowest, run.lowest_at_first_chunk = available(), first
            elif forked[0] and not actions:
                held = [r for r in requests.values() if r.phase is Phase.WAITING and not r.abort_requested]
                decoding = [r for r in requests.values() if r.phase is Phase.DECODE]
                if held and not decoding:
                    # The gate holds it alone for the guard, which acts no more here: it goes in once
                    # its wait is over.
                    clock[0] += LONE_WAIT_S
                    next_sample = next_poll = next_look = math.inf
                    continue
                if not held:
                    break  # nothing left to prefill, nothing to act: memory no longer changes
                # The admission gate holds these until memory comes back: a fork keeps them only if
                # they fit then, so the others' clients end here and what they held goes back.
                for r in decoding:
                    engine.finish(r, "stop")
                    decode_until.pop(r.rid, None)
                continue
        if forked[0]:
            next_sample = next_poll = next_look = math.inf
            continue
        if guard is not None and t >= next_sample:
            level = available() + rng.randint(-NOISE, NOISE)
            for sample in gate.offer(Sample(t, 0, level, 0, 0, level, NO_PRESSURE, NO_PRESSURE, 0)):
                decide(guard.observe("node", sample.at_monotonic_s, sample.available, t, listing), t)
            next_sample = t + step * (1 + rng.uniform(-0.1, 0.1))
            if guard.state.aborts.pending and next_poll == math.inf:
                next_poll = t + CONFIRM_POLL_S
        if guard is not None and t >= next_look:
            decide(guard.look(listing(), t), t)
            next_look = t + LOOK_S
            if guard.state.aborts.pending and next_poll == math.inf:
                next_poll = t + CONFIRM_POLL_S
        if guard is not None and t >= next_poll:
            _, queued = guard.note_listing(listing(), t)
            if queued is not None:
                decide(queued, t)
            next_poll = t + CONFIRM_POLL_S if guard.state.aborts.pending else math.inf
        if any(r.phase is not Phase.FINISHED for r in requests.values()) or arrivals:
            run.t_end = t
    for rid, r in requests.items():
        if r.phase is Phase.FINISHED and r.finish_reason == "stop":
            run.completed.add(rid)
        elif forked[0] and r.phase is Phase.DECODE:
            pass  # a fork ends once the prefills are done: its client reads on
        elif rid not in skip:
            run.aborted.add(rid)  # by the guard's abort, its abort_all, or its stop
    for s in arrivals:  # never arrived: the guard stopped the ranks first
        run.aborted.add(s.rid)
    return run


@dataclass
class Verdict:
    scenario: Scenario
    guard: Run
    unguarded: Run
    oracle_aborts: int
    oracle_sets: list[frozenset[str]]
    kept_by_oracle: set[str]     # aborted by the guard, in none of the oracle's best sets
    needless: set[str] = field(default_factory=set)  # aborted by the guard, kept by the same-moment oracle


def oracle(scenario: Scenario, seed: int, engine_config: EngineConfig = ENGINE) -> tuple[int, list[frozenset[str]], Run]:
    """The fewest requests aborted on arrival that keep the lowest point at or above the guard,
    and every set of that size that does."""
    unguarded = simulate(scenario, guarded=False, seed=seed, engine_config=engine_config)
    rids = [s.rid for s in scenario.requests if s.rid not in unguarded.refused]
    if unguarded.lowest >= SETTINGS.guard_bytes:
        return 0, [frozenset()], unguarded
    for k in range(1, len(rids) + 1):
        sets = [frozenset(c) for c in itertools.combinations(rids, k)
                if simulate(scenario, guarded=False, skip=frozenset(c), seed=seed, engine_config=engine_config).lowest
                >= SETTINGS.guard_bytes]
        if sets:
            return k, sets, unguarded
    raise AssertionError("aborting everything keeps the node above the guard")


def needless_at_decisions(scenario: Scenario, seed: int, guarded: Run, settings: p.GuardSettings = SETTINGS,
                          engine_config: EngineConfig = ENGINE, cold_waiting_hits: bool = False) -> set[str]:
    """The guard's victims an oracle deciding at the same moments would have kept: one that knows
    the true peak of every request in flight (the engine's own run from there, allocator and all)
    and nothing the guard cannot know either (no later arrival, every client reading on). At each
    of the guard's actions it aborts the fewest requests in flight that keep the lowest point from
    there at or above the guard; a victim of the guard's in none of those sets (the one closest to
    the guard's choice) was aborted needlessly."""
    needless: set[str] = set()
    actions = [d for _, d in guarded.decisions if d.kind in p.ACTIONS]
    for i, d in enumerate(actions):
        keep_all = simulate(scenario, guarded=True, seed=seed, settings=settings, fork=Fork(i, frozenset()),
                            engine_config=engine_config, cold_waiting_hits=cold_waiting_hits)
        live = sorted(keep_all.live)
        victims = {v.request.rid for v in d.victims} if d.kind == p.Kind.ABORT else set(live)
        victims &= set(live)
        if keep_all.lowest >= SETTINGS.guard_bytes:
            needless |= victims
            continue
        for k in range(1, len(live) + 1):
            sets = [frozenset(c) for c in itertools.combinations(live, k)
                    if simulate(scenario, guarded=True, seed=seed, settings=settings, fork=Fork(i, frozenset(c)),
                                engine_config=engine_config, cold_waiting_hits=cold_waiting_hits).lowest
                    >= SETTINGS.guard_bytes]
            if sets:
                needless |= victims - min(sets, key=lambda c: len(victims - c))
                break
    return needless


def judge(scenario: Scenario, seed: int, engine_config: EngineConfig = ENGINE, cold_waiting_hits: bool = False,
          settings: p.GuardSettings | None = None) -> Verdict:
    """With the gated engine the guard's cost model knows the gate (as MEMORY_GUARD_ADMISSION=1 tells
    both), unless `settings` says otherwise."""
    if settings is None:
        settings = GATED_SETTINGS if engine_config.admission else SETTINGS
    k, sets, unguarded = oracle(scenario, seed, engine_config)
    guarded = simulate(scenario, guarded=True, seed=seed, settings=settings, engine_config=engine_config,
                       cold_waiting_hits=cold_waiting_hits)
    best = min(sets, key=lambda s: len(guarded.aborted - s))
    return Verdict(scenario, guarded, unguarded, k, sets, guarded.aborted - best,
                   needless_at_decisions(scenario, seed, guarded, settings, engine_config=engine_config,
                                         cold_waiting_hits=cold_waiting_hits))


def run_scenarios(count: int, seed: int) -> list[Verdict]:
    rng = random.Random(seed)
    return [judge(generate(rng, i), seed * 100_003 + i) for i in range(count)]


def describe(v: Verdict) -> str:
    """One scenario for the report: its requests, the oracle's and the guard's aborts, the lows."""
    s = v.scenario
    reqs = ", ".join(f"{r.rid}@{r.arrival:g}s {r.prompt}"
                     + (f" ({r.cached} cached)" if r.cached else "") for r in s.requests)
    acted = "; ".join(f"{t:.2f}s {d.kind} {','.join(x.request.rid for x in d.victims) or ''} "
                      f"[{d.basis or ''}] {d.reason[:300]}"
                      for t, d in v.guard.decisions if d.kind in p.ACTIONS)
    return (f"scenario {s.index}: {(s.base - SETTINGS.guard_bytes) / MB:.0f} MB above the guard; {reqs}; "
            f"oracle aborts {v.oracle_aborts} (e.g. {sorted(v.oracle_sets[0])}), the guard {sorted(v.guard.aborted)}; "
            f"lowest {(v.guard.lowest - SETTINGS.guard_bytes) / MB:.0f} MB above the guard with it, "
            f"{(v.unguarded.lowest - SETTINGS.guard_bytes) / MB:.0f} MB without; actions: {acted}")


def summary(verdicts: list[Verdict]) -> dict:
    g = SETTINGS.guard_bytes
    return {
        "scenarios": len(verdicts),
        "requests": sum(len(v.scenario.requests) for v in verdicts),
        "needed": sum(1 for v in verdicts if v.oracle_aborts > 0),
        "oracle_aborts": sum(v.oracle_aborts for v in verdicts),
        "guard_aborts": sum(len(v.guard.aborted) for v in verdicts),
        "kept_by_oracle": sum(len(v.kept_by_oracle) for v in verdicts),
        "needless": sum(len(v.needless) for v in verdicts),
        "scenarios_needless": sum(1 for v in verdicts if v.needless),
        "scenarios_kept_by_oracle": sum(1 for v in verdicts if v.kept_by_oracle),
        "fewer_than_oracle": sum(1 for v in verdicts if len(v.guard.aborted) < v.oracle_aborts),
        "below_guard": sum(1 for v in verdicts if v.guard.lowest < g),
        "below_guard_first_chunk": sum(1 for v in verdicts if v.guard.lowest < g and v.guard.lowest_at_first_chunk),
        "below_guard_unguarded": sum(1 for v in verdicts if v.unguarded.lowest < g),
        "ran_out_unguarded": sum(1 for v in verdicts if v.unguarded.lowest <= 0),
        "abort_all": sum(v.guard.kinds(p.Kind.ABORT_ALL) for v in verdicts),
        "stops": sum(v.guard.kinds(p.Kind.STOP) for v in verdicts),
        "lowest_margin": min(v.guard.lowest - g for v in verdicts),
        "refused": sum(len(v.guard.refused) for v in verdicts),
    }


def extra_aborts(v: Verdict) -> list[tuple[float, p.Decision, list[str]]]:
    """The guard's decisions that aborted a request the oracle would have kept."""
    return [(t, d, [x.request.rid for x in d.victims if x.request.rid in v.kept_by_oracle])
            for t, d in v.guard.decisions
            if d.kind in p.ACTIONS and (any(x.request.rid in v.kept_by_oracle for x in d.victims)
                                        or (d.kind != p.Kind.ABORT and v.kept_by_oracle))]


def sized_pool(s: Scenario, engine: EngineConfig, settings: p.GuardSettings) -> tuple[EngineConfig, p.GuardSettings]:
    """The engine and the guard with the KV pool as large as fits the scenario's node above the
    guard with its longest prompt's last-chunk buffers (what the guard's kv_pool_too_large says;
    prompts as long as the pool): SGLang then refuses every longer prompt at once."""
    tokens = largest_fit(s.base - SETTINGS.guard_bytes, replace(settings.cost, kv_pool=True), 1 << 30)
    return (replace(engine, kv_pool=True, max_total_tokens=tokens),
            replace(settings, cost=replace(settings.cost, kv_pool=True, kv_pool_tokens=tokens)))


def long_decodes(s: Scenario) -> Scenario:
    """The same scenario with every answer read for a minute: no request ends, and hands its KV to
    the next ones, before the others' peaks (what the guard's projection assumes)."""
    return Scenario(s.index, s.base, tuple(Spec(r.rid, r.kind, r.arrival, r.prompt, r.cached, 60.0)
                                           for r in s.requests))


def with_replay(settings: p.GuardSettings, replay: bool) -> p.GuardSettings:
    """The settings with the guard's projection replaying the allocator, or summing each request's
    bytes (dsv41.cost.CostModel.replay)."""
    return replace(settings, cost=replace(settings.cost, replay=replay))


def report(count: int, seed: int, out=print, replay: bool = True) -> dict:
    """The scenario section of bench/memory_guard: the scenarios as generated, and again with
    every answer outlasting the others' peaks (which isolates what the guard cannot know: when
    a client stops reading). `replay` False: the guard's cost model sums each request's bytes."""
    plain, gate = with_replay(SETTINGS, replay), with_replay(GATED_SETTINGS, replay)
    pool, pool_gate = with_replay(POOL_SETTINGS, replay), with_replay(POOL_GATED_SETTINGS, replay)
    rng = random.Random(seed)
    scenarios = [generate(rng, i) for i in range(count)]
    as_generated = [judge(s, seed * 100_003 + s.index, settings=plain) for s in scenarios]
    held = [judge(long_decodes(s), seed * 100_003 + s.index, settings=plain) for s in scenarios]
    gated = [judge(s, seed * 100_003 + s.index, GATED, settings=gate) for s in scenarios]
    gated_held = [judge(long_decodes(s), seed * 100_003 + s.index, GATED, settings=gate) for s in scenarios]
    a, b, ga, gb = summary(as_generated), summary(held), summary(gated), summary(gated_held)
    g = SETTINGS.guard_bytes
    out(f"scenarios: {count} randomized workloads (seed {seed}), {a['requests']} requests, on the stand-in's engine "
        f"model (sim/engine.py + sim/allocator.py) on a simulated clock, with the real policy and cost model "
        f"({'the allocator replayed' if replay else 'additive: each request charged its bytes'}) "
        f"(guard {g / MB:.0f} MB, lead {SETTINGS.lead_s:g} s, envelope {SETTINGS.envelope_s:g} s, "
        f"{SETTINGS.interval_ms} ms samples through the agent's send filter)")
    out(f"{'':58s}{'as generated':>14s}{'answers held':>14s}   with the admission gate (rank side):")
    out(f"{'':58s}{'':14s}{'':14s}{'as generated':>14s}{'answers held':>14s}")
    rows = [("scenarios in which some request had to go (oracle)", "needed"),
            ("aborted requests the oracle would have kept (goal 0)", "kept_by_oracle"),
            ("  in scenarios", "scenarios_kept_by_oracle"),
            ("aborted requests the same-moment oracle would have kept", "needless"),
            ("  in scenarios", "scenarios_needless"),
            ("the oracle's aborts", "oracle_aborts"),
            ("the guard's aborts (by rid, abort_all or stop)", "guard_aborts"),
            ("scenarios the guard kept above it with fewer aborts", "fewer_than_oracle"),
            ("scenarios below the guard, with the guard", "below_guard"),
            ("  of which at an arriving request's first chunk", "below_guard_first_chunk"),
            ("scenarios below the guard, nothing acting", "below_guard_unguarded"),
            ("  of which the node ran out", "ran_out_unguarded"),
            ("abort_all", "abort_all"),
            ("stops", "stops")]
    for name, key in rows:
        out(f"{name:58s}{a[key]:14d}{b[key]:14d}{ga[key]:14d}{gb[key]:14d}")
    out(f"{'lowest margin above the guard, with the guard (MB)':58s}"
        + "".join(f"{x['lowest_margin'] / MB:14.0f}" for x in (a, b, ga, gb)))
    # why: how far below the guard the cost model projected the low, keeping every request, at each
    # decision that cost a request the oracle kept
    for name, verdicts in (("as generated", as_generated), ("answers held", held),
                           ("gate, as generated", gated), ("gate, answers held", gated_held)):
        below, bases = [], {}
        for v in verdicts:
            for _, d, _ in extra_aborts(v):
                bases[d.basis or d.kind] = bases.get(d.basis or d.kind, 0) + 1
                if d.projected_low_kept is not None:
                    below.append((g - d.projected_low_kept) / MB)
        lefts = []
        for v in verdicts:
            if v.kept_by_oracle:
                best = min(v.oracle_sets, key=lambda c: len(v.guard.aborted - c))
                config = GATED if verdicts in (gated, gated_held) else ENGINE
                lefts.append((simulate(v.scenario, guarded=False, skip=best, seed=0, engine_config=config).lowest - g) / MB)
        if lefts:
            lefts.sort()
            out(f"{name}: where the guard aborted a request the oracle kept, the oracle's choice left "
                f"{lefts[len(lefts) // 2]:.0f} MB above the guard at its lowest (median; {lefts[0]:.0f} to "
                f"{lefts[-1]:.0f} MB); in {sum(1 for x in lefts if x < 50)} of {len(lefts)} scenarios less than 50 MB")
        if bases:
            below.sort()
            out(f"{name}: decisions that cost a request the oracle kept, by basis: "
                + ", ".join(f"{k} {n}" for k, n in sorted(bases.items()))
                + (f"; the projected low keeping every request was {below[len(below) // 2]:.0f} MB below the "
                   f"guard (median; {below[0]:.0f} to {below[-1]:.0f} MB)" if below else ""))
    cold = summary([judge(s, seed * 100_003 + s.index, cold_waiting_hits=True, settings=plain) for s in scenarios])
    out(f"with a waiting prefix-cache hit listed as a cold prompt (SGLang's own listing under fcfs, without the "
        f"adapter's match), as generated: the oracle would have kept {cold['kept_by_oracle']}, the same-moment "
        f"oracle {cold['needless']} (against {a['kept_by_oracle']} and {a['needless']} above), below the guard in "
        f"{cold['below_guard']} scenarios, lowest {cold['lowest_margin'] / MB:.0f} MB, abort_all {cold['abort_all']}")
    pooled = {}
    for what, engine, settings in (
            ("the engine's KV in a pool as SGLang's, the guard's cost model charging it through the allocator",
             POOLED, plain),
            ("the engine's KV in a pool as SGLang's, the guard's cost model knowing the pool", POOLED, pool),
            ("the same and the admission gate", POOLED_GATED, pool_gate)):
        pa, pb = (summary([judge(x, seed * 100_003 + x.index, engine, settings=settings) for x in s])
                  for s in (scenarios, [long_decodes(x) for x in scenarios]))
        pooled[what] = (pa, pb)
        out(f"with {what}, as generated / answers held: the oracle would have kept "
            f"{pa['kept_by_oracle']} / {pb['kept_by_oracle']}, the same-moment oracle {pa['needless']} / "
            f"{pb['needless']} (against {a['kept_by_oracle']} / {b['kept_by_oracle']} and {a['needless']} / "
            f"{b['needless']} above), below the guard in {pa['below_guard']} / {pb['below_guard']} scenarios "
            f"(nothing acting: {pa['below_guard_unguarded']} / {pb['below_guard_unguarded']}, the node ran out in "
            f"{pa['ran_out_unguarded']} / {pb['ran_out_unguarded']}), lowest {pa['lowest_margin'] / MB:.0f} / "
            f"{pb['lowest_margin'] / MB:.0f} MB, abort_all {pa['abort_all']} / {pb['abort_all']}")
    sized = {}
    sizes = [sized_pool(x, POOLED, pool)[0].max_total_tokens for x in scenarios]
    for what, engine, settings in (("", POOLED, pool), (", with the admission gate", POOLED_GATED, pool_gate)):
        sa = summary([judge(x, seed * 100_003 + x.index, *sized_pool(x, engine, settings)[:1],
                            settings=sized_pool(x, engine, settings)[1]) for x in scenarios])
        sized[what or "alone"] = sa
        out(f"with the engine's KV in a pool sized to fit each node (MAX_TOTAL_TOKENS as kv_pool_too_large gives it: "
            f"{min(sizes)} to {max(sizes)} tokens){what}, as generated: {sa['refused']} of {a['requests']} requests "
            f"refused by the engine (as long as the pool or longer), the oracle would have kept {sa['kept_by_oracle']}, "
            f"the same-moment oracle {sa['needless']}, below the guard in {sa['below_guard']} scenarios (nothing "
            f"acting: {sa['below_guard_unguarded']}, the node ran out in {sa['ran_out_unguarded']}), lowest "
            f"{sa['lowest_margin'] / MB:.0f} MB, abort_all {sa['abort_all']}")
    wrong = wrong_model(scenarios, seed, out, plain)
    decision_cost(out, model=plain.cost)
    return {"wrong_model": wrong, "as_generated": a, "held": b, "gated": ga, "gated_held": gb, "cold_waiting_hits": cold,
            "kv_pool": pooled, "kv_pool_sized": sized,
            "verdicts": as_generated, "held_verdicts": held, "gated_verdicts": gated}


WRONG_FACTORS = (0.5, 0.25)


def wrong_model(scenarios: list[Scenario], seed: int, out=print, base: p.GuardSettings = SETTINGS) -> dict:
    """The same scenarios with the guard's cost model charging a fraction of what the engine takes
    (the engine unchanged): what the guard's distrust of the model (the trend, the broken hold, the
    urgency) keeps of the node when the model is wrong, as generated and with answers held."""
    figures = {}
    for factor in WRONG_FACTORS:
        cost = replace(base.cost, token_bytes=int(base.cost.token_bytes * factor),
                       transient_bytes=base.cost.transient_bytes * factor)
        settings = replace(base, cost=cost)
        for held in (False, True):
            runs = [simulate(long_decodes(s) if held else s, guarded=True, seed=seed * 100_003 + s.index,
                             settings=settings) for s in scenarios]
            lows = [r.lowest - SETTINGS.guard_bytes for r in runs]
            figures[(factor, held)] = f = {
                "below_guard": sum(1 for x in lows if x < 0),
                "ran_out": sum(1 for r in runs if r.lowest <= 0),
                "aborts": sum(len(r.aborted) for r in runs),
                "lowest_margin": min(lows) if lows else 0}
            out(f"the guard's cost model charging {factor:g} of the truth, "
                f"{'answers held' if held else 'as generated'}: below the guard in {f['below_guard']} scenarios, "
                f"the node ran out in {f['ran_out']}, lowest {f['lowest_margin'] / MB:.0f} MB against the guard, "
                f"{f['aborts']} aborts")
    return figures


def decision_cost(out=print, repeats: int = 20, model: CostModel = SETTINGS.cost) -> None:
    """What one decision by the requests' cost (charge.choose: the allocator replayed once, then
    every set of victims projected) takes on this CPU, for queues of 2 to 10 long prompts, as a
    ratio to the path every sample takes (the trend's update and assessment), timed here too."""
    import time
    trend = p.Trend(SETTINGS)
    level, t = 900 * MB, 0.0
    started = time.perf_counter()
    for _ in range(2000):
        t += 0.02
        level -= 2 * MB
        p.assess("node", trend.add(t, level), SETTINGS)
    per_sample = (time.perf_counter() - started) / 2000
    cells = []
    for n in (2, 4, 6, 10):
        reqs = [charge.InflightRequest("done", 60_000, 60_000, 9.0, DECODING),
                charge.InflightRequest("grow", 100_000, 40_000, 8.0, PREFILLING, chunk_tokens=CHUNK)]
        reqs += [charge.InflightRequest(f"w{i}", 40_000 + 9_000 * i, 0, 7.0 - i, WAITING) for i in range(n - 2)]
        listing = charge.InflightList(tuple(reqs), step_launched_at=0.0)
        took = []
        for _ in range(repeats):
            started = time.perf_counter()
            charge.choose(listing, 2_000 * MB, SETTINGS.guard_bytes, model, running_in_level=True)
            took.append(time.perf_counter() - started)
        took.sort()
        median = took[len(took) // 2]
        cells.append(f"{n} requests {median * 1e3:.1f} ms ({median / per_sample:.0f}x; slowest {took[-1] * 1e3:.1f} ms)")
    out(f"a decision by the requests' cost (charge.choose, prompts of 40k-120k tokens, median of {repeats}): "
        + ", ".join(cells) + f"; a sample's trend and assessment: {per_sample * 1e6:.0f} us (1x)")
