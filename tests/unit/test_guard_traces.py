"""Memory traces for the guard's policy tests: a small model of a chunked-prefill engine that
reacts to aborts (closed loop), the recipe's 1 s poll as a baseline, and the example
configuration's two incidents rebuilt from its notes. The tests here check that the model
reproduces what the notes say (so the policy tests replay the incidents, not a convenient story).

The model schedules as SGLang does: requests wait in arrival order; a prefill batch takes the
chunked request first, then waiting requests, whole while they fit in the chunk and the last one
cut: one request is chunk-prefilled at a time. A chunk of C tokens of a request whose prefix is P
takes C / rate(P) seconds; its transient (the indexer buffers, [chunk, prefix] per low-ratio
layer on DeepSeek-V4) is allocated when the chunk starts. Its memory is the engine's, not the OS's:
- a request's KV (per prefilled token) is held until it ends; then it stays with the process
  (PyTorch's caching allocator, or SGLang's KV pool) and the next requests' KV reuses it;
- with the prefill_empty_cache hook (a prompt of at least hook_tokens) a chunk's transient is
  returned after the chunk, and so is everything the allocator cached (unless the KV lives in a
  pool, which the hook does not touch); without it the allocator keeps every chunk's buffer;
- an abort takes effect at the next chunk boundary; /abort_request needs the exact rid, drops a
  repeat, then ends every rid that starts with it, as SGLang does.
So available = base - external(t) - KV held - the chunk's transient - what the engine keeps.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable

import pytest

from agent.memory import NO_PRESSURE, ChangeFilter, Sample, SendPolicy
from coordinator.guard import policy as p
from dsv41.cost import CostModel

pytestmark = pytest.mark.unit

GB = 1_000_000_000
MB = 1_000_000


@dataclass
class Req:
    rid: str
    arrival: float
    prompt: int
    prefilled: int = 0
    done_at: float | None = None     # decode ends (memory returned to the engine)
    abort: bool = False
    abort_sent: bool = False
    gone: bool = False
    chunk: int = 0                   # its tokens in the chunk now running
    started: bool = False


@dataclass
class Engine:
    """A chunked-prefill engine with real-looking memory, stepped in `dt`."""
    base: int
    chunk: int
    rate: Callable[[int], float]                      # prefill tokens/s at a prefix length
    kv_per_token: int = 0
    transient: Callable[[int, int], int] = lambda take, prefix: 0   # a chunk's buffers (prefix before it)
    decode_s: float = 1.0
    hook_tokens: int = 8192                            # the prefill_empty_cache threshold (0: off)
    kv_pool: bool = False                              # KV in a pool the hook does not return
    external: Callable[[float], int] = lambda t: 0    # the rank's other memory (returned by a stop)
    requests: list[Req] = field(default_factory=list)
    t: float = 0.0
    chunk_end: float = -1.0
    batch: list[tuple[Req, int]] = field(default_factory=list)
    chunk_bytes: int = 0
    cache: int = 0                                     # freed KV the engine keeps (reused by new KV)
    old_buffers: int = 0                               # earlier chunks' buffers the allocator keeps
    aborts: list[tuple[float, str]] = field(default_factory=list)   # (arrival time, rid or "*")
    stopped_at: float | None = None

    def add(self, rid: str, arrival: float, prompt: int) -> Engine:
        self.requests.append(Req(rid, arrival, prompt))
        return self

    def _live(self) -> list[Req]:
        return [r for r in self.requests if not r.gone and r.arrival <= self.t]

    def held(self) -> int:
        return sum(r.prefilled for r in self._live()) * self.kv_per_token

    def available(self) -> int:
        if self.stopped_at is not None:
            return self.base   # a stopped rank gives everything back
        return self.base - self.external(self.t) - self.held() - self.chunk_bytes - self.cache - self.old_buffers

    def advance(self, to: float, dt: float = 0.002) -> int:
        """Steps to `to`; returns the lowest available on the way."""
        low = self.available()
        while self.t < to - 1e-12:
            self.t = min(to, self.t + dt)
            self._step()
            low = min(low, self.available())
        return low

    def _end(self, r: Req) -> None:
        self.cache += r.prefilled * self.kv_per_token  # with the engine, not with the OS
        r.gone = True

    def _step(self) -> None:
        if self.stopped_at is not None:
            return
        for r in self._live():
            if r.done_at is not None and self.t >= r.done_at:
                self._end(r)
        if self.t < self.chunk_end:
            return
        hooked = False
        for r, take in self.batch:   # the chunk boundary
            r.chunk = 0
            hooked |= 0 < self.hook_tokens <= r.prompt
            if r.abort:
                self._end(r)
            else:
                self.cache -= min(self.cache, take * self.kv_per_token)  # new KV reuses what the engine kept
                r.prefilled += take
                if r.prefilled >= r.prompt:
                    r.done_at = self.t + self.decode_s
        if self.batch and not hooked:
            self.old_buffers += self.chunk_bytes
        self.batch, self.chunk_bytes = [], 0
        if hooked:  # empty_cache: the allocator's free blocks go back to the OS, a KV pool's pages do not
            self.old_buffers = 0
            if not self.kv_pool:
                self.cache = 0
        for r in self._live():
            if r.abort and not r.gone:
                self._end(r)
        budget = self.chunk
        pending = sorted((r for r in self._live() if r.prefilled < r.prompt), key=lambda r: (not r.started, r.arrival))
        for r in pending:
            if budget <= 0:
                break
            take = min(budget, r.prompt - r.prefilled)
            self.batch.append((r, take))
            r.started, r.chunk = True, take
            budget -= take
        if self.batch:
            first = self.batch[0][0]
            self.chunk_end = self.t + sum(t for _, t in self.batch) / self.rate(first.prefilled)
            self.chunk_bytes = sum(self.transient(take, r.prefilled) for r, take in self.batch)

    def inflight(self) -> p.InflightList:
        def state(r: Req) -> str:
            if r.prefilled >= r.prompt:
                return "decoding"
            return "prefilling" if r.started else "waiting"
        return p.InflightList(tuple(p.InflightRequest(r.rid, r.prompt, r.prefilled, self.t - r.arrival, state(r), 0,
                                                      r.chunk, 0) for r in self._live()))

    def abort(self, rid: str | None, at: float) -> None:
        self.aborts.append((at, rid or "*"))
        live = {r.rid: r for r in self._live()}
        if rid is not None and (rid not in live or live[rid].abort_sent):
            return  # the tokenizer manager needs the exact rid, and drops a repeat
        if rid is not None:
            live[rid].abort_sent = True
        for r in live.values():
            if rid is None or r.rid.startswith(rid):
                r.abort = True
                if not r.started or r.prefilled >= r.prompt:
                    self._end(r)   # a waiting or decoding request ends at once

    def stop(self, at: float) -> None:
        self.stopped_at = at


@dataclass
class Outcome:
    decisions: list[tuple[float, p.Decision]]
    lowest: int                                # lowest true available over the run
    engine: Engine
    observed: list[float] = field(default_factory=list)  # the times of the samples the guard saw
    confirmations: list[tuple[float, str, bool]] = field(default_factory=list)  # (time, rid, took effect)

    def kinds(self) -> list[str]:
        return [d.kind for _, d in self.decisions if d.kind in p.ACTIONS]

    def first(self, kind: str) -> tuple[float, p.Decision]:
        return next((t, d) for t, d in self.decisions if d.kind == kind)


def agent_send_policy(settings: p.GuardSettings) -> SendPolicy:
    """What the guard's runner asks the agents for (coordinator/guard/runner.py)."""
    asked = settings.send_request()
    return SendPolicy(asked["min_change_bytes"], asked["heartbeat_ms"] / 1000, asked["replay_samples"],
                      asked["follow_samples"])


