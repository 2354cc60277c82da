"""prefill_empty_cache: give the caching allocator's free blocks back between long-prompt chunks.

Every prefill chunk of a long prompt allocates an indexer-logits buffer [chunk, prefix] (fp32)
that grows with the prefix. PyTorch's native allocator cannot reuse the previous chunk's smaller
block for the next, larger one, so the reserved pool grows by the sum over chunks; on GB10, where
host RAM is GPU memory, that ran the head out of memory (34k prompt: 1-1.5 GB kept, 64k: out of
memory; with this hook 100k prompts complete). torch.cuda.empty_cache() runs on the rank right
before `Scheduler.run_batch` launches an extend (prefill) batch that carries a sequence of at
least DSV41_PREFILL_EMPTY_CACHE_TOKENS prompt tokens, and once more before the batch after the
last such chunk (its buffers); 0 disables.

Why there and not after the chunk's result: empty_cache() frees with cudaFree, which waits for
the device. Under SGLang's overlap loop process_batch_result(N) runs while chunk N+1 is already
on the GPU, so a release there waits for N+1 and exposes the scheduling and launch of N+2: on an
H200 that cost 25.7 % of chunked-prefill throughput, as much as turning overlap off. Right before
the launch of N+1 it waits for N only, and returns N's buffers before N+1 allocates its larger
ones: 7.3 %, the same peak (bench/prefill_empty_cache_overlap, bench/results/
prefill_empty_cache_overlap-h200.txt). bench/prefill_empty_cache measures the memory effect.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from adapter.patching import BEFORE, AdapterSpec, Patch
from dsv41 import rankadapters

NAME = "prefill_empty_cache"
# The variables build() reads: dsv41ctl config check reports any other adapter key as no effect.
ENV_KEYS = rankadapters.BY_NAME[NAME].keys  # every variable build() reads, declared in dsv41
MODULE = "sglang.srt.managers.scheduler"
SETTING = rankadapters.DSV41_PREFILL_EMPTY_CACHE_TOKENS
DEFAULT = int(SETTING.default)
MAXIMUM = int(SETTING.high)


def should_empty_cache(is_extend: bool, prompt_lengths: Iterable[int], threshold: int) -> bool:
    """Whether the finished batch was a prefill chunk of a sequence at least `threshold` long."""
    return threshold > 0 and is_extend and any(n >= threshold for n in prompt_lengths)


def _cuda_empty_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def is_long_prefill(batch: Any, threshold: int) -> bool:
    """Whether `batch` (a ScheduleBatch about to run) is a prefill chunk of a long sequence."""
    mode = getattr(batch, "forward_mode", None)
    is_extend = mode is not None and bool(mode.is_extend())
    if not is_extend:
        return False
    lengths = (len(req.origin_input_ids) for req in getattr(batch, "reqs", None) or ())
    return should_empty_cache(is_extend, lengths, threshold)


class PrefillEmptyCache:
    """Runs on the scheduler's thread only (its BEFORE hook on run_batch): no lock needed."""

    def __init__(self, threshold: int, empty_cache: Callable[[], None] = _cuda_empty_cache) -> None:
        self.threshold = threshold
        self._empty_cache = empty_cache
        self._after_long = False  # the batch launched last was a long prompt's chunk
        self.calls = 0

    def before_batch(self, _scheduler: Any, batch: Any, *_args: Any, **_kwargs: Any) -> None:
        long_prefill = is_long_prefill(batch, self.threshold)
        # Before a long chunk: the previous chunk's buffers; before the batch after the last
        # long chunk: that chunk's. Either way the wait is for the batch already launched.
        if long_prefill or self._after_long:
            self._empty_cache()
            self.calls += 1
        self._after_long = long_prefill
        return None


def build(env: Mapping[str, str], empty_cache: Callable[[], None] = _cuda_empty_cache) -> AdapterSpec | None:
    threshold = SETTING.read(env)
    if threshold == 0:
        return None
    adapter = PrefillEmptyCache(threshold, empty_cache)
    return AdapterSpec(
        name=NAME,
        state=adapter,
        detail=f"empty_cache before prefill chunks of prompts >= {threshold} tokens",
        patches=(
            Patch(
                MODULE,
                "Scheduler.run_batch",
                BEFORE,
                adapter.before_batch,
                params=("self", "batch"),
            ),
        ),
    )
