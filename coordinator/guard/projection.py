"""The lowest available memory ahead, stepping the prefills still to come through a model of the
caching allocator (pure: no memory is touched).

What the engine does, per rank (SGLang's scheduler and PyTorch's caching allocator; the stand-in,
sim/engine.py and sim/allocator.py, does the same):
- the request being chunk-prefilled goes on first, then the waiting ones as they arrived
  (--schedule-policy fcfs, SGLang's default), one chunk at a time;
- each chunk allocates its tokens' KV, which the request keeps, and the indexer's buffers
  (transient_bytes x chunk x prefix), freed after the chunk;
- a freed block stays with the process, and a later allocation it fits is served from it (the
  smallest that fits, split when more than 1 MiB would be left over): a prompt's buffers reuse
  those an earlier prompt's chunks at the same prefixes left, and KV reuses what an aborted
  request held;
- before a chunk of a prompt of at least the prefill_empty_cache threshold, and before the batch
  after its last chunk, every free block goes back to the system (empty_cache), so such a
  prompt's low is at its last chunk and it leaves nothing cached.
The level sampled holds the buffers of the chunks already done by the request being prefilled
(free, in the allocator's cache; with the hook only the last one's: done_chunk_buffers). The
chunk now running is in it too when the sample was taken after the step was launched (rank 0's
scheduler says when: adapter/scheduler_requests.py); otherwise it is counted as still to come.
Blocks freed by requests that have ended are not known, so not counted: the projection errs low,
not high, by what they are.

The allocator's rules are written here again, not imported from sim/allocator.py, on purpose:
the stand-in is the independent implementation tests/unit/test_guard_projection.py checks this
one against.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:  # charge.py imports this module
    from .charge import CostModel, InflightRequest

MiB = 1 << 20
SPLIT_REMAINDER = 1 * MiB   # kSmallSize: a block is split only when more than this is left
MIN_LARGE_ALLOC = 10 * MiB  # below this a new segment is LARGE_BUFFER, else rounded to ROUND_LARGE
LARGE_BUFFER = 20 * MiB
ROUND_LARGE = 2 * MiB
EXACT_CHUNKS = 16           # an unhooked prompt with more chunks left than this is counted at once


def segment_size(nbytes: int) -> int:
    """What the caching allocator asks the system for when no free block fits (as
    c10/cuda/CUDACachingAllocator.cpp does for the large pool)."""
    return LARGE_BUFFER if nbytes < MIN_LARGE_ALLOC else -(-nbytes // ROUND_LARGE) * ROUND_LARGE


class _Allocator:
    """Available memory and the free blocks the process keeps. A block of at least
    MIN_LARGE_ALLOC was a segment of its own, which empty_cache() returns once it is free; a
    smaller one shares a LARGE_BUFFER segment with others, and stays (it is still reused)."""

    def __init__(self, available: int) -> None:
        self.available = available
        self.whole: list[int] = []   # free blocks that are whole segments, sorted
        self.shared: list[int] = []  # free blocks in segments partly in use, sorted

    def malloc(self, nbytes: int) -> None:
        if nbytes <= 0:
            return
        fits = [(pool[i], pool) for pool in (self.whole, self.shared)
                if (i := bisect.bisect_left(pool, nbytes)) < len(pool)]
        if fits:
            block, pool = min(fits, key=lambda f: f[0])  # best fit
            pool.remove(block)
        else:
            block = segment_size(nbytes)
            self.available -= block
        if block - nbytes > SPLIT_REMAINDER:
            bisect.insort(self.shared, block - nbytes)  # its segment is now partly in use

    def release(self, nbytes: int) -> None:
        if nbytes > 0:
            bisect.insort(self.whole if nbytes >= MIN_LARGE_ALLOC else self.shared, nbytes)

    def empty_cache(self) -> None:
        self.available += sum(self.whole)
        self.whole.clear()


def prefill_order(requests: Iterable["InflightRequest"]) -> list["InflightRequest"]:
    """The order the scheduler prefills them in: the request being chunk-prefilled first, then the
    others as they arrived (the list is in arrival order)."""
    reqs = list(requests)
    return [r for r in reqs if r.prefilling] + [r for r in reqs if not r.prefilling]


def projected_low(level: int, kept: Iterable["InflightRequest"], aborted: Iterable["InflightRequest"],
                  model: "CostModel", running_in_level: bool = False) -> int:
    """The lowest available memory ahead if `kept` run to the end of their prefill and `aborted`
    leave what they hold in the allocator for them. `running_in_level`: the level was sampled
    after the step now running was launched, so it holds that step's KV and buffers."""
    memory = _Allocator(level)
    kv_block = model.token_bytes * (model.chunk_tokens if model.chunk_tokens > 0 else 1)
    for r in aborted:
        held = model.held(r)
        if kv_block > 0 and held > 0:
            whole, rest = divmod(held, kv_block)
            for _ in range(whole):
                memory.release(kv_block)
            memory.release(rest)
    low = level
    for r in prefill_order(kept):
        prefix = r.prefilled_tokens
        launched = running_in_level and r.prefilling and r.chunk_tokens > 0
        if not (launched and model.hooked(r)):  # with the hook they went back before this chunk's
            for block in done_chunk_buffers(r, model):
                memory.release(block)
        if launched:  # its KV is in the level, and its buffers, free once it ends
            prefix += min(r.chunk_tokens, r.prompt_tokens - prefix)
            memory.release(int(model.transient_bytes * r.chunk_tokens * prefix))
        if prefix >= r.prompt_tokens:
            continue
        chunk = model.chunk_of(r)
        if model.hooked(r):
            # Every chunk starts from an empty cache: its low is at its last chunk, with all its KV.
            memory.empty_cache()
            memory.available -= kv_segments(model.token_bytes, chunk, r.prompt_tokens - prefix)
            last = int(model.transient_bytes * min(chunk, r.prompt_tokens - prefix) * r.prompt_tokens)
            low = min(low, memory.available - (segment_size(last) if last else 0))
            continue  # the hook returns those buffers before the batch after its last chunk
        if -(-(r.prompt_tokens - prefix) // chunk) > EXACT_CHUNKS:
            # A long prompt without the hook (the hook off, or a high threshold): each chunk's
            # buffers are larger than any block kept, so they are all new; counted at once, with
            # each segment's rounding, and nothing of them reused later (the projection errs low).
            memory.available -= kv_segments(model.token_bytes, chunk, r.prompt_tokens - prefix)
            memory.available -= unhooked_buffers(model, chunk, prefix, r.prompt_tokens)
            low = min(low, memory.available)
            continue
        while prefix < r.prompt_tokens:
            take = min(chunk, r.prompt_tokens - prefix)
            prefix += take
            memory.malloc(model.token_bytes * take)
            buffers = int(model.transient_bytes * take * prefix)
            memory.malloc(buffers)
            low = min(low, memory.available)
            memory.release(buffers)
    return low


def unhooked_buffers(model: "CostModel", chunk: int, start: int, end: int) -> int:
    """The chunks' buffers from prefix `start` to `end`, each its own segment (rounded up)."""
    full = (end - start) // chunk
    # sum over k = 1..full of chunk x (start + k x chunk), then the shorter last chunk at `end`
    total = model.transient_bytes * chunk * (full * start + chunk * full * (full + 1) // 2)
    rest = end - start - full * chunk
    total += model.transient_bytes * rest * end
    return int(total) + (full + (1 if rest else 0)) * ROUND_LARGE


def kv_segments(token_bytes: int, chunk: int, tokens: int) -> int:
    """What `tokens` of KV, allocated a chunk at a time from an empty cache, take from the system:
    a chunk of at least MIN_LARGE_ALLOC its own rounded segment; smaller ones share LARGE_BUFFER
    segments, as many to one as fit."""
    full, rest = divmod(tokens, chunk)
    block = token_bytes * chunk
    if block >= MIN_LARGE_ALLOC:
        return full * segment_size(block) + (segment_size(token_bytes * rest) if rest else 0)
    per_segment = max(1, LARGE_BUFFER // max(1, block))
    return -(-(full + (1 if rest else 0)) // per_segment) * LARGE_BUFFER


def done_chunk_buffers(r: "InflightRequest", model: "CostModel") -> list[int]:
    """The buffers of the chunks the request being prefilled has done that the level sampled
    holds as free blocks, whether or not its next chunk's were allocated yet. Without the hook,
    every one's (nothing returns them). With it, only the last one's and only while its next
    chunk is in the step launched: the hook returns them right before that chunk's own buffers
    are allocated (between steps they may be gone already). The chunk now running is not among
    them (projected_low credits it when the level was sampled after its launch)."""
    if not r.prefilling or not model.transient_bytes or (model.hooked(r) and not r.chunk_tokens):
        return []
    chunk = model.chunk_of(r)
    ends = list(range(r.cached_tokens + chunk, r.prefilled_tokens + 1, chunk))
    if r.prefilled_tokens > r.cached_tokens and (not ends or ends[-1] != r.prefilled_tokens):
        ends.append(r.prefilled_tokens)  # a last chunk shorter than the others
    sizes = [int(model.transient_bytes * (end - start) * end) for start, end in zip([r.cached_tokens] + ends, ends)]
    return sizes[-1:] if model.hooked(r) else sizes
