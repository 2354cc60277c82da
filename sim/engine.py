"""The stand-in's scheduler, shaped like SGLang's: requests wait in arrival order; a prefill batch
of at most --chunked-prefill-size tokens takes the request being chunk-prefilled first
(`Scheduler.chunked_req`), then waiting requests while --max-running-requests allows, whole while
they fit and the last one cut (it becomes the chunked request): one request is chunk-prefilled at
a time. Prefill runs at a fixed token rate; then every decoding request makes one token per decode
step, all in one batch. An abort takes effect at the next chunk boundary, as in SGLang.

Memory is real and goes through a model of PyTorch's caching allocator (sim/allocator.py): every
prefill chunk allocates the KV of its tokens (DSV41_SIM_BYTES_PER_TOKEN each), held by the request
until it finishes, and for the chunk's duration the indexer's logits buffer [chunk, prefix]
(DSV41_SIM_TRANSIENT_BYTES per chunk token and prefix token; the low-ratio layers reuse one
block, so one is live at a time). A finished or aborted request's memory goes back to the
allocator's cache, not to the OS; only empty_cache() returns it, which the prefill_empty_cache
hook runs after a chunk of a sequence of at least DSV41_PREFILL_EMPTY_CACHE_TOKENS. With
`kv_pool` the KV goes to a pool as SGLang's does (sim/kvpool.py): its memory is taken once, the
first time the pool's slots are used, never given back, and reused by later requests' KV alone;
with --max-total-tokens slots, a request waits while its prompt does not fit in the free ones,
and a prompt that can never fit is refused (input_refusal).

Every forward step (a prefill chunk or a decode batch) begins with `begin_step()`: the rank's
progress counter moves and, in a TP group, rank 0 waits for every worker to take part in the step
(sim/group.py), so a stopped worker stalls generation here. The lock is never held meanwhile:
the HTTP side (in-flight listing, aborts) keeps answering while a step hangs, as SGLang's
tokenizer process does."""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from adapter.admission_gate import HoldReport, NodeRoom
from dsv41.admission import GateSettings, admits, pieces_bytes

from .allocator import AnonymousMemory, Block, CachingAllocator
from .kvpool import KvPool


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


# What /dsv41/inflight calls each phase (the adapter's route inside SGLang uses the same words).
STATES = {Phase.WAITING: "waiting", Phase.PREFILL: "prefilling", Phase.DECODE: "decoding"}