POLL_S = 0.05  # coordinator/guard/runner.py's CONFIRM_POLL_S


def run_guard(engine: Engine, settings: p.GuardSettings, duration: float, latency_s: float = 0.02,
              noise: int = 0, seed: int = 1, node: str = "spark1", send: SendPolicy | None = None,
              serving: bool = True) -> Outcome:
    """The guard in a closed loop with the engine: samples every interval (with jitter and noise),
    actions reach the engine `latency_s` later. With `send`, the samples pass through the agent's
    ChangeFilter first, as on the wire: the guard sees them when the filter releases them."""
    rng = random.Random(seed)
    guard = p.Guard(settings)
    gate = ChangeFilter(send) if send is not None else None
    observed: list[float] = []
    pending: list[tuple[float, p.Decision]] = []
    decisions = []
    confirmations: list[tuple[float, str, bool]] = []
    polled = -math.inf
    lowest = engine.available()
    t = 0.0
    step = settings.interval_ms / 1000
    while t < duration:
        t += step * (1 + rng.uniform(-0.1, 0.1))
        for at, d in [x for x in pending if x[0] <= t]:
            lowest = min(lowest, engine.advance(at))
            _apply(engine, d, at)
            pending.remove((at, d))
        lowest = min(lowest, engine.advance(t))
        sample = engine.available() + (rng.randint(-noise, noise) if noise else 0)
        delivered = [(t, sample)] if gate is None else [
            (s.at_monotonic_s, s.available) for s in gate.offer(
                Sample(t, 0, sample, 0, 0, sample, NO_PRESSURE, NO_PRESSURE, 0))]
        for at, level in delivered:
            observed.append(at)
            d = guard.observe(node, at, level, t, engine.inflight, serving=serving)
            if d.kind != p.Kind.NONE:
                decisions.append((t, d))
            if d.kind in p.ACTIONS:
                pending.append((t + latency_s, d))
        if guard.state.aborts.pending and t - polled >= POLL_S:  # the runner's check that the aborts took effect
            polled = t
            seen, queued = guard.note_listing(engine.inflight(), t)
            confirmations.extend((t, rid, True) for rid in seen.gone)
            confirmations.extend((t, rid, False) for rid in seen.still)
            if queued is not None:
                decisions.append((t, queued))
                pending.append((t + latency_s, queued))
    return Outcome(decisions, lowest, engine, observed, confirmations)


