"""prefill_empty_cache: give the caching allocator's free blocks back after long-prompt chunks.

Every prefill chunk of a long prompt allocates an indexer-logits buffer [chunk, prefix] (fp32)
that grows with the prefix. PyTorch's native allocator cannot reuse the previous chunk's smaller
block for the next, larger one, so the reserved pool grows by the sum over chunks; on GB10, where
host RAM is GPU memory, that ran the head out of memory (34k prompt: 1-1.5 GB kept, 64k: out of
memory; with this hook 100k prompts complete). After `Scheduler.process_batch_result` handles an
extend (prefill) batch that carries a sequence of at least DSV41_PREFILL_EMPTY_CACHE_TOKENS prompt
tokens, torch.cuda.empty_cache() runs on that rank. 0 disables. bench/prefill_empty_cache
measures the effect.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from adapter.patching import AFTER, AdapterSpec, Patch
from adapter.settings import env_int

NAME = "prefill_empty_cache"
# The variables build() reads: dsv41ctl config check reports any other adapter key as no effect.
ENV_KEYS = ("DSV41_PREFILL_EMPTY_CACHE_TOKENS",)
MODULE = "sglang.srt.managers.scheduler"
DEFAULT = 8192
MAXIMUM = 1 << 24


def should_empty_cache(is_extend: bool, prompt_lengths: Iterable[int], threshold: int) -> bool:
    """Whether the finished batch was a prefill chunk of a sequence at least `threshold` long."""
    return threshold > 0 and is_extend and any(n >= threshold for n in prompt_lengths)


def _cuda_empty_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class PrefillEmptyCache:
    def __init__(self, threshold: int, empty_cache: Callable[[], None] = _cuda_empty_cache) -> None:
        self.threshold = threshold
        self._empty_cache = empty_cache
        self.calls = 0

    def after_batch(self, _result: Any, _scheduler: Any, batch: Any, *_args: Any, **_kwargs: Any) -> None:
        mode = getattr(batch, "forward_mode", None)
        is_extend = mode is not None and bool(mode.is_extend())
        if not is_extend:
            return None
        lengths = (len(req.origin_input_ids) for req in getattr(batch, "reqs", None) or ())
        if should_empty_cache(is_extend, lengths, self.threshold):
            self._empty_cache()
            self.calls += 1
        return None


def build(env: Mapping[str, str], empty_cache: Callable[[], None] = _cuda_empty_cache) -> AdapterSpec | None:
    threshold = env_int(env, "DSV41_PREFILL_EMPTY_CACHE_TOKENS", DEFAULT, 0, MAXIMUM)
    if threshold == 0:
        return None
    adapter = PrefillEmptyCache(threshold, empty_cache)
    return AdapterSpec(
        name=NAME,
        state=adapter,
        detail=f"empty_cache after prefill chunks of prompts >= {threshold} tokens",
        patches=(
            Patch(
                MODULE,
                "Scheduler.process_batch_result",
                AFTER,
                adapter.after_batch,
                params=("self", "batch", "result"),
            ),
        ),
    )