class Rejected(Exception):
    """A request the engine does not take; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(eq=False)
class Request:
    rid: str
    prompt_tokens: int
    created: float
    prefilled: int = 0
    cached: int = 0  # prompt tokens found in the prefix cache (prefilled from the start, no new KV)
    generated: int = 0
    wanted: int = 0  # output tokens its client asked for so far (the decode step makes them)
    phase: Phase = Phase.WAITING
    finish_reason: str | None = None
    abort_requested: bool = False
    abort_sent: bool = False  # the tokenizer side took an abort of this rid: a repeat is dropped
    chunk_tokens: int = 0  # its tokens in the prefill step now running (0: none)
    blocks: list[Block] = field(default_factory=list)  # its KV, in the allocator
    pool_tokens: int = 0  # its KV's slots in the KV pool (kv_pool mode)
    pool_bytes: int = 0

    @property
    def held_bytes(self) -> int:
        return sum(b.size for b in self.blocks) + self.pool_bytes


@dataclass(frozen=True)
class EngineConfig:
    chunk_tokens: int  # -1: no chunking, a prompt is prefilled at once
    max_running: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    bytes_per_token: int
    max_total_tokens: int  # the KV pool's slots (kv_pool mode; 0: no limit); refuses longer prompts
    context_length: int | None
    transient_bytes: float = 0.0  # per chunk token and prefix token, for the chunk's duration
    empty_cache_tokens: int = 0  # the prefill_empty_cache hook's threshold (0: off)
    admission: GateSettings | None = None  # the admission gate's settings (None: off)
    kv_pool: bool = False  # KV in SGLang's pool (sim/kvpool.py), not in the caching allocator


def plan_chunk(pending: list[tuple[str, int]], budget: int, free_slots: int | None = None,
               chunked: bool = False) -> list[tuple[str, int]]:
    """One prefill batch: FCFS over (rid, tokens still to prefill), at most `budget` tokens in all
    (budget < 0: unlimited); the last request taken may be cut (chunked).

    With the KV pool's `free_slots` (None: no limit), SGLang 0.5.23's PrefillAdder: a request not
    yet started goes in only while the free slots, less what this batch already takes, exceed its
    whole rest (PrefillBudget.check_prefill: `total_tokens < remaining_total`); the first one that
    does not, and every one after it, waits. The request being chunk-prefilled (`chunked`: the
    first of `pending`) always goes on: its piece is cut to the free slots while any are left
    (available_chunk_tokens: "single-pool continuation must make progress"), else it asks for a
    whole chunk, and the allocation fails as SGLang's does. SGLang also reserves each request's
    expected output (up to 4096 tokens, less for running ones) and one slot more; the stand-in's
    decode takes no slots and reserves none, so it admits a little more than SGLang: harder on
    memory, not kinder (tests/sglang/test_kv_pool_admission.py runs SGLang's own adder)."""
    batch = []
    room = free_slots
    for i, (rid, remaining) in enumerate(pending):
        if budget == 0:
            break
        take = remaining if budget < 0 else min(remaining, budget)
        if room is not None:
            if i == 0 and chunked:
                take = min(take, room) if room > 0 else take
            elif remaining >= room:
                break
            room -= take
        if take > 0:
            batch.append((rid, take))
            if budget > 0:
                budget -= take
    return batch


def input_refusal(prompt_tokens: int, context_length: int | None, max_total_tokens: int) -> str | None:
    """Why SGLang 0.5.23 refuses a prompt of this length, None when it takes it: the tokenizer's
    check against the context length (TokenizerManager._validate_one_request: `>=`), then the
    scheduler's against what one request may hold, the KV pool less one slot and 5 more
    (TpModelWorker: max_req_input_len = min(context_len - 1, pool - 1) - 5; validate_input_length:
    `>=`, finished as an abort with status 400)."""
    if context_length is not None and prompt_tokens >= context_length:
        return f"The input ({prompt_tokens} tokens) is longer than the model's context length ({context_length} tokens)."
    limits = [n - 1 for n in (context_length, max_total_tokens) if n]
    if limits and prompt_tokens >= min(limits) - 5:
        return (f"Input length ({prompt_tokens} tokens) exceeds the maximum allowed length ({min(limits) - 5} tokens). "
                "Use a shorter input or enable --allow-auto-truncate.")
    return None


def empties_cache(prompt_lengths: list[int], threshold: int) -> bool:
    """The prefill_empty_cache hook's rule (adapter/prefill_empty_cache.should_empty_cache)."""
    return threshold > 0 and any(n >= threshold for n in prompt_lengths)


class Engine:
    def __init__(self, config: EngineConfig, on_fatal: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 begin_step: Callable[[], None] = lambda: None,
                 allocator: CachingAllocator | None = None,
                 node_room: Callable[[], int] | None = None,
                 log: Callable[[str], None] = lambda line: None,
                 kv_pool: KvPool | None = None) -> None:
        self.config = config
        self._holds = HoldReport(log)  # the gate's lines, as the rank's gate writes them
        self._node_room = node_room or NodeRoom()  # the admission gate's measure of the node
        self._on_fatal = on_fatal
        self._clock = clock
        self._sleep = sleep
        self._begin_step = begin_step
        self.allocator = allocator or CachingAllocator(AnonymousMemory())
        self.kv_pool = kv_pool if kv_pool is not None else \
            KvPool(AnonymousMemory(), config.bytes_per_token, capacity=config.max_total_tokens) \
            if config.kv_pool else None
        self._cond = threading.Condition()
        self._requests: dict[str, Request] = {}  # in arrival order; finished ones are removed
        self._last_step_at = float("-inf")  # time.monotonic() when the last forward step completed
        self._launched_at: float | None = None  # when the prefill step now running was launched (its memory taken)
        self._kv_high_water = 0  # the KV pool's high-water mark when the last step ended (kv_pool mode)
        self._alone: tuple[str, float] | None = None  # the gate's request waiting with nothing else in flight, since
        self._accepting = True
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # --- the tokenizer side -------------------------------------------------------------------

    def submit(self, rid: str, prompt_tokens: int, cached_tokens: int = 0) -> Request:
        """A request in the waiting queue. `cached_tokens` of its prompt are a prefix-cache hit:
        counted as prefilled from the start, with no KV of their own (the cache holds it), while
        every chunk's indexer buffers still span the whole prefix. The HTTP side has no prefix
        cache (0); the guard's scenario benchmark uses it."""
        refusal = input_refusal(prompt_tokens, self.config.context_length, self.config.max_total_tokens)
        if refusal:
            raise Rejected(400, refusal)
        with self._cond:
            if not self._accepting:
                raise Rejected(503, "The server is shutting down; not accepting new requests.")
            if rid in self._requests:
                raise Rejected(400, f"Duplicate request ID: {rid}")
            prompt = max(prompt_tokens, 1)
            cached = min(max(0, cached_tokens), prompt - 1)  # the last token is always computed
            request = Request(rid, prompt, self._clock(), prefilled=cached, cached=cached)
            self._requests[rid] = request
            self._cond.notify_all()
            return request

    def abort(self, rid: str, abort_all: bool = False) -> list[str]:
        """Flags requests for abort and returns their rids. Like SGLang 0.5.23 with one tokenizer
        worker: an empty rid without abort_all does nothing; otherwise the rid must be one in flight
        whose abort was not sent already (TokenizerManager.abort_request drops a repeat silently),
        and then every request whose rid starts with it is aborted (the scheduler's prefix match)."""
        with self._cond:
            if abort_all:
                chosen = list(self._requests.values())
            elif not rid or rid not in self._requests or self._requests[rid].abort_sent:
                chosen = []
            else:
                self._requests[rid].abort_sent = True
                chosen = [r for r in self._requests.values() if r.rid.startswith(rid)]
            for request in chosen:
                request.abort_requested = True
                if request.phase is Phase.WAITING:
                    self._finish_locked(request, "abort")
            self._cond.notify_all()
            return [r.rid for r in chosen]

    def wait_prefilled(self, request: Request) -> None:
        """Blocks until the request's prefill is done or it finished (aborted)."""
        with self._cond:
            while request.phase in (Phase.WAITING, Phase.PREFILL):
                self._cond.wait()

    def next_token(self, request: Request) -> bool:
        """Waits for the decode step that makes this request's next token; False when the request
        was aborted (then it is finished)."""
        with self._cond:
            if request.abort_requested or request.phase is Phase.FINISHED:
                self._finish_locked(request, "abort")
                return False
            request.wanted += 1
            self._cond.notify_all()
            while request.generated < request.wanted and not request.abort_requested \
                    and request.phase is not Phase.FINISHED:
                self._cond.wait()
            if request.abort_requested or request.phase is Phase.FINISHED:
                self._finish_locked(request, "abort")
                return False
            return True

    def cancel(self, request: Request) -> None:
        """Aborts one request whose client went away. A prefill in progress ends at the chunk
        boundary (the scheduler owns its memory until then)."""
        with self._cond:
            request.abort_requested = True
            if request.phase in (Phase.WAITING, Phase.DECODE):
                self._finish_locked(request, "abort")
            self._cond.notify_all()

    def finish(self, request: Request, reason: str) -> None:
        with self._cond:
            self._finish_locked(request, "abort" if request.abort_requested else reason)

    def stop_accepting(self) -> None:
        with self._cond:
            self._accepting = False

    @property
    def last_step_at(self) -> float:
        """time.monotonic() when the last forward step completed (-inf before the first)."""
        with self._cond:
            return self._last_step_at

    @property
    def accepting(self) -> bool:
        with self._cond:
            return self._accepting

    def wait_idle(self, timeout_s: float) -> bool:
        """True once no request is in flight; False after timeout_s (real time, not the clock
        that stamps request ages)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._requests:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.1))
            return True

    # --- what the HTTP side reports -------------------------------------------------------------

    def inflight(self) -> list[dict]:
        """The unfinished requests in arrival order, as the scheduler knows them (the schema of
        adapter/inflight.py; over HTTP the stand-in has no prefix cache, so nothing is served from one).

        A waiting prefix-cache hit is listed with its match as prefilled and cached, as the
        adapter lists it on SGLang (adapter/scheduler_requests.py matches each waiting request
        once, since SGLang under --schedule-policy fcfs matches it only when it builds its first
        step); the stand-in's cache never evicts, so that match holds until it starts."""
        now = self._clock()
        with self._cond:
            return [{"rid": r.rid, "prompt_tokens": r.prompt_tokens, "prefilled_tokens": r.prefilled,
                     "cached_tokens": r.cached, "state": STATES[r.phase], "chunk_tokens": r.chunk_tokens,
                     "output_tokens": r.generated, "age_s": round(now - r.created, 3)}
                    for r in self._requests.values()]

    def kv_high_water(self) -> int | None:
        """The KV pool's high-water mark (tokens) as of the last step that ended, as the adapter's
        route lists it (the step now running not counted); None without the pool."""
        with self._cond:
            return self._kv_high_water if self.kv_pool is not None else None

    def loads(self) -> dict:
        with self._cond:
            active = list(self._requests.values())
        waiting = [r for r in active if r.phase is Phase.WAITING]
        running = [r for r in active if r.phase in (Phase.PREFILL, Phase.DECODE)]
        used = sum(r.prefilled + r.generated for r in running)
        total = self.config.max_total_tokens
        memory = self.allocator.stats()
        return {
            "dp_rank": 0,
            "num_running_reqs": len(running),
            "num_waiting_reqs": len(waiting),
            "num_waiting_uncached_tokens": sum(r.prompt_tokens for r in waiting),
            "num_used_tokens": used,
            "num_total_tokens": used,
            "max_total_num_tokens": total,
            "max_running_requests": self.config.max_running,
            "token_usage": round(used / total, 6) if total else 0.0,
            "memory_bytes": memory.allocated,
            "memory_reserved_bytes": memory.reserved,
        }

    # --- the scheduler --------------------------------------------------------------------------

    def _finish_locked(self, request: Request, reason: str) -> None:
        if request.phase is Phase.FINISHED:
            return
        request.phase = Phase.FINISHED
        request.finish_reason = reason
        request.chunk_tokens = 0
        blocks, request.blocks = request.blocks, []
        for block in blocks:  # back to the allocator's cache: the process keeps the memory
            self.allocator.free(block)
        if request.pool_tokens and self.kv_pool is not None:  # back to the pool's free list: the same
            self.kv_pool.give_back(request.pool_tokens)
        request.pool_tokens = request.pool_bytes = 0
        self._requests.pop(request.rid, None)
        self._cond.notify_all()

    def _next_batch(self) -> list[tuple[Request, int]] | None:
        """Under the lock, at a chunk boundary: finishes aborted prefills, then plans the next
        prefill batch as SGLang's PrefillAdder does (the chunked request first, then waiting
        requests in arrival order while the running count allows)."""
        for request in list(self._requests.values()):
            if request.abort_requested and request.phase in (Phase.WAITING, Phase.PREFILL):
                self._finish_locked(request, "abort")
        running = sum(1 for r in self._requests.values() if r.phase in (Phase.PREFILL, Phase.DECODE))
        admissible = max(0, self.config.max_running - running)
        chunked = [r for r in self._requests.values() if r.phase is Phase.PREFILL]
        waiting = [r for r in self._requests.values() if r.phase is Phase.WAITING][:admissible]
        pending = {r.rid: r for r in chunked + waiting}
        batch = plan_chunk([(rid, r.prompt_tokens - r.prefilled) for rid, r in pending.items()],
                           self.config.chunk_tokens, self.kv_pool.free_slots() if self.kv_pool else None,
                           bool(chunked))
        planned = self._admitted([(pending[rid], take) for rid, take in batch], bool(chunked))
        for request, take in planned:
            request.phase = Phase.PREFILL
            request.chunk_tokens = take
        return planned or None

    def _admitted(self, planned: list[tuple[Request, int]], chunked: bool) -> list[tuple[Request, int]]:
        """The planned batch as the admission gate lets it go (adapter/admission_gate.py): the first
        waiting request whose first piece would take the node below the guard, and those after it,
        stay waiting; one with nothing else in flight at most the gate's lone_wait_s (for the guard
        to abort it). Headroom as the rank measures it: the node's room plus what the allocator holds free
        (one rank: no all-reduce); KV pool slots used before and free now cost nothing."""
        gate = self.config.admission
        if gate is None or not any(r.phase is Phase.WAITING for r, _ in planned):
            return planned
        alone = not chunked and not any(r.phase is Phase.DECODE for r in self._requests.values())
        stats = self.allocator.stats()
        headroom = self._node_room() + stats.reserved - stats.allocated
        kv_free = self.kv_pool.high_water - self.kv_pool.in_use if self.kv_pool is not None else 0
        needs, _ = pieces_bytes([(take, r.prefilled) for r, take in planned], gate, kv_free)
        spent = 0
        for i, ((request, take), need) in enumerate(zip(planned, needs)):
            if request.phase is Phase.WAITING:
                first = alone and i == 0
                fits = admits(headroom, spent, need, gate.guard_bytes) or (first and gate.lone_wait_s <= 0)
                waited = first and self._alone is not None and self._alone[0] == request.rid \
                    and self._clock() - self._alone[1] >= gate.lone_wait_s
                if not fits and not waited:
                    if first and (self._alone is None or self._alone[0] != request.rid):
                        self._alone = (request.rid, self._clock())
                    self._holds.held(request.rid, take, request.prefilled, need, spent, headroom, gate.guard_bytes,
                                     alone_s=gate.lone_wait_s if first else 0.0)
                    return planned[:i]
                if self._alone is not None and self._alone[0] == request.rid:
                    self._alone = None
                self._holds.admitted(request.rid, headroom, spent + need,
                                     waited_alone_s=0.0 if fits else gate.lone_wait_s)
            spent += need
        return planned

    def _decoding(self) -> list[Request]:
        """Under the lock: the requests the next decode step makes a token for."""
        return [r for r in self._requests.values()
                if r.phase is Phase.DECODE and r.wanted > r.generated and not r.abort_requested]

    def _decode_step(self, batch: list[Request]) -> None:
        self._sleep(1.0 / self.config.decode_tokens_per_s)
        with self._cond:
            for request in batch:
                if request.phase is Phase.DECODE and not request.abort_requested:
                    request.generated += 1
            self._last_step_at = time.monotonic()
            self._cond.notify_all()

    def next_prefill(self) -> list[tuple[Request, int]] | None:
        """The next prefill batch (see _next_batch), for a caller that steps the scheduler itself on
        its own clock (the guard's scenario benchmark) instead of start()."""
        with self._cond:
            return self._next_batch()

    def allocate_chunk(self, batch: list[tuple[Request, int]]) -> list[Block]:
        """The chunk's memory: the KV of its tokens (kept by each request) and the indexer's
        logits buffer over each request's prefix (returned when the chunk ends); the transients."""
        transients = []
        cfg = self.config
        # The prefill_empty_cache adapter runs before a long prompt's chunk is launched too: what
        # the short prompts before it left cached goes back before its first chunk.
        if empties_cache([r.prompt_tokens for r, _ in batch], cfg.empty_cache_tokens):
            self.allocator.empty_cache()
        for request, take in batch:
            if self.kv_pool is not None:
                self.kv_pool.take(take)
                with self._cond:
                    request.pool_tokens += take
                    request.pool_bytes += take * cfg.bytes_per_token
                    if request.phase is Phase.FINISHED:  # aborted meanwhile: its slots go back at once
                        self.kv_pool.give_back(request.pool_tokens)
                        request.pool_tokens = request.pool_bytes = 0
                kv = None
            else:
                kv = self.allocator.malloc(take * cfg.bytes_per_token)
            if kv is not None:
                with self._cond:
                    request.blocks.append(kv)  # freed with the request, also if it was aborted meanwhile
                    if request.phase is Phase.FINISHED:
                        self.allocator.free(request.blocks.pop())
            block = self.allocator.malloc(int(cfg.transient_bytes * take * (request.prefilled + take)))
            if block is not None:
                transients.append(block)
        with self._cond:
            self._launched_at = self._clock()
        return transients

    def step_launched_at(self) -> float | None:
        """When the prefill step now running was launched, on this engine's clock (the route's
        step_launched_monotonic_s); None between steps."""
        with self._cond:
            return self._launched_at

    def _run(self) -> None:
        # Touching pages takes real time (about 0.4 s per GiB): it is part of the chunk's time, and
        # what exceeds it is taken from the next chunk's, so that the prefill keeps its rate.
        debt = 0.0
        while True:
            with self._cond:
                batch = self._next_batch()
                decoding = [] if batch else self._decoding()
                while batch is None and not decoding and not self._closed:
                    debt = 0.0
                    self._cond.wait()
                    batch = self._next_batch()
                    decoding = [] if batch else self._decoding()
                if self._closed:
                    return
            self._begin_step()  # the collective: may wait for a peer, or end the process (watchdog)
            if batch is None:
                self._decode_step(decoding)
                continue
            started = self._clock()
            try:
                transients = self.allocate_chunk(batch)
            except (MemoryError, OSError) as exc:
                # Like a CUDA out-of-memory error in SGLang's scheduler: the rank dies.
                wanted = sum(take for _, take in batch) * self.config.bytes_per_token
                self._on_fatal(f"out of memory prefilling request {batch[0][0].rid} "
                               f"({wanted} more bytes of KV and the chunk's buffers): {exc}")
                return
            left = self.chunk_seconds(batch) - debt - (self._clock() - started)
            self._sleep(max(0.0, left))
            debt = max(0.0, -left)
            self.end_chunk(batch, transients)

    def chunk_seconds(self, batch: list[tuple[Request, int]]) -> float:
        return sum(take for _, take in batch) / self.config.prefill_tokens_per_s

    def end_chunk(self, batch: list[tuple[Request, int]], transients: list[Block]) -> None:
        """The chunk's forward is done: its buffers go back to the allocator, its tokens are
        prefilled (a request whose abort came meanwhile is finished at the next boundary)."""
        for block in transients:
            self.allocator.free(block)
        with self._cond:
            self._launched_at = None
            if self.kv_pool is not None:
                self._kv_high_water = self.kv_pool.high_water
            for request, take in batch:
                request.chunk_tokens = 0
                if request.phase is Phase.PREFILL and not request.abort_requested:
                    request.prefilled += take
                    if request.prefilled >= request.prompt_tokens:
                        request.phase = Phase.DECODE
            self._last_step_at = time.monotonic()
            self._cond.notify_all()
        # The prefill_empty_cache adapter: after a chunk of a long sequence (before the next
        # batch's launch, where the adapter runs, whatever that batch is) every wholly free cached
        # segment goes back.
        if empties_cache([r.prompt_tokens for r, _ in batch], self.config.empty_cache_tokens):
            self.allocator.empty_cache()