def _apply(engine: Engine, d: p.Decision, at: float) -> None:
    if d.kind == p.Kind.ABORT:
        for v in d.victims:
            engine.abort(v.request.rid, at)
    elif d.kind == p.Kind.ABORT_ALL:
        engine.abort(None, at)
    elif d.kind == p.Kind.STOP:
        engine.stop(at)


def run_poll(engine: Engine, guard_bytes: int, duration: float, phase: float = 0.0, period: float = 1.0,
             latency_s: float = 0.02) -> Outcome:
    """The recipe's guard: read available every second, abort_all below the guard."""
    lowest = engine.available()
    decisions = []
    t = phase
    while t < duration:
        lowest = min(lowest, engine.advance(t))
        if engine.available() < guard_bytes and not engine.aborts:
            d = p.Decision(p.Kind.ABORT_ALL, "spark1", "below the guard", engine.available())
            decisions.append((t, d))
            lowest = min(lowest, engine.advance(t + latency_s))
            engine.abort(None, t + latency_s)
        t += period
    lowest = min(lowest, engine.advance(duration))
    return Outcome(decisions, lowest, engine)


# ---------------------------------------------------------------- the example configuration's head

# GB10 head with the recipe's settings, rebuilt from the notes in the example configuration:
# prefill ~1.5k tok/s at 1024-token chunks (slower as the prefix grows); the per-chunk transient
# proportional to chunk x prefix ("768 cuts that per-chunk peak by a quarter" from 1024); at 1024
# before the decode stack (2026-09-11) 208k prompts complete and a 256k prompt went 20 MB below
# the 1.5 GB guard; with the decode stack (2026-09-24) a ~200k prompt at 1024 ran the head out of
# memory; at 768 with the stack 100k prompts complete. Ended and aborted requests leave their KV
# pages touched (the pool keeps them, and the hook does not return them), so available memory
# does not come back after an abort; the next requests reuse those pages.
GB10_KV_PER_TOKEN = 12_000                    # KV pages touched per prompt token
GB10_TRANSIENT_PER_TOKEN2 = 20                # bytes per (chunk token x prefix token)
HEAD_BASE_BEFORE_DECODE_STACK = 9_783 * MB    # available on the idle head before the decode stack
DECODE_STACK_BYTES = 3_400 * MB               # what the decode adapters took from it


