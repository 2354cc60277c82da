"""The lowest available memory ahead, stepping the prefills still to come through a byte-exact
model of PyTorch's caching allocator and SGLang's KV pool (pure: no memory is touched).

The guard reaches it through one function, charge.projector. What it replays (the scheduler's
order, the allocator's blocks and segments, the KV pool, the prefill_empty_cache hook, the
ranks' admission gate): docs/guard-internals.md. The allocator's rules are written here again,
not imported from sim/allocator.py, on purpose: the stand-in is the independent implementation
tests/unit/test_guard_projection.py checks this one against, to the byte.
"""

from __future__ import annotations

import bisect
from typing import Iterable

from dsv41.admission import admits, step_bytes
from dsv41.cost import CostModel
from dsv41.inflight import InflightRequest

MiB = 1 << 20
POOL_PAGE = 2 * MiB         # the KV pool's memory is taken in pages of this (sim/kvpool.GRANULE)
SPLIT_REMAINDER = 1 * MiB   # kSmallSize: a large-pool block is split only when more than this is left
SMALL_SIZE = 1 * MiB        # kSmallSize: requests of up to this are served from the small pool
SMALL_BUFFER = 2 * MiB      # kSmallBuffer: the small pool's segment
MIN_LARGE_ALLOC = 10 * MiB  # below this a new segment is LARGE_BUFFER, else rounded to ROUND_LARGE
LARGE_BUFFER = 20 * MiB
ROUND_LARGE = 2 * MiB
ROUND = 512                 # every request is rounded up to this
UNHOOKED_EXACT_CHUNKS = 32  # a prompt without the hook stepped chunk by chunk up to this many


