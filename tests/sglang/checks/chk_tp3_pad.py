"""tp3_pad on the real ModelConfig.from_server_args and the real parameter loaders.

argv: a scratch directory for the model config.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit, installer, marked  # noqa: E402

import torch  # noqa: E402

from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.layers import linear, parameter  # noqa: E402
from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding  # noqa: E402
from sglang.srt.model_loader import weight_utils  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402

model = Path(sys.argv[1])
model.mkdir(parents=True, exist_ok=True)
# DeepSeek-V4.1-Flash's attention / vocab / draft-expert counts on a tiny hidden size.
(model / "config.json").write_text(
    json.dumps(
        {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v41",
            "num_attention_heads": 64,
            "o_groups": 8,
            "vocab_size": 129280,
            "dspark_n_routed_experts": 128,
            "hidden_size": 256,
            "num_hidden_layers": 2,
            "sliding_window": 128,
            "index_head_dim": 128,
            "compress_ratios": [0, 0],
            "torch_dtype": "bfloat16",
        }
    )
)


def config(tp):
    mc = ModelConfig.from_server_args(prepare_server_args(["--model-path", str(model), "--tp-size", str(tp)]))
    hf = mc.hf_config
    return {
        "heads": mc.num_attention_heads,
        "hf_heads": hf.num_attention_heads,
        "groups": hf.o_groups,
        "draft_experts": getattr(hf, "dspark_n_routed_experts", None),
        "plan": getattr(hf, "dsv41_tp_pad", None),
    }


result = {
    "marked": {
        "from_server_args": marked(ModelConfig.from_server_args),
        "column": marked(parameter._ColumnvLLMParameter.load_column_parallel_weight),
        "row": marked(parameter.RowvLLMParameter.load_row_parallel_weight),
        "column_v1": marked(linear.ColumnParallelLinear.weight_loader),
        "row_v1": marked(linear.RowParallelLinear.weight_loader),
        "replicated": marked(linear.ReplicatedLinear.weight_loader),
        "default": marked(weight_utils.default_weight_loader),
        "vocab": marked(VocabParallelEmbedding.__init__),
    },
    "tp4": config(4),  # divides everything: left alone
    "tp3": config(3),
}

HEAD_DIM, O_LORA, HIDDEN, BLOCK = 16, 8, 32, 32
torch.manual_seed(0)
wq_b = torch.randn(64 * HEAD_DIM, HIDDEN)  # checkpoint: 64 heads
wq_b_scale = torch.rand(64 * HEAD_DIM // BLOCK, HIDDEN // BLOCK) + 0.5
wo_b = torch.randn(HIDDEN, 8 * O_LORA)  # checkpoint: 8 groups in
sink = torch.randn(64)


def column(loaded, rank, scale=False):
    rows = 32 * HEAD_DIM // (BLOCK if scale else 1)  # 32 local heads at TP3
    cls = parameter.BlockQuantScaleParameter if scale else parameter.ModelWeightParameter
    p = cls(data=torch.full((rows, loaded.shape[1]), -7.0), output_dim=0, input_dim=1, weight_loader=None)
    p.load_column_parallel_weight(loaded, tp_rank=rank)
    return p.data


def row(loaded, rank):
    p = parameter.ModelWeightParameter(data=torch.full((HIDDEN, 4 * O_LORA), -7.0), output_dim=0, input_dim=1, weight_loader=None)
    p.load_row_parallel_weight(loaded, tp_rank=rank)
    return p.data


def default(size, loaded):
    p = torch.nn.Parameter(torch.full((size,), -7.0), requires_grad=False)
    weight_utils.default_weight_loader(p, loaded)
    return p.data


def attempt(check, load):
    """check(tensor) for what the loader produced, or the loader's error."""
    try:
        return check(load())
    except (AssertionError, RuntimeError) as e:
        return f"error: {type(e).__name__}"


loaded = {
    "wq_b_rank0_is_checkpoint_heads_0_31": attempt(lambda t: bool(torch.equal(t, wq_b[: 32 * HEAD_DIM])), lambda: column(wq_b, 0)),
    "wq_b_rank2_all_zero": attempt(lambda t: bool(torch.count_nonzero(t) == 0), lambda: column(wq_b, 2)),
    "scale_rank1_is_checkpoint": attempt(
        lambda t: bool(torch.equal(t, wq_b_scale[32 * HEAD_DIM // BLOCK :])), lambda: column(wq_b_scale, 1, scale=True)
    ),
    "scale_rank2_values": attempt(lambda t: sorted(set(t.flatten().tolist())), lambda: column(wq_b_scale, 2, scale=True)),
    "wo_b_rank1_is_groups_4_7": attempt(lambda t: bool(torch.equal(t, wo_b[:, 4 * O_LORA :])), lambda: row(wo_b, 1)),
    "wo_b_rank2_all_zero": attempt(lambda t: bool(torch.count_nonzero(t) == 0), lambda: row(wo_b, 2)),
    "sink_head_64_on_zero": attempt(
        lambda t: bool(torch.equal(t[:64], sink)) and bool(torch.count_nonzero(t[64:]) == 0), lambda: default(96, sink)
    ),
    "router_bias_padding": attempt(lambda t: float(t[128]), lambda: default(129, torch.zeros(128))),
    # A mismatch the plan does not explain must still fail.
    "unexplained_mismatch": attempt(lambda t: "loaded", lambda: default(96, torch.randn(90))),
}
result["loaded"] = loaded
inst = installer()
result["mode"] = inst.mode() if inst else None
emit(result)
