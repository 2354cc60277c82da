"""draft_head_fp8: the DSpark draft's LM head product from an fp8 copy (DSV41_DRAFT_HEAD_FP8=1).

The draft shares the target's LM head (a vocab-parallel [vocab per rank, hidden] bf16 weight) and
projects bs x 5 rows through it every step; at those row counts the product reads the whole head
shard (421 MiB per rank at TP 3). The target's own logits keep the bf16 head. Hooks:

- AFTER DeepseekV4ForCausalLMDSpark.attach_shared_modules (the worker hands the draft the target's
  head, after both models loaded and before any CUDA graph): an fp8 copy of the head with 32 x 32
  power-of-two tiles (adapter/fp8_blocks.py), +211.4 MiB per rank at TP 3. Not for a quantised head
  (SGLang applies its quant method) or under SGLANG_DSPARK_FP32_LM_HEAD=1 (the draft then projects
  in float32 without this function).
- AROUND sglang.srt.models.dspark.project_through_lm_head(hidden, lm_head), the draft's projection:
  for the head that has a copy, the W8A16 kernel (adapter/fp8_gemm.py) instead of the bf16 matmul;
  SGLang then gathers the vocab shards as before (gather_and_crop_vocab).

Every rank gathers the same logits, so a rank without the copy (the adapter left out) changes only
its shard's rounding, never what the ranks agree on: the adapter is not fail_closed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from adapter.patching import AFTER, AROUND, AdapterSpec, Patch
from dsv41 import rankadapters
from dsv41.adapterlog import AdapterLog

NAME = "draft_head_fp8"
KEY = rankadapters.DSV41_DRAFT_HEAD_FP8.name
# The variables build() reads: dsv41ctl config check reports any other adapter key as no effect.
ENV_KEYS = rankadapters.BY_NAME[NAME].keys  # every variable build() reads, declared in dsv41
DRAFT_MODEL = "sglang.srt.models.deepseek_v4_dspark"
DSPARK = "sglang.srt.models.dspark"


def skip_reason(model: Any, lm_head: Any) -> str | None:
    weight = getattr(lm_head, "weight", None)
    if weight is None:
        return "the head has no weight"
    if getattr(model, "_use_fp32_lm_head", False):
        return "SGLANG_DSPARK_FP32_LM_HEAD=1 projects the draft in float32"
    from sglang.srt.layers.logits_processor import should_apply_lm_head_quant_method

    if should_apply_lm_head_quant_method(lm_head, getattr(lm_head, "quant_method", None)):
        return "the head is quantised (SGLang applies its quant method)"
    if str(weight.dtype) != "torch.bfloat16":
        return f"the head is {weight.dtype}"
    return None


class DraftHeadFp8:
    def __init__(self, log: AdapterLog) -> None:
        self._log = log
        self._copies: dict[int, tuple[Any, Any]] = {}  # id(lm_head) -> (lm_head, Fp8Blocks)
        self.fp8_calls = 0
        self.kernel_failed = False  # the fp8 kernel raised once: the bf16 head from then on

    def patches(self) -> tuple[Patch, ...]:
        return (
            Patch(DSPARK, "project_through_lm_head", AROUND, self.around_project, params=("hidden", "lm_head")),
            Patch(DRAFT_MODEL, "DeepseekV4ForCausalLMDSpark.attach_shared_modules", AFTER, self.after_attach,
                  params=("self", "embed_tokens", "lm_head")),
        )

    def after_attach(self, _result: Any, model: Any, *_a: Any, **_k: Any) -> None:
        lm_head = getattr(model, "lm_head", None)
        if lm_head is None or id(lm_head) in self._copies:
            return None
        reason = skip_reason(model, lm_head)
        if reason is not None:
            self._log.line(f"{NAME}: the draft keeps the bf16 head: {reason}")
            return None
        self._copies[id(lm_head)] = (lm_head, self.make_copy(lm_head.weight))
        return None

    def make_copy(self, weight: Any) -> Any:
        import torch

        from adapter.fp8_blocks import quantize

        with torch.no_grad():
            blocks = quantize(weight.detach())
        n, k = weight.shape
        self._log.line(f"{NAME}: draft LM head [{n} x {k}] per rank: fp8 copy {blocks.nbytes / 2**20:+.1f} MiB; "
                       "the target keeps the bf16 head")
        return blocks

    def copy_of(self, lm_head: Any) -> Any:
        entry = self._copies.get(id(lm_head))
        return entry[1] if entry is not None and entry[0] is lm_head else None

    def around_project(self, original: Callable[..., Any], hidden: Any, lm_head: Any) -> Any:
        blocks = self.copy_of(lm_head)
        if blocks is None or self.kernel_failed or hidden.dim() != 2 or hidden.shape[0] == 0:
            return original(hidden, lm_head)
        from adapter.fp8_gemm import linear_w8a16

        try:
            out = linear_w8a16(hidden.to(lm_head.weight.dtype), blocks)
        except Exception as e:  # noqa: BLE001 - the bf16 head is still there
            self.kernel_failed = True
            self._log.line(f"{NAME}: the fp8 kernel failed ({type(e).__name__}: {e}); the draft projects through "
                           "the bf16 head")
            return original(hidden, lm_head)
        self.fp8_calls += 1
        return out


def build(env: Mapping[str, str], log: AdapterLog) -> AdapterSpec | None:
    if not rankadapters.DSV41_DRAFT_HEAD_FP8.read(env):
        return None
    adapter = DraftHeadFp8(log)
    return AdapterSpec(name=NAME, detail="the DSpark draft projects through an fp8 copy of the shared LM head",
                       patches=adapter.patches(), state=adapter)