def segment_size(nbytes: int) -> int:
    """What the caching allocator asks the system for when no free block fits a request of
    `nbytes` (rounded), as c10/cuda/CUDACachingAllocator.cpp's get_allocation_size does."""
    if nbytes <= SMALL_SIZE:
        return SMALL_BUFFER
    return LARGE_BUFFER if nbytes < MIN_LARGE_ALLOC else -(-nbytes // ROUND_LARGE) * ROUND_LARGE


def round_size(nbytes: int) -> int:
    return max(ROUND, -(-nbytes // ROUND) * ROUND)


class _Segment:
    """A segment's blocks in address order, each [size, free]."""

    __slots__ = ("size", "blocks", "small")

    def __init__(self, size: int, blocks: list[list] | None = None, small: bool = False) -> None:
        self.size = size
        self.blocks = blocks if blocks is not None else [[size, True]]
        self.small = small  # of the small pool: its blocks serve requests of up to SMALL_SIZE alone


Handle = tuple[_Segment, list]


class _Allocator:
    """Available memory and the free blocks the process keeps, with the segments they belong to."""

    def __init__(self, available: int) -> None:
        self.available = available
        # (pool, size, seq, segment, block), sorted: the small pool's (0) before the large pool's (1)
        self._free: list[tuple[int, int, int, _Segment, list]] = []
        self._seq = 0
        self.kv_in_use = 0  # the KV pool: bytes of slots requests hold
        self.kv_pages = 0   # its pages ever used (what it holds from the system)
        self.kv_high = 0    # the most bytes of slots held at once (the ranks' gate counts from it)

    def kv_take(self, nbytes: int) -> None:
        """KV slots from the pool: free ones first, then new pages from the system."""
        self.kv_in_use += nbytes
        self.kv_high = max(self.kv_high, self.kv_in_use)
        pages = -(-self.kv_in_use // POOL_PAGE)
        if pages > self.kv_pages:
            self.available -= (pages - self.kv_pages) * POOL_PAGE
            self.kv_pages = pages

    def kv_give_back(self, nbytes: int) -> None:
        """Slots back to the pool: free for later KV, still the process's."""
        self.kv_in_use -= min(nbytes, self.kv_in_use)

    def free_bytes(self) -> int:
        return sum(f[1] for f in self._free)

    def largest_free(self) -> int:
        """The large pool's largest free block."""
        return self._free[-1][1] if self._free and self._free[-1][0] else 0

    def _index(self, segment: _Segment, block: list) -> None:
        self._seq += 1
        bisect.insort(self._free, (int(not segment.small), block[0], self._seq, segment, block),
                      key=lambda f: f[:3])

    def _unindex(self, segment: _Segment, block: list) -> None:
        i = bisect.bisect_left(self._free, (int(not segment.small), block[0]), key=lambda f: f[:2])
        while self._free[i][4] is not block:
            i += 1
        del self._free[i]

    def malloc(self, nbytes: int) -> Handle | None:
        if nbytes <= 0:
            return None
        size = round_size(nbytes)
        pool = int(size > SMALL_SIZE)
        i = bisect.bisect_left(self._free, (pool, size), key=lambda f: f[:2])
        if i < len(self._free) and self._free[i][0] == pool:  # best fit in its pool
            _, _, _, segment, block = self._free.pop(i)
        else:
            segment = _Segment(segment_size(size), small=not pool)
            self.available -= segment.size
            block = segment.blocks[0]
        if block[0] - size >= ROUND if segment.small else block[0] - size > SPLIT_REMAINDER:
            rest = [block[0] - size, True]
            segment.blocks.insert(_position(segment, block) + 1, rest)
            block[0] = size
            self._index(segment, rest)
        block[1] = False
        return segment, block

    def free(self, handle: Handle | None) -> None:
        if handle is None:
            return
        segment, block = handle
        block[1] = True
        blocks = segment.blocks
        i = _position(segment, block)
        if i + 1 < len(blocks) and blocks[i + 1][1]:
            self._unindex(segment, blocks[i + 1])
            block[0] += blocks.pop(i + 1)[0]
        if i > 0 and blocks[i - 1][1]:
            self._unindex(segment, blocks[i - 1])
            blocks[i - 1][0] += blocks.pop(i)[0]
            block = blocks[i - 1]
        self._index(segment, block)

    def add_free_segments(self, sizes: Iterable[int]) -> None:
        """Wholly free segments of these sizes (what a block that was a segment of its own leaves
        when it is freed: only a large-pool block is), indexed at once."""
        for size in sizes:
            self._seq += 1
            segment = _Segment(size)
            self._free.append((1, size, self._seq, segment, segment.blocks[0]))
        self._free.sort(key=lambda f: f[:3])

    def empty_cache(self) -> None:
        kept = []
        for entry in self._free:
            segment = entry[3]
            if len(segment.blocks) == 1:
                self.available += segment.size
            else:
                kept.append(entry)
        self._free = kept

    def clone(self, handles: Iterable[Handle]) -> tuple["_Allocator", dict[int, Handle]]:
        """A copy to project on, with the handles given mapped into it (by their block's id). Only
        the segments with a free block and those of the handles are copied: the others are wholly
        in use and stay so, since nothing the projection frees is in them."""
        handles = list(handles)
        copies: dict[int, _Segment] = {}
        mapped: dict[int, Handle] = {}
        blocks: dict[int, list] = {}
        for segment in [e[3] for e in self._free] + [h[0] for h in handles]:
            if id(segment) not in copies:
                copy = _Segment(segment.size, [list(b) for b in segment.blocks], segment.small)
                copies[id(segment)] = copy
                for old, new in zip(segment.blocks, copy.blocks):
                    blocks[id(old)] = new
        out = _Allocator(self.available)
        out._seq = self._seq
        out.kv_in_use, out.kv_pages, out.kv_high = self.kv_in_use, self.kv_pages, self.kv_high
        out._free = [(pool, size, seq, copies[id(segment)], blocks[id(block)])
                     for pool, size, seq, segment, block in self._free]
        for segment, block in handles:
            mapped[id(block)] = (copies[id(segment)], blocks[id(block)])
        return out, mapped


def _position(segment: _Segment, block: list) -> int:
    for i, b in enumerate(segment.blocks):
        if b is block:
            return i
    raise ValueError("block not in its segment")


def prefill_order(requests: Iterable[InflightRequest]) -> list[InflightRequest]:
    """The order the scheduler prefills them in: the request being chunk-prefilled first, then the
    others as they arrived (the list is in arrival order)."""
    reqs = list(requests)
    return [r for r in reqs if r.prefilling] + [r for r in reqs if not r.prefilling]


def next_step(queue: list[list], budget: int | None) -> list[tuple]:
    """The pieces (request, prefix, tokens) of the next prefill step as the scheduler plans it:
    the entries ([request, prefix, end]) in order, a chunk's token budget shared between them
    (None: no limit). Advances their prefixes and drops the entries that reach their end."""
    left, pieces = budget, []
    for entry in queue:
        r, prefix, end = entry
        take = end - prefix if left is None else min(left, end - prefix)
        pieces.append((r, prefix, take))
        entry[1] += take
        if left is not None:
            left -= take
            if left == 0:
                break
    queue[:] = [e for e in queue if e[1] < e[2]]
    return pieces


def history_batches(requests: list[InflightRequest], model: CostModel) -> list[list[tuple]]:
    """The prefill steps that brought the listed requests where they are, as (request, prefix,
    tokens) pieces: the ones done prefilling first (oldest first; planned with the chunk budget
    shared, as the scheduler does when they were queued together; without chunking each in a
    step of its own), then the ones being prefilled, whose pieces are known: a first one of what
    the budget had left (the remainder of their tokens done), then whole chunks."""
    chunk = model.chunk_tokens if model.chunk_tokens > 0 else None
    batches: list[list[tuple]] = []
    done = [[r, r.cached_tokens, r.prefilled_tokens]
            for r in sorted((r for r in requests if not r.waiting and not r.prefilling), key=lambda r: -r.age_s)
            if r.prefilled_tokens > r.cached_tokens]
    for queue in ([done] if chunk else [[e] for e in done]):
        while queue:
            batches.append(next_step(queue, chunk))
    left = chunk - sum(take for _, _, take in batches[-1]) if chunk and batches else None
    for r in (r for r in requests if r.prefilling):
        prefix = r.cached_tokens
        if r.prefilled_tokens <= prefix:
            continue
        first = (r.prefilled_tokens - prefix) % chunk if chunk else r.prefilled_tokens - prefix
        if first:
            if first == left:
                batches[-1].append((r, prefix, first))  # it began in the step the ones before it ended
            else:
                batches.append([(r, prefix, first)])
            prefix += first
        while prefix < r.prefilled_tokens:
            batches.append([(r, prefix, chunk)])
            prefix += chunk
        left = None
    return batches


def _hooked(pieces: list, model: CostModel) -> bool:
    """Whether the prefill_empty_cache hook runs around this step (a prompt in it long enough)."""
    return any(model.hooked(r) for r, _, _ in pieces)


def _allocate_batch(memory: _Allocator, pieces: list, model: CostModel, kv: dict[str, list] | None) -> list:
    """One prefill step's memory, as the engine takes it: the hook's empty_cache() first when a
    prompt in the step is long enough, then each piece's KV (kept, and recorded in `kv` when
    given: its allocator blocks, or with the KV pool its bytes) and its indexer buffers over its
    prefix; returns the buffers (freed when the step ends)."""
    if _hooked(pieces, model):
        memory.empty_cache()
    buffers = []
    for r, start, take in pieces:
        if model.kv_pool:
            block = model.token_bytes * take
            memory.kv_take(block)
        else:
            block = memory.malloc(model.token_bytes * take)
        if kv is not None:
            kv.setdefault(r.rid, []).append(block)
        buffers.append(memory.malloc(int(model.transient_bytes * take * (start + take))))
    return buffers


def _end_batch(memory: _Allocator, hooked: bool, buffers: list) -> None:
    for block in buffers:
        memory.free(block)
    if hooked:
        memory.empty_cache()  # the hook, before the next step


class Projection:
    """The allocator as the listed requests left it (replayed once), to project from for any
    split of them into kept and aborted (charge.choose asks for many)."""

    def __init__(self, level: int, requests: Iterable[InflightRequest], model: CostModel,
                 running_in_level: bool = False, kv_high_water_tokens: int | None = None) -> None:
        self.level, self.model, self.running_in_level = level, model, running_in_level
        requests = list(requests)
        self._memory = _Allocator(level)
        self._kv: dict[str, list] = {}
        for pieces in history_batches(requests, model):
            _end_batch(self._memory, _hooked(pieces, model), _allocate_batch(self._memory, pieces, model, self._kv))
        self._running: list = []
        self._running_hooked = False
        if running_in_level:
            pieces = [(r, r.prefilled_tokens, min(r.chunk_tokens, r.prompt_tokens - r.prefilled_tokens))
                      for r in requests if r.prefilling and r.chunk_tokens > 0]
            self._running = _allocate_batch(self._memory, pieces, model, self._kv)
            self._running_hooked = _hooked(pieces, model)
        self.taken = level - self._memory.available  # what the model says they hold from the system now
        if model.kv_pool and kv_high_water_tokens:
            # the pool's pages cover every slot ever held, ended requests' too: their free slots
            # serve the next KV at no cost (already in the level, so nothing is taken here)
            self._memory.kv_pages = max(self._memory.kv_pages,
                                        -(-kv_high_water_tokens * model.token_bytes // POOL_PAGE))
            self._memory.kv_high = max(self._memory.kv_high, kv_high_water_tokens * model.token_bytes)
        self._memory.available = level  # the level sampled holds all of it

    def _start(self, kept: list[InflightRequest], aborted: Iterable[InflightRequest]) -> tuple[_Allocator, list[list]]:
        """The allocator at the next step boundary and the queue of prefills to come from there."""
        gone = [h for r in aborted for h in self._kv.get(r.rid, ()) if h is not None]
        pooled = sum(gone) if self.model.kv_pool else 0
        gone = [] if self.model.kv_pool else gone
        whole = [h[0].size for h in gone if len(h[0].blocks) == 1]  # a segment of its own: freed, wholly free
        gone = [h for h in gone if len(h[0].blocks) > 1]
        running = [h for h in self._running if h is not None]
        memory, mapped = self._memory.clone(gone + running)
        # The step now running ends (its buffers freed; with the hook, returned), then the
        # aborted requests end at that boundary.
        _end_batch(memory, self._running_hooked, [mapped[id(h[1])] for h in running])
        memory.add_free_segments(whole)
        for h in gone:
            memory.free(mapped[id(h[1])])
        memory.kv_give_back(pooled)
        queue = []
        for r in prefill_order(kept):
            prefix = r.prefilled_tokens
            if self.running_in_level and r.prefilling and r.chunk_tokens > 0:
                prefix += min(r.chunk_tokens, r.prompt_tokens - prefix)
            if prefix < r.prompt_tokens:
                queue.append([r, prefix, r.prompt_tokens])
        return memory, queue

    def held_at_next_step(self, kept: Iterable[InflightRequest], aborted: Iterable[InflightRequest]) -> set[str]:
        """The requests the ranks hold back at the next step: by their admission gate, or waiting for
        KV pool slots (and those behind them, in order)."""
        kept = list(kept)
        memory, queue = self._start(kept, aborted)
        budget = self.model.chunk_tokens if self.model.chunk_tokens > 0 else None
        held = _first_without_slots(memory, queue, budget, self.model)
        gated = _gated(kept, memory, self.model)
        if gated:
            held = min(held, _first_held(memory, queue, budget, self.model, gated))
        return {e[0].rid for e in queue[held:]}

    def low(self, kept: Iterable[InflightRequest], aborted: Iterable[InflightRequest]) -> int:
        """The lowest available memory ahead if `kept` run to the end of their prefill and
        `aborted` end at the next step boundary, leaving what they hold cached for the others."""
        model = self.model
        kept = list(kept)
        memory, queue = self._start(kept, aborted)
        low = self.level
        budget = model.chunk_tokens if model.chunk_tokens > 0 else None
        gated = _gated(kept, memory, model)
        while queue:
            if _first_without_slots(memory, queue[:1], budget, model) == 0:
                break  # the head waits for KV pool slots, which requests ending give back
            if queue[0][0].rid not in gated:  # a request the gate let in: its middle chunks at once
                low = _run_at_once(memory, queue[0], model, low)
            held = len(queue) if not gated else _first_held(memory, queue, budget, model, gated)
            held = min(held, _first_without_slots(memory, queue, budget, model))
            if held == 0:
                break  # the head of the queue waits for requests to end, which the projection does not see
            admitted, waiting = queue[:held], queue[held:]
            pieces = next_step(admitted, budget)
            queue[:] = admitted + waiting
            for r, _, _ in pieces:
                gated.discard(r.rid)
            buffers = _allocate_batch(memory, pieces, model, None)
            low = min(low, memory.available)
            _end_batch(memory, _hooked(pieces, model), buffers)
        return low


def _gated(kept: list[InflightRequest], memory: _Allocator, model: CostModel) -> set[str]:
    """The waiting requests the admission gate applies to (none without a gate): those that could
    fit were every other request's KV given back (the others end before it, at worst). With the
    KV pool what they give back stays the pool's: it serves the request's KV (every page the pool
    has is free then), never its buffers."""
    if model.admission_guard_bytes <= 0:
        return set()
    room = memory.available + memory.free_bytes() - model.admission_guard_bytes
    if not model.kv_pool:
        room += sum(model.held(r) for r in kept)
        return {r.rid for r in kept if r.waiting and model.kv_to_come(r) + model.transient_peak(r) <= room}
    pages = memory.kv_pages * POOL_PAGE
    return {r.rid for r in kept
            if r.waiting and max(0, model.kv_to_come(r) - pages) + model.transient_peak(r) <= room}


def _first_held(memory: _Allocator, queue: list[list], budget: int | None, model: CostModel,
                gated: set[str]) -> int:
    """The index in the queue of the first entry the admission gate holds this step (len(queue):
    none), by the step the scheduler would plan: the gate's rule (admission_gate.admits) over the
    pieces in order (the rank's own rule and count: dsv41/admission.py), the headroom being
    available memory plus the allocator's free blocks, KV pool slots used before and free now
    costing nothing. Only `gated` requests are held: one that could not fit even once the others
    end is counted as starting (the gate holds it alone for the guard to abort)."""
    headroom = memory.available + memory.free_bytes()
    left, spent = budget, 0
    kv_free = max(0, memory.kv_high - memory.kv_in_use) // model.token_bytes \
        if model.kv_pool and model.token_bytes > 0 else 0
    for i, (r, prefix, end) in enumerate(queue):
        take = end - prefix if left is None else min(left, end - prefix)
        need = step_bytes(take, prefix, model.token_bytes, model.transient_bytes, kv_free)
        kv_free = max(0, kv_free - take)
        if r.rid in gated and not admits(headroom, spent, need, model.admission_guard_bytes):
            return i
        spent += need
        if left is not None:
            left -= take
            if left == 0:
                break
    return len(queue)


def _first_without_slots(memory: _Allocator, queue: list[list], budget: int | None, model: CostModel) -> int:
    """The index in the queue of the first request not yet started that waits for KV pool slots
    this step (len(queue): none, or the pool has no limit): its rest is not below the slots left
    once the pieces before it are taken. The request being chunk-prefilled always goes on."""
    if not model.kv_pool or model.kv_pool_tokens <= 0 or model.token_bytes <= 0:
        return len(queue)
    room = model.kv_pool_tokens - memory.kv_in_use // model.token_bytes
    left = budget
    for i, (r, prefix, end) in enumerate(queue):
        if not started(r, prefix) and end - prefix >= room:
            return i
        take = end - prefix if left is None else min(left, end - prefix)
        room -= take
        if left is not None:
            left -= take
            if left == 0:
                break
    return len(queue)


def started(r: InflightRequest, prefix: int) -> bool:
    """Whether the request has taken a step (listed so, or one projected since the listing)."""
    return not r.waiting or prefix > r.prefilled_tokens


def _run_at_once(memory: _Allocator, entry: list, model: CostModel, low: int) -> int:
    """The whole chunks in the middle of a long prompt, at once; the last piece is left to the
    stepping (it may share its step). With the hook every chunk starts from an empty cache, so
    once no free block is left that its KV or its buffers fit, each takes a new segment for both
    and gives the buffers' back: the lowest is at the last of them (exact). Without it, past
    UNHOOKED_EXACT_CHUNKS chunks each chunk's buffers are counted as a new segment that stays (the
    allocator keeps them; it reuses some, which this errs low by). With the KV pool the chunks'
    KV is the pool's (its pages grow with it alone, exact). Advances entry's prefix past them;
    returns the low so far."""
    r, prefix, until = entry
    chunk = model.chunk_tokens
    if chunk <= 0:
        return low
    n = (until - prefix - 1) // chunk
    pooled = n * chunk * model.token_bytes if model.kv_pool else 0
    kv = round_size(model.token_bytes * chunk) if model.token_bytes and not model.kv_pool else 0
    end = prefix + n * chunk
    if not model.hooked(r):
        if n <= UNHOOKED_EXACT_CHUNKS:
            return low
        memory.kv_take(pooled)
        memory.available -= n * (segment_size(kv) if kv else 0)
        memory.available -= sum(segment_size(round_size(int(model.transient_bytes * chunk * p)))
                                for p in range(prefix + chunk, end + 1, chunk)) if model.transient_bytes else 0
        entry[1] = end
        return min(low, memory.available)
    buffers = model.transient_bytes > 0
    first = round_size(int(model.transient_bytes * chunk * (prefix + chunk))) if buffers else 0
    if n < 2 or (kv and (kv < MIN_LARGE_ALLOC or segment_size(kv) - kv > SPLIT_REMAINDER)) \
            or (buffers and first < MIN_LARGE_ALLOC) or not (kv or buffers or pooled):
        return low
    memory.empty_cache()
    sizes = [x for x in (kv, first) if x]
    if sizes and memory.largest_free() >= min(sizes):
        return low  # a free block would serve some of them: step them one by one
    memory.kv_take(pooled)
    memory.available -= n * (segment_size(kv) if kv else 0)
    entry[1] = end
    last = segment_size(round_size(int(model.transient_bytes * chunk * end))) if buffers else 0
    return min(low, memory.available - last)


def projected_low(level: int, kept: Iterable[InflightRequest], aborted: Iterable[InflightRequest],
                  model: CostModel, running_in_level: bool = False, kv_high_water_tokens: int | None = None) -> int:
    """The lowest available memory ahead if `kept` run to the end of their prefill and `aborted`
    leave what they hold in the allocator for them. `running_in_level`: the level was sampled
    after the step now running was launched, so it holds that step's KV and buffers.
    `kv_high_water_tokens`: the KV pool's high-water mark as rank 0 lists it."""
    kept, aborted = list(kept), list(aborted)
    return Projection(level, kept + aborted, model, running_in_level, kv_high_water_tokens).low(kept, aborted)
