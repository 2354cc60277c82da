"""Whether the KV pool SGLang is given fits above the guard (pure).

SGLang's pool takes a page of the node's memory the first time a slot in it is written, and never
gives it back (sim/kvpool.py; the example configuration: the pinned pool "controls how many pages
get touched"). A pool of MAX_TOTAL_TOKENS slots that the node cannot hold above the guard, together
with the indexer buffers of a prompt as long as the pool, works until requests have used enough of
it: from then on the node sits below the guard with nothing in flight, and the guard aborts every
request that takes a byte more. The guard says so once per node when the ranks start serving,
with the largest pool that fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv41.cost import CostModel


@dataclass(frozen=True)
class PoolFit:
    node: str
    pool_tokens: int
    context_tokens: int
    pool_bytes: int        # every slot's KV
    buffers_bytes: int     # the indexer buffers of the longest prompt's last chunk
    room_bytes: int        # available above the guard when serving began
    fits_tokens: int       # the largest pool that fits in that room with those buffers

    def message(self) -> str:
        gb = 1e9
        context = f" (and CONTEXT_LENGTH, which may not exceed it)" if self.fits_tokens < self.context_tokens else ""
        return (f"{self.node}: the KV pool of {self.pool_tokens} tokens (MAX_TOTAL_TOKENS) takes "
                f"{self.pool_bytes / gb:.2f} GB of this node's memory once requests have used it all, and a "
                f"{self.context_tokens}-token prompt's last chunk {self.buffers_bytes / gb:.2f} GB more for its indexer "
                f"buffers; the node has {self.room_bytes / gb:.2f} GB above the guard. The pool never gives memory "
                f"back: after enough long requests the node stays below the guard with nothing in flight, and the "
                f"guard aborts every request that needs more. A pool of at most {self.fits_tokens} tokens fits: set "
                f"MAX_TOTAL_TOKENS{context} to that or less")


def largest_fit(room: int, cost: CostModel, context: int) -> int:
    """The most slots whose KV, with the last chunk's buffers of a prompt as long as the context
    or the pool (the shorter), fit in `room`."""
    chunk = cost.chunk_tokens if cost.chunk_tokens > 0 else max(context, 1)
    column = cost.transient_bytes * min(chunk, max(context, 1))  # one prefix token's share of the buffers
    whole_context = int((room - column * context) // cost.token_bytes) if room > column * context else 0
    if whole_context >= context:
        return whole_context
    return max(0, int(room // (cost.token_bytes + column)))  # a pool shorter than the context: prompts as long


def pool_fit(node: str, available: int, guard_bytes: int, cost: CostModel, context_tokens: int) -> PoolFit | None:
    """The misfit at this level, None when the pool fits (or is not SGLang's, or has no size)."""
    if not cost.kv_pool or cost.kv_pool_tokens <= 0 or cost.token_bytes <= 0:
        return None
    context = min(context_tokens, cost.kv_pool_tokens) if context_tokens > 0 else cost.kv_pool_tokens
    chunk = cost.chunk_tokens if cost.chunk_tokens > 0 else context
    pool = cost.kv_pool_tokens * cost.token_bytes
    buffers = int(cost.transient_bytes * min(chunk, context) * context)
    room = available - guard_bytes
    if pool + buffers <= room:
        return None
    return PoolFit(node, cost.kv_pool_tokens, context, pool, buffers, room, largest_fit(room, cost, context))
