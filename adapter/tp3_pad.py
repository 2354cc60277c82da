"""tp3_pad: serve DeepSeek-V4.1 at TP sizes that do not divide its heads, vocab and draft experts.

Where it hooks (SGLang 0.5.23 names; each is checked before patching):

- `ModelConfig.from_server_args` (after): for a DeepSeek-V4 architecture, computes the plan of
  tp_padding.py from the config and `server_args.tp_size` and rewrites the config the model is
  built from: num_attention_heads, o_groups and dspark_n_routed_experts padded, the plan recorded
  as `dsv41_tp_pad`. The query projection, the grouped wo_a, wo_b and the sinks then get their
  padded shapes from SGLang's own layer constructors.
- the loaders (before): `_ColumnvLLMParameter.load_column_parallel_weight`,
  `RowvLLMParameter.load_row_parallel_weight`, `ColumnParallelLinear.weight_loader`,
  `RowParallelLinear.weight_loader`, `ReplicatedLinear.weight_loader` and `default_weight_loader`
  receive the checkpoint tensor; when it is smaller than the padded parameter by exactly the
  plan's proportion it is padded first (zeros; FP8 block scales 1.0; router bias far negative),
  then SGLang cuts out the rank's slice as usual. Any other size mismatch is left to fail loudly.
- `VocabParallelEmbedding.__init__` (before): vocab padding to a multiple of lcm(64, tp).

DSV41_TP_PAD=0 switches it off. Nothing changes when the TP size divides everything (TP 1/2/4/8).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from adapter.patching import AFTER, BEFORE, AdapterSpec, Patch
from adapter.tp_padding import ModelDims, PadPlan, plan_padding
from dsv41 import rankadapters
from dsv41.adapterlog import AdapterLog

NAME = "tp3_pad"
# The variables build() reads: dsv41ctl config check reports any other adapter key as no effect.
ENV_KEYS = rankadapters.BY_NAME[NAME].keys  # every variable build() reads, declared in dsv41
CONFIG = "sglang.srt.configs.model_config"
PARAMETER = "sglang.srt.layers.parameter"
LINEAR = "sglang.srt.layers.linear"
VOCAB = "sglang.srt.layers.vocab_parallel_embedding"
WEIGHT_UTILS = "sglang.srt.model_loader.weight_utils"
ARCHITECTURES = ("DeepseekV4ForCausalLM", "DeepseekV4ForCausalLMNextN", "DeepseekV4ForCausalLMDSpark")
PLAN_ATTR = "dsv41_tp_pad"
SCALE_NAMES = ("weight_scale_inv", "weight_scale", "input_scale")

Args = tuple[tuple[Any, ...], dict[str, Any]]


def is_deepseek_v4(hf_config: Any) -> bool:
    return any(a in ARCHITECTURES for a in (getattr(hf_config, "architectures", None) or ()))


def dims_of(text_config: Any) -> ModelDims:
    experts = getattr(text_config, "dspark_n_routed_experts", None)
    return ModelDims(
        heads=int(text_config.num_attention_heads),
        groups=int(text_config.o_groups),
        vocab=int(text_config.vocab_size),
        draft_experts=int(experts) if experts else None,
    )


def apply_plan(config: Any, plan: PadPlan) -> None:
    """Rewrite an HF config object (in place) to the padded shapes."""
    config.num_attention_heads = plan.padded_heads
    config.o_groups = plan.padded_groups
    if plan.padded_draft_experts is not None and getattr(config, "dspark_n_routed_experts", None):
        config.dspark_n_routed_experts = plan.padded_draft_experts
    setattr(config, PLAN_ATTR, plan.as_dict())


def _replace(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str, value: Any) -> Args:
    if name in kwargs:
        return args, {**kwargs, name: value}
    return args[:index] + (value,) + args[index + 1 :], kwargs


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Any:
    return kwargs[name] if name in kwargs else (args[index] if len(args) > index else None)


class Tp3Pad:
    def __init__(self, log: AdapterLog) -> None:
        self._log = log
        self.plans: dict[ModelDims, PadPlan] = {}  # target and draft configs may differ

    # --- config -------------------------------------------------------------------------
    def after_from_server_args(self, config: Any, server_args: Any, *_args: Any, **_kwargs: Any) -> None:
        hf = getattr(config, "hf_config", None)
        if hf is None or not is_deepseek_v4(hf):
            return None
        text = getattr(config, "hf_text_config", None) or hf
        if getattr(text, PLAN_ATTR, None) is not None:
            return None  # already padded (same config object seen twice)
        tp = int(getattr(server_args, "tp_size", 1) or 1)
        plan = plan_padding(dims_of(text), tp)
        if not plan.needed:
            return None
        for obj in {id(hf): hf, id(text): text}.values():
            apply_plan(obj, plan)
        if hasattr(config, "num_attention_heads"):
            config.num_attention_heads = plan.padded_heads
        if plan not in self.plans.values():
            self._log.line(f"{NAME}: {'draft ' if getattr(config, 'is_draft_model', False) else ''}model padded: {plan.describe()}")
        self.plans[dims_of_plan(plan)] = plan
        return None

    # --- loaders ------------------------------------------------------------------------
    def padded(self, loaded: Any, dim: int | None, want: int, scale: bool) -> Any:
        """`loaded` padded along `dim` to `want` when a plan explains the shortfall, else None."""
        if dim is None or not self.plans or loaded is None or getattr(loaded, "dim", None) is None:
            return None
        if loaded.dim() <= dim:
            return None
        have = int(loaded.shape[dim])
        for plan in self.plans.values():
            kind = plan.padded_size(have, want)
            if kind is not None:
                from adapter.tp_padding_torch import fill_for, pad_dim

                return pad_dim(loaded, dim, want, fill_for(kind, scale, loaded.dim()))
        return None

    def _tp(self) -> int:
        return next(iter(self.plans.values())).tp

    def before_column_param(self, param: Any, *args: Any, **kwargs: Any) -> Args | None:
        if not self.plans or kwargs.get("use_presharded_weights") or (len(args) > 2 and args[2]):
            return None
        loaded = _arg(args, kwargs, 0, "loaded_weight")
        dim = getattr(param, "output_dim", None)
        out = None if dim is None else self.padded(loaded, dim, param.data.shape[dim] * self._tp(), _param_is_scale(param))
        return None if out is None else _replace((param, *args), kwargs, 1, "loaded_weight", out)

    def before_row_param(self, param: Any, *args: Any, **kwargs: Any) -> Args | None:
        if not self.plans or kwargs.get("use_presharded_weights") or (len(args) > 2 and args[2]):
            return None
        loaded = _arg(args, kwargs, 0, "loaded_weight")
        dim = getattr(param, "input_dim", None)
        out = None if dim is None else self.padded(loaded, dim, param.data.shape[dim] * self._tp(), _param_is_scale(param))
        return None if out is None else _replace((param, *args), kwargs, 1, "loaded_weight", out)

    def _before_layer_loader(self, attr: str, layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args | None:
        if not self.plans or getattr(layer, "use_presharded_weights", False):
            return None
        param = _arg(args, kwargs, 0, "param")
        loaded = _arg(args, kwargs, 1, "loaded_weight")
        dim = getattr(param, attr, None)
        if param is None or dim is None:
            return None
        scale = _param_is_scale(param) or any(param is getattr(layer, n, None) for n in SCALE_NAMES)
        out = self.padded(loaded, dim, param.data.shape[dim] * self._tp(), scale)
        return None if out is None else _replace((layer, *args), kwargs, 2, "loaded_weight", out)

    def before_column_linear(self, layer: Any, *args: Any, **kwargs: Any) -> Args | None:
        return self._before_layer_loader("output_dim", layer, args, kwargs)

    def before_row_linear(self, layer: Any, *args: Any, **kwargs: Any) -> Args | None:
        return self._before_layer_loader("input_dim", layer, args, kwargs)

    def _before_whole(self, param: Any, loaded: Any, scale: bool) -> Any:
        """Replicated parameters: pad the one dimension where the checkpoint is short."""
        if not self.plans or param is None or loaded is None or getattr(loaded, "dim", None) is None:
            return None
        shape = tuple(param.data.shape)
        if loaded.dim() != len(shape):
            return None
        short = [d for d in range(len(shape)) if int(loaded.shape[d]) != shape[d]]
        if len(short) != 1:
            return None
        return self.padded(loaded, short[0], shape[short[0]], scale)

    def before_replicated_linear(self, layer: Any, *args: Any, **kwargs: Any) -> Args | None:
        param = _arg(args, kwargs, 0, "param")
        scale = _param_is_scale(param) or any(param is getattr(layer, n, None) for n in SCALE_NAMES)
        out = self._before_whole(param, _arg(args, kwargs, 1, "loaded_weight"), scale)
        return None if out is None else _replace((layer, *args), kwargs, 2, "loaded_weight", out)

    def before_default_loader(self, *args: Any, **kwargs: Any) -> Args | None:
        param = _arg(args, kwargs, 0, "param")
        out = self._before_whole(param, _arg(args, kwargs, 1, "loaded_weight"), _param_is_scale(param))
        return None if out is None else _replace(args, kwargs, 1, "loaded_weight", out)

    # --- vocab --------------------------------------------------------------------------
    def before_vocab_init(self, layer: Any, *args: Any, **kwargs: Any) -> Args | None:
        if not self.plans:
            return None
        rows = _arg(args, kwargs, 0, "num_embeddings")
        if rows not in {plan.vocab for plan in self.plans.values()}:
            return None  # only the token vocabulary (embedding, LM head), never other tables
        pad_to = int(kwargs.get("padding_size", 64))
        wanted = math.lcm(pad_to, self._tp())
        if wanted == pad_to:
            return None
        return (layer, *args), {**kwargs, "padding_size": wanted}


def dims_of_plan(plan: PadPlan) -> ModelDims:
    return ModelDims(plan.heads, plan.groups, plan.vocab, plan.draft_experts)


def _param_is_scale(param: Any) -> bool:
    return param is not None and "Scale" in type(param).__name__


def build(env: Mapping[str, str], log: AdapterLog) -> AdapterSpec | None:
    if not rankadapters.DSV41_TP_PAD.read(env):
        return None
    pad = Tp3Pad(log)
    return AdapterSpec(
        name=NAME,
        state=pad,
        detail="DeepSeek-V4 heads by output groups to 8/16/32/64/128 per rank, vocab to lcm(64, tp), draft experts to tp",
        patches=(
            Patch(CONFIG, "ModelConfig.from_server_args", AFTER, pad.after_from_server_args, params=("server_args",)),
            Patch(
                PARAMETER,
                "_ColumnvLLMParameter.load_column_parallel_weight",
                BEFORE,
                pad.before_column_param,
                params=("self", "loaded_weight", "tp_rank"),
            ),
            Patch(
                PARAMETER,
                "RowvLLMParameter.load_row_parallel_weight",
                BEFORE,
                pad.before_row_param,
                params=("self", "loaded_weight", "tp_rank"),
            ),
            Patch(LINEAR, "ColumnParallelLinear.weight_loader", BEFORE, pad.before_column_linear, params=("self", "param", "loaded_weight")),
            Patch(LINEAR, "RowParallelLinear.weight_loader", BEFORE, pad.before_row_linear, params=("self", "param", "loaded_weight")),
            Patch(
                LINEAR,
                "ReplicatedLinear.weight_loader",
                BEFORE,
                pad.before_replicated_linear,
                params=("self", "param", "loaded_weight"),
            ),
            Patch(WEIGHT_UTILS, "default_weight_loader", BEFORE, pad.before_default_loader, params=("param", "loaded_weight")),
            Patch(VOCAB, "VocabParallelEmbedding.__init__", BEFORE, pad.before_vocab_init, params=("self", "num_embeddings", "padding_size")),
        ),
    )
