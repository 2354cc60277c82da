"""SGLang's KV cache as the node sees it, for the stand-in engine's `kv_pool` mode.

SGLang keeps every request's KV in one pool of token slots made when the rank starts
(`--mem-fraction-static`, `--max-total-tokens`), not in PyTorch's caching allocator. What that
means for a node's available memory, which is what this models:
- a slot's memory is taken from the node the first time a page of it is written and then stays
  with the process: the pool is never freed, and empty_cache() does not touch it (on GB10,
  whose GPU memory is the node's, the example configuration's notes say the pinned pool
  "controls how many pages get touched");
- an ended or aborted request's slots go back to the pool's free list, which SGLang 0.5.23's
  paged allocator reuses first (freed pages are put in front of the free list): the next
  requests' KV takes them at no cost, and nothing else can use them (no indexer buffer, no
  activation);
- so the memory the pool holds is the high-water mark of the slots in use, in granules;
- the pool holds `capacity` slots (--max-total-tokens): the scheduler admits a request only while
  the free slots cover its prompt (sim/engine.py), and a step that asks for more slots than are
  free ends the rank, as SGLang's "Prefill out of memory" RuntimeError ends its scheduler.
(SGLang's radix cache may keep an ended request's KV for its prefix longer than this; a pool
that has once been filled costs nothing more. Both make the real pool take less than this.)

Thread-safe, like the allocator: the scheduler takes slots while request threads give them back.
"""

from __future__ import annotations

import threading

from .allocator import Backing

GRANULE = 2 << 20  # the pool's memory is taken in 2 MiB pages (the GPU's large page)


class KvPool:
    def __init__(self, backing: Backing, bytes_per_token: int, granule: int = GRANULE, capacity: int = 0) -> None:
        self._backing = backing
        self.bytes_per_token = bytes_per_token
        self.capacity = capacity  # slots (tokens); 0: no limit
        self._granule = granule
        self._lock = threading.Lock()
        self._pages: list[object] = []
        self.in_use = 0  # tokens whose slots requests hold now
        self.high_water = 0  # the most tokens held at once so far

    @property
    def touched_bytes(self) -> int:
        """What the pool holds from the node (its slots ever used, in granules)."""
        with self._lock:
            return len(self._pages) * self._granule

    def free_slots(self) -> int | None:
        """Slots no request holds (None: the pool has no limit)."""
        with self._lock:
            return self.capacity - self.in_use if self.capacity else None

    def take(self, tokens: int) -> int:
        """Slots for `tokens`; pages not written before are taken from the node (MemoryError or
        OSError when it refuses; MemoryError too when fewer slots are free). Returns the tokens
        taken, to give back later."""
        if tokens <= 0:
            return 0
        with self._lock:
            if self.capacity and self.in_use + tokens > self.capacity:
                raise MemoryError(f"Prefill out of memory: {tokens} KV slots asked for, "
                                  f"{self.capacity - self.in_use} of {self.capacity} free")
            need = (self.in_use + tokens) * self.bytes_per_token
            while len(self._pages) * self._granule < need:
                self._pages.append(self._backing.map(self._granule))  # the OOM-prone step
            self.in_use += tokens
            self.high_water = max(self.high_water, self.in_use)
        return tokens

    def give_back(self, tokens: int) -> None:
        """Slots back to the pool's free list: their memory stays with the process."""
        with self._lock:
            self.in_use -= max(0, min(tokens, self.in_use))
