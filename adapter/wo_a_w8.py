"""wo_a_w8: an fp8 twin of the target's wo_a serves the decode and verify rows (DSV41_WO_A_W8).

DeepSeek-V4.1's checkpoint stores wo_a (the grouped output projection, o [T, G, D] @ wo_a [G, R, D]
-> [T, G, R]) as fp8 with 32 x 32 E8M0 tiles; SGLang 0.5.23 dequantises it to bf16 at load (its fp8
absorb GEMM takes 128 x 128 tiles only) and runs bf16 products. At decode row counts that product
reads the whole weight per step, so an fp8 copy halves its bytes. Hooks (checked before patching):

- AFTER DeepseekV4ForCausalLM.post_load_weights (the target; not the NextN variant): every
  MqaAttentionBase layer whose wo_a is bf16 gets a twin, the weight re-quantised to 32 x 32
  power-of-two tiles (adapter/fp8_blocks.py), which gives back the checkpoint's values exactly.
  With DSV41_WO_A_W8_DRAFT=1 also AFTER DeepseekV4ForCausalLMDSpark.post_load_weights (the draft's
  layers, when their forward goes through SGLang's wo_a function: SGLANG_DSPARK_FAST_KERNEL).
  Layers on SGLang's own fp8 paths (mega attention, fp8 absorb GEMM, NPU MXFP8) keep theirs.
- AROUND deepseek_v4._apply_wo_a_bf16_matmul, the function both MQALayer.forward and
  DSparkAttention.forward call with the layer's weight: for a twinned weight, decode and verify
  forwards of at most 8 rows (a single request's 6-row verify), and with DSV41_WO_A_W8_MID=1 of
  9-192 rows (2-32 requests), run the W8A16 kernel on the twin (adapter/fp8_gemm.py); other rows
  (prefill chunks, larger verifies) take SGLang's bf16 path.
- DSV41_WO_A_W8_DROP=1 releases the bf16 weight of every twinned layer: the parameter becomes a
  zero-stride placeholder of the same shape (2 bytes), and rows the twin does not serve are computed
  by SGLang's bf16 path from the twin dequantised for that call (exact; a Triton kernel on CUDA,
  one read of the codes and one write of the bf16 weight). The adapter is then
  fail_closed: without it the rank would compute wo_a from the placeholder. Loading weights into a
  running rank (update_weights_from_disk) is not possible with DROP.

Memory per rank at TP 3 (adapter/decode_shapes.py): +16.06 MiB per twinned layer (codes and
scales), -32 MiB per released layer; 40 target layers: W8 +642.5 MiB, W8+DROP -637.5 MiB.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from adapter.patching import AFTER, AROUND, AdapterSpec, Patch, Refused
from dsv41 import rankadapters
from dsv41.adapterlog import AdapterLog

NAME = "wo_a_w8"
KEY, MID_KEY, DROP_KEY, DRAFT_KEY = (s.name for s in rankadapters.BY_NAME["wo_a_w8"].settings)
# The variables build() reads: dsv41ctl config check reports any other adapter key as no effect.
ENV_KEYS = rankadapters.BY_NAME[NAME].keys  # every variable build() reads, declared in dsv41
MODEL = "sglang.srt.models.deepseek_v4"
DRAFT_MODEL = "sglang.srt.models.deepseek_v4_dspark"
SMALL_ROWS = 8  # one request's verify (DSpark block 5 + 1) and decode rows
MID_ROWS = 192  # verifies of up to 32 requests
TARGET, DRAFT = "target", "draft"


@dataclass(frozen=True)
class WoASettings:
    mid: bool
    drop: bool
    draft: bool

    def describe(self) -> str:
        rows = f"1-{MID_ROWS}" if self.mid else f"1-{SMALL_ROWS}"
        parts = [f"fp8 twins serve decode/verify forwards of {rows} rows", "target layers"]
        if self.draft:
            parts[-1] = "target and draft layers"
        parts.append("bf16 copies released" if self.drop else "bf16 copies kept")
        return ", ".join(parts)


def settings_from_env(env: Mapping[str, str]) -> WoASettings | None:
    """None when DSV41_WO_A_W8 is off: _MID, _DROP and _DRAFT only configure the twin (the packaged
    defaults set them, so switching W8 off alone is the rollback)."""
    on = rankadapters.DSV41_WO_A_W8.read(env)
    mid, drop, draft = (s.read(env) for s in (rankadapters.DSV41_WO_A_W8_MID, rankadapters.DSV41_WO_A_W8_DROP,
                                               rankadapters.DSV41_WO_A_W8_DRAFT))
    return WoASettings(mid=mid, drop=drop, draft=draft) if on else None


def serves_fp8(rows: int, *, decode: bool, verify: bool, prefill: bool, mid: bool) -> bool:
    """Whether a wo_a product of `rows` rows runs on the fp8 twin (else SGLang's bf16 path)."""
    if rows <= 0 or prefill or not (decode or verify):
        return False
    return rows <= SMALL_ROWS or (mid and rows <= MID_ROWS)


@dataclass
class Twin:
    blocks: Any  # fp8_blocks.Fp8Blocks [G, R, D]
    role: str
    layer: str
    dropped: bool = False


def skip_reason(module: Any, role: str) -> str | None:
    """Why an attention layer keeps its own wo_a path (None: it can be twinned)."""
    weight = getattr(getattr(module, "wo_a", None), "weight", None)
    if weight is None:
        return "no wo_a weight (GGUF)"
    if getattr(module, "wo_a_fp8", False) or getattr(module, "use_npu_arch35_mxfp8_wo_a", False):
        return "SGLang's fp8 wo_a"
    if getattr(module, "use_mega_attention", False):
        return "mega attention"
    if getattr(module, "use_fused_wo_a", False):  # SM100: the fused RoPE + wo_a kernel reads the weight itself
        return "SGLang's fused RoPE + wo_a kernel"
    if str(getattr(weight, "dtype", "")) != "torch.bfloat16":
        return f"wo_a is {weight.dtype}"
    if role == DRAFT and not getattr(module, "_use_fast_kernel", True):
        return "SGLANG_DSPARK_FAST_KERNEL=0 (the draft's einsum path)"
    return None


def _is_placeholder(t: Any) -> bool:
    stride = getattr(t, "stride", None)
    return stride is not None and t.dim() > 0 and all(s == 0 for s in stride())


class WoAW8:
    def __init__(self, settings: WoASettings, log: AdapterLog) -> None:
        self.settings = settings
        self._log = log
        self.twins: dict[int, Twin] = {}  # weight data_ptr (the placeholder's after DROP) -> twin
        self.fp8_calls = 0
        self.bf16_calls = 0
        self.kernel_failed = False  # the fp8 kernel raised once: bf16 from then on (only with the bf16 kept)

    def patches(self) -> tuple[Patch, ...]:
        patches = [
            Patch(MODEL, "_apply_wo_a_bf16_matmul", AROUND, self.around_matmul,
                  params=("o", "wo_a", "is_decode", "is_target_verify", "is_prefill")),
            Patch(MODEL, "DeepseekV4ForCausalLM.post_load_weights", AFTER, self.after_target_loaded,
                  params=("self", "is_nextn")),
        ]
        if self.settings.draft:
            patches.append(Patch(DRAFT_MODEL, "DeepseekV4ForCausalLMDSpark.post_load_weights", AFTER,
                                 self.after_draft_loaded, params=("self",)))
        return tuple(patches)

    # ----- loading -----

    def after_target_loaded(self, _result: Any, model: Any, is_nextn: bool = False, *_a: Any, **_k: Any) -> None:
        if is_nextn:  # the NextN (MTP) variant of the class: not the target's layers
            return None
        self.build_twins(model, TARGET)
        return None

    def after_draft_loaded(self, _result: Any, model: Any, *_a: Any, **_k: Any) -> None:
        self.build_twins(model, DRAFT)
        return None

    def build_twins(self, model: Any, role: str) -> list[Twin]:
        """Twin every eligible attention layer of `model` (once per weight); one line per call."""
        import torch

        from adapter.fp8_blocks import quantize
        from sglang.srt.models.deepseek_v4 import MqaAttentionBase

        made: list[Twin] = []
        skipped: dict[str, int] = {}
        released = 0
        for name, module in model.named_modules():
            if not isinstance(module, MqaAttentionBase):
                continue
            reason = skip_reason(module, role)
            if reason is not None:
                skipped[reason] = skipped.get(reason, 0) + 1
                continue
            weight = module.wo_a.weight
            if weight.data_ptr() in self.twins:
                continue
            groups, rank = int(module.n_local_groups), int(module.o_lora_rank)
            with torch.no_grad():
                blocks = quantize(weight.detach().view(groups, rank, -1))
            twin = Twin(blocks, role, name)
            if self.settings.drop:
                released += weight.numel() * weight.element_size()
                weight = self._release(module.wo_a)
                twin.dropped = True
            self.twins[weight.data_ptr()] = twin
            made.append(twin)
        if self.settings.drop and released and torch.cuda.is_available():
            torch.cuda.empty_cache()  # the released bf16 blocks go back before SGLang sizes the KV pool
        if not made and (self.twins or not skipped):
            return made  # post_load_weights again (SGLang's loader calls it after load_weights)
        added = sum(t.blocks.nbytes for t in made)
        left = "; ".join(f"{n} kept their own wo_a ({r})" for r, n in sorted(skipped.items()))
        self._log.line(f"{NAME}: {role}: {len(made)} layers twinned: fp8 {added / 2**20:+.1f} MiB, bf16 "
                       f"{-released / 2**20:+.1f} MiB, net {(added - released) / 2**20:+.1f} MiB per rank"
                       + (f"; {left}" if left else ""))
        return made

    @staticmethod
    def _release(linear: Any) -> Any:
        """Replace the bf16 parameter by a zero-stride placeholder of the same shape and dtype."""
        import torch

        old = linear.weight
        placeholder = torch.empty_strided(tuple(old.shape), (0,) * old.dim(), dtype=old.dtype, device=old.device)
        param = torch.nn.Parameter(placeholder, requires_grad=False)
        for attr, value in vars(old).items():  # SGLang's loader attributes (output_dim, weight_loader, ...)
            setattr(param, attr, value)
        linear.weight = param
        return param

    # ----- the product -----

    def around_matmul(self, original: Callable[..., Any], o: Any, wo_a: Any, is_decode: bool,
                      is_target_verify: bool = False, fuse_mxfp8_quant: bool = False, is_prefill: bool = False,
                      fast_path: bool = False, fp8_grid: bool = False, emit_fp8: bool = False) -> Any:
        twin = self.twins.get(wo_a.data_ptr())
        rest = dict(is_target_verify=is_target_verify, fuse_mxfp8_quant=fuse_mxfp8_quant, is_prefill=is_prefill,
                    fast_path=fast_path, fp8_grid=fp8_grid, emit_fp8=emit_fp8)
        if twin is None:
            if _is_placeholder(wo_a):
                raise Refused(f"{NAME}: a wo_a weight released by {DROP_KEY}=1 reached SGLang's bf16 path "
                              "without its fp8 twin")
            return original(o, wo_a, is_decode, **rest)
        if not self.kernel_failed and serves_fp8(int(o.shape[0]), decode=is_decode, verify=is_target_verify,
                                                 prefill=is_prefill, mid=self.settings.mid):
            from adapter.fp8_gemm import grouped_w8a16

            try:
                out = grouped_w8a16(o, twin.blocks)
            except Exception as e:  # noqa: BLE001 - with the bf16 weight kept, SGLang's path still serves
                if twin.dropped:
                    raise
                self.kernel_failed = True
                self._log.line(f"{NAME}: the fp8 kernel failed ({type(e).__name__}: {e}); wo_a stays on "
                               "SGLang's bf16 path")
            else:
                self.fp8_calls += 1
                return out
        self.bf16_calls += 1
        if twin.dropped:
            from adapter.fp8_gemm import dequantize

            wo_a = dequantize(twin.blocks, wo_a.dtype)
        return original(o, wo_a, is_decode, **rest)


def build(env: Mapping[str, str], log: AdapterLog) -> AdapterSpec | None:
    settings = settings_from_env(env)
    if settings is None:
        return None
    adapter = WoAW8(settings, log)
    # With the bf16 copies released the rank cannot compute wo_a without the adapter.
    return AdapterSpec(name=NAME, detail=settings.describe(), patches=adapter.patches(), state=adapter,
                       fail_closed=settings.drop)