def gb10_rate(chunk: int) -> Callable[[int], float]:
    base = 1500.0 if chunk <= 1024 else 2100.0
    base *= 0.92 if chunk <= 768 else 1.0
    return lambda prefix: base / (1 + prefix / 400_000)


def gb10_head(chunk: int, decode_stack: bool = True) -> Engine:
    base = HEAD_BASE_BEFORE_DECODE_STACK - (DECODE_STACK_BYTES if decode_stack else 0)
    return Engine(base=base, chunk=chunk, rate=gb10_rate(chunk), kv_per_token=GB10_KV_PER_TOKEN,
                  transient=lambda take, prefix: GB10_TRANSIENT_PER_TOKEN2 * take * (prefix + take),
                  decode_s=2.0, kv_pool=True)


def gb10_guard(chunk: int) -> p.GuardSettings:
    """The defaults (1.5 GB guard, 1 s lead, 1 s envelope) with the head's cost per request."""
    return p.GuardSettings(cost=CostModel(GB10_KV_PER_TOKEN, GB10_TRANSIENT_PER_TOKEN2, chunk, 8192))


GB10_GUARD = gb10_guard(1024)


def prompt_minutes(tokens: int, chunk: int) -> float:
    rate = gb10_rate(chunk)
    return sum(chunk / rate(prefix) for prefix in range(0, tokens, chunk)) / 60


# ---------------------------------------------------------------- tests of the model itself

def test_the_prompts_the_notes_call_verified_complete_above_the_guard():
    assert gb10_head(768).add("a", 0, 100_000).advance(200) > GB10_GUARD.guard_bytes
    assert gb10_head(1024, decode_stack=False).add("a", 0, 208_000).advance(300) > GB10_GUARD.guard_bytes


def test_a_200k_prompt_at_chunk_1024_exhausts_the_head_with_the_decode_stack():
    engine = gb10_head(1024).add("long", 0, 200_000)
    assert engine.advance(60 * prompt_minutes(200_000, 1024) + 5) <= 0


def test_the_recipe_poll_lets_the_256k_prompt_go_20_mb_below_the_guard():
    for phase in (0.0, 0.25, 0.5, 0.75):
        out = run_poll(gb10_head(1024, decode_stack=False).add("p256k", 0, 256_000), GB10_GUARD.guard_bytes,
                       60 * prompt_minutes(256_000, 1024) + 5, phase)
        miss = GB10_GUARD.guard_bytes - out.lowest
        assert 10 * MB < miss < 30 * MB, (phase, miss)


def test_unguarded_a_256k_prompt_at_chunk_768_would_exhaust_the_head_with_the_decode_stack():
    assert gb10_head(768).add("p256k", 0, 256_000).advance(60 * prompt_minutes(256_000, 768) + 5) <= 0


def test_aborted_kv_is_kept_and_the_transient_returns_at_the_chunk_boundary():
    engine = gb10_head(768).add("a", 0, 50_000)
    engine.advance(10.0)
    before = engine.available()
    engine.abort("a", 10.0)
    engine.advance(12.0)
    after = engine.available()
    assert engine.inflight().requests == ()
    assert after > before  # the transient came back
    assert after == engine.base - engine.cache and engine.cache == engine.requests[0].prefilled * GB10_KV_PER_TOKEN
    # the next request reuses the pages the aborted one left before it touches new ones
    left = engine.requests[0].prefilled
    assert left < 20_000
    engine.add("b", 12.0, 20_000)
    engine.advance(12.0 + 60 * prompt_minutes(20_000, 768) + 0.5)  # b decodes
    assert engine.cache == 0 and engine.available() == engine.base - 20_000 * GB10_KV_PER_TOKEN
    engine.advance(engine.t + 3.0)  # b is done: its pages stay with the pool too
    assert engine.cache == 20_000 * GB10_KV_PER_TOKEN and engine.available() == engine.base - engine.cache
