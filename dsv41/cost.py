"""What a request costs each rank: the model the coordinator's guard charges requests by and the
ranks' admission gate (dsv41/admission.py) takes its figures from (standard library only).

- KV: token_bytes per prefilled token, held until the request ends. An ended or aborted
  request's KV stays with the process and serves later allocations (SGLang's KV pool: later KV
  alone; the caching allocator: anything). Aborting a request stops its growth; it gives nothing
  back to the system.
- The indexer's buffers: a prefill chunk of c tokens at prefix p (the chunk included) takes
  transient_bytes x c x p for the step. With the prefill_empty_cache hook (a prompt of at least
  its threshold) they go back after the chunk, so a request's peak is its last chunk's; without
  it each larger chunk takes new memory and the allocator keeps the old blocks.
- A waiting request holds nothing yet; its peak follows from its prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv41.inflight import InflightRequest


@dataclass(frozen=True)
class CostModel:
    token_bytes: int = 0          # KV per prompt token, per rank (MEMORY_GUARD_TOKEN_BYTES)
    transient_bytes: float = 0.0  # per (chunk token x prefix token) of a prefill chunk (_TRANSIENT_BYTES)
    chunk_tokens: int = 8192      # CHUNKED_PREFILL_SIZE (-1: a prompt is prefilled at once)
    empty_cache_tokens: int = 0   # the prefill_empty_cache hook's threshold (0: off)
    # The ranks' admission gate (MEMORY_GUARD_ADMISSION=1, dsv41/admission.py): a new request's
    # first step waits while it would leave less than this; 0: no gate.
    admission_guard_bytes: int = 0
    # The KV in a pool of slots, as SGLang keeps it and the stand-in does by default (sim/kvpool.py):
    # reused by later KV alone, its memory never given back. False: in the caching allocator (the
    # stand-in with DSV41_SIM_KV_POOL=0).
    kv_pool: bool = False
    # Its slots (MAX_TOTAL_TOKENS, --max-total-tokens; 0: no limit): a request not yet started
    # waits while its rest would not fit in the free ones (SGLang's PrefillAdder).
    kv_pool_tokens: int = 0
    # The guard's projection (coordinator/guard): the listed requests' allocator replayed; False:
    # each request charged its bytes, summed, to compare the two (bench/memory_guard --cost-model).
    replay: bool = True

    @property
    def configured(self) -> bool:
        """Whether there is a cost to project with (MEMORY_GUARD_TOKEN_BYTES or _TRANSIENT_BYTES)."""
        return self.token_bytes > 0 or self.transient_bytes > 0

    def chunk_of(self, r: InflightRequest) -> int:
        """The tokens a prefill chunk of `r` takes (its whole prompt when prefill is not chunked)."""
        return r.prompt_tokens if self.chunk_tokens <= 0 else self.chunk_tokens

    def hooked(self, r: InflightRequest) -> bool:
        return 0 < self.empty_cache_tokens <= r.prompt_tokens

    def held(self, r: InflightRequest) -> int:
        """KV the request holds now (what it leaves to the others when aborted)."""
        if r.waiting:
            return 0
        return self.token_bytes * max(0, r.prefilled_tokens - r.cached_tokens)

    def kv_to_come(self, r: InflightRequest) -> int:
        return self.token_bytes * r.remaining_tokens

    def transient_peak(self, r: InflightRequest) -> int:
        """The indexer buffers its remaining chunks need at their largest: the last chunk's with
        the hook, all of them (each larger than any block the allocator keeps) without it."""
        left = r.remaining_tokens
        if not left or not self.transient_bytes:
            return 0
        chunk = self.chunk_of(r)
        if self.hooked(r):
            last = min(chunk, r.prompt_tokens)
            return int(self.transient_bytes * last * r.prompt_tokens)
        total, prefix = 0.0, r.prefilled_tokens
        while prefix < r.prompt_tokens:
            take = min(chunk, r.prompt_tokens - prefix)
            prefix += take
            total += self.transient_bytes * take * prefix
        return int(total)

    def to_come(self, r: InflightRequest) -> int:
        return self.kv_to_come(r) + self.transient_peak(r)
