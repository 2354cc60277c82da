"""The lowest available memory ahead as a sum: each request charged its own bytes (dsv41/cost.py),
no allocator replayed (CostModel.replay False; bench/memory_guard --cost-model additive).

The same questions projection.Projection answers, from the level and the listing alone: what the
listed requests hold (`taken`), the lowest point if `kept` run to the end of their prefill and
`aborted` end at the next step (`low`: the kept requests' KV still to come, less what the aborted
ones and the KV pool's free slots leave to it and at most what a pool of kv_pool_tokens slots has
left to grow, plus their indexer buffers: the largest of the hooked prompts', every unhooked
prompt's), and the waiting requests the ranks hold back at the next
step (`held_at_next_step`: the admission gate and the pool's slots, with no free blocks counted).
Kept beside the replay to compare the two (bench/results/memory_guard_cost_models.txt).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable

from dsv41.cost import CostModel
from dsv41.inflight import InflightRequest

from .projection import _Allocator, _first_held, _first_without_slots, _gated, prefill_order


class AdditiveProjection:
    def __init__(self, level: int, requests: Iterable[InflightRequest], model: CostModel,
                 running_in_level: bool = False, kv_high_water_tokens: int | None = None) -> None:
        self.level, self.model = level, model
        self._returned = 0  # the running step's buffers the hook gives back once it ends
        self._requests: dict[str, InflightRequest] = {}
        for r in requests:
            if running_in_level and r.prefilling and r.chunk_tokens > 0:  # the running chunk is in the level
                take = min(r.chunk_tokens, r.remaining_tokens)
                if model.hooked(r):
                    self._returned += int(model.transient_bytes * take * (r.prefilled_tokens + take))
                r = replace(r, prefilled_tokens=r.prefilled_tokens + take)
            self._requests[r.rid] = r
        held = sum(model.held(r) for r in self._requests.values())
        kept_buffers = sum(model.transient_peak(replace(r, prompt_tokens=r.prefilled_tokens, prefilled_tokens=r.cached_tokens))
                           for r in self._requests.values() if not model.hooked(r) and not r.waiting)
        self.taken = held + kept_buffers + self._returned
        high = (kv_high_water_tokens or 0) * model.token_bytes if model.kv_pool else 0
        self._pool_free = max(0, high - held)  # slots ended requests left: they serve KV at no cost
        # a pool of kv_pool_tokens slots grows no further than its size, however many requests wait
        self._pool_growth = max(0, model.kv_pool_tokens * model.token_bytes - max(high, held)) \
            if model.kv_pool and model.kv_pool_tokens > 0 else None

    def _listed(self, requests: Iterable[InflightRequest]) -> list[InflightRequest]:
        return [self._requests.get(r.rid, r) for r in requests]

    def low(self, kept: Iterable[InflightRequest], aborted: Iterable[InflightRequest]) -> int:
        model, kept = self.model, self._listed(kept)
        kv = sum(model.kv_to_come(r) for r in kept)
        reusable = sum(model.held(r) for r in self._listed(aborted)) + self._pool_free
        buffers = [model.transient_peak(r) for r in kept]
        hooked = max((b for r, b in zip(kept, buffers) if model.hooked(r)), default=0)
        unhooked = sum(b for r, b in zip(kept, buffers) if not model.hooked(r))
        fresh = max(0, kv - reusable)
        if self._pool_growth is not None:
            fresh = min(fresh, self._pool_growth)
        return self.level + self._returned - fresh - hooked - unhooked

    def held_at_next_step(self, kept: Iterable[InflightRequest], aborted: Iterable[InflightRequest]) -> set[str]:
        model, kept = self.model, self._listed(kept)
        memory = _Allocator(self.level + self._returned)  # no free blocks: nothing replayed
        if model.kv_pool:
            memory.kv_in_use = sum(model.held(r) for r in kept)
            memory.kv_high = memory.kv_in_use + self._pool_free + sum(model.held(r) for r in self._listed(aborted))
        queue = [[r, r.prefilled_tokens, r.prompt_tokens] for r in prefill_order(kept) if r.remaining_tokens]
        budget = model.chunk_tokens if model.chunk_tokens > 0 else None
        held = _first_without_slots(memory, queue, budget, model)
        gated = _gated(kept, memory, model)
        if gated:
            held = min(held, _first_held(memory, queue, budget, model, gated))
        return {e[0].rid for e in queue[held:]}
