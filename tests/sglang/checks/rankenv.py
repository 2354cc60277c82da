"""One SGLang scheduler rank's context on the CPU for the check scripts (gloo, real ServerArgs), and
small real-format DeepSeek-V4.1 configs for building SGLang's own layers."""

from __future__ import annotations

import json
import socket
from pathlib import Path

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
         "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 4,
         "vocab_size": 1000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}

# A DeepSeek-V4.1 layer at small sizes: 8 heads in 2 output groups, head_dim 64 (48 + 16), o_lora_rank 64.
V41 = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v41", "hidden_size": 64,
       "num_attention_heads": 8, "o_groups": 2, "o_lora_rank": 64, "qk_nope_head_dim": 48, "qk_rope_head_dim": 16,
       "head_dim": 64, "q_lora_rank": 32, "num_hidden_layers": 1, "vocab_size": 1000, "compress_ratios": [0],
       "n_routed_experts": 12, "num_experts_per_tok": 3, "moe_intermediate_size": 32, "intermediate_size": 64,
       "n_group": 1, "topk_group": 1, "quantization_config": {}, "rope_scaling": {}, "kv_source_layer_ids": [],
       "index_source_layer_ids": [], "engram_layer_ids": [], "engram_num_embeddings": []}
DSPARK = {**V41, "architectures": ["DeepseekV4ForCausalLMDSpark"],
          "dspark_config": {"markov_rank": 8, "block_size": 5, "markov_head_type": "vanilla"}}


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def start_rank(root: str, rank: int = 0, tp: int = 1, port: int | None = None) -> None:
    """Publish real ServerArgs for a small model directory under `root` and build SGLang's parallel
    state for rank `rank` of `tp` over gloo."""
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import prepare_server_args

    model = Path(root) / f"model-r{rank}"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(LLAMA))
    server_args = prepare_server_args(["--model-path", str(model), "--tp-size", str(tp), "--device", "cpu"])
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=rank, dp_rank=None, gpu_id=rank))
    ps.init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="gloo",
                                    distributed_init_method=f"tcp://127.0.0.1:{port or free_port()}")
    ps.initialize_model_parallel()


def end_rank() -> None:
    """Leave SGLang's parallel state together: a barrier, then its groups and gloo destroyed. A spawned
    rank that exits while a peer still talks to it can die in gloo's threads (SIGABRT, "terminate
    called without an active exception"), which fails the whole spawn."""
    import torch.distributed as dist
    from sglang.srt.distributed import parallel_state as ps

    dist.barrier(group=ps.get_world_group().cpu_group)
    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()


def v41_config(**overrides):
    from sglang.srt.configs.deepseek_v4 import DeepSeekV4Config

    return DeepSeekV4Config(**{**V41, **overrides})


def dspark_config(**overrides):
    from sglang.srt.configs.deepseek_v4 import DeepSeekV4Config

    return DeepSeekV4Config(**{**DSPARK, **overrides})
