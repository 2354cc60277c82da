"""The SGLang 0.5.23 flags the stand-in knows, with SGLang's own types and choices.

Taken from `ServerArgs.add_cli_args` of sglang 0.5.23: every flag coordinator/plan.py renders, the
example configuration's EXTRA_SGLANG_ARGS and a few common extras. A flag missing here is rejected
as unknown (exit status 2), so a config that needs one fails loudly in the demo instead of being
ignored.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Callable


def human_readable_int(value: str) -> int:
    """SGLang's `human_readable_int`: 1k=1000, 1M=10**6, 1Ki=1024 (decimals only with SI suffixes)."""
    value = value.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)", value)
    if match:
        number, suffix = match.groups()
        iec = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
        if suffix in iec:
            if "." in number:
                raise argparse.ArgumentTypeError(f"decimals are not allowed with IEC suffixes like {suffix!r}")
            return int(number) * iec[suffix]
        return int(Decimal(number) * {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}[suffix])
    try:
        return int(value)
    except ValueError:
        pass
    try:
        return int(Decimal(value))
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"invalid integer {value!r} (use e.g. 262144, 256k or 256Ki)") from None


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]  # the first is the canonical name
    kind: Callable[[str], object] | None = str  # None: a switch (store_true)
    choices: tuple[str, ...] | None = None

    @property
    def dest(self) -> str:
        return self.names[0].lstrip("-").replace("-", "_")


LOAD_FORMATS = ("auto", "pt", "safetensors", "instanttensor", "npcache", "dummy", "sharded_state", "presharded",
                "gguf", "expert_pack", "bitsandbytes", "mistral", "layered", "flash_rl", "remote",
                "remote_instance", "fastsafetensors", "private", "runai_streamer")
ATTENTION_BACKENDS = ("triton", "torch_native", "flex_attention", "dsa", "nsa", "qsa", "dsv4", "compressed", "fa3",
                      "fa4", "flashinfer", "llada2_cfg_flashinfer", "flashmla", "trtllm_mla", "cutedsl_mla",
                      "tokenspeed_mla", "trtllm_mha", "hpc_ops", "minicpm_flashattn", "minicpm_flashinfer",
                      "aiter", "wave", "intel_amx", "ascend", "intel_xpu")
MOE_RUNNER_BACKENDS = ("auto", "deep_gemm", "triton", "triton_kernel", "flashinfer_trtllm",
                       "experimental_sgl_trtllm", "flashinfer_trtllm_routed", "flashinfer_cutlass",
                       "flashinfer_mxfp4", "flashinfer_cutedsl", "flashinfer_megamoe", "cutlass", "aiter", "marlin",
                       "humming", "experimental_sgl_marlin", "lora_cutedsl", "lora_triton", "lora_marlin",
                       "hpc_ops", "megamoe", "intel_xpu")
FP8_GEMM_BACKENDS = ("auto", "deep_gemm", "flashinfer_trtllm", "flashinfer_cutlass", "flashinfer_deepgemm",
                     "flashinfer_cutedsl", "cutlass", "triton", "aiter")
KV_CACHE_DTYPES = ("auto", "fp8_e5m2", "fp8_e4m3", "mxfp8", "bf16", "bfloat16", "nvfp4", "fp4_mx_block16")
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
QUANTIZATIONS = ("awq", "fp8", "mxfp8", "gptq", "gptq_marlin", "awq_marlin", "bitsandbytes", "gguf", "modelopt",
                 "modelopt_fp8", "modelopt_fp4", "nvfp4_online", "modelopt_mixed", "petit_nvfp4", "w8a8_int8",
                 "w8a8_fp8", "moe_wna16", "w4afp8", "mxfp4", "auto-round", "auto-round-int8", "compressed-tensors",
                 "modelslim", "mxfp_w4a8", "quark", "quark_int4fp8_moe", "quark_mxfp4", "mlx_q4", "mlx_q8",
                 "unquant", "humming")
SCHEDULE_POLICIES = ("lpm", "random", "fcfs", "dfs-weight", "lof", "priority", "routing-key", "hrrn",
                     "shortest-prefill-first")
TOOL_CALL_PARSERS = ("auto", "apertus2509", "beam", "cohere_command4", "deepseekv3", "deepseekv31", "deepseekv32",
                     "deepseekv4", "deepseekv41", "dots", "glm", "glm45", "glm47", "gpt-oss", "k2_horizon",
                     "kimi_k2", "kimi_k3", "lfm2", "ling3", "llama3", "mimo", "minicpm5", "mistral", "muse",
                     "poolside_v1", "pythonic", "qwen", "qwen25", "qwen3_coder", "spark25", "step3", "step3p5",
                     "minimax-m2", "minimax-m3", "nanbeige", "trinity", "interns1", "hermes", "hunyuan",
                     "gigachat3", "gigachat35", "gemma4", "inkling", "iquest_q1", "response_template")
REASONING_PARSERS = ("auto", "apertus2509", "beam", "deepseek-r1", "deepseek-v3", "deepseek-v4", "deepseek-v41",
                     "dots", "glm45", "ling3", "hunyuan", "gpt-oss", "k2_horizon", "kimi", "kimi_k2", "kimi_k3",
                     "mimo", "muse", "poolside_v1", "qwen3", "qwen3-thinking", "minimax", "minimax-append-think",
                     "minimax-m3", "nanbeige", "step3", "step3p5", "mistral", "nemotron_3",
                     "granite_thinking_parser", "interns1", "gemma4", "inkling", "iquest_q1", "cohere_command4",
                     "gigachat35", "response_template")
# DeepSeek-V4 accepts exactly these (SGLang resolves the name case-insensitively).
SPECULATIVE_ALGORITHMS = ("EAGLE", "DSPARK")

FLAGS: tuple[Flag, ...] = (
    Flag(("--model-path", "--model")),
    Flag(("--tokenizer-path",)),
    Flag(("--served-model-name",)),
    Flag(("--trust-remote-code",), None),
    Flag(("--load-format",), str, LOAD_FORMATS),
    Flag(("--dtype",), str, DTYPES),
    Flag(("--quantization",), str, QUANTIZATIONS),
    Flag(("--kv-cache-dtype",), str, KV_CACHE_DTYPES),
    Flag(("--tp-size", "--tensor-parallel-size"), int),
    Flag(("--ep-size", "--expert-parallel-size", "--ep"), int),
    Flag(("--attention-backend",), str, ATTENTION_BACKENDS),
    Flag(("--moe-runner-backend",), str, MOE_RUNNER_BACKENDS),
    Flag(("--fp8-gemm-backend",), str, FP8_GEMM_BACKENDS),
    Flag(("--mem-fraction-static",), float),
    Flag(("--chunked-prefill-size",), int),
    Flag(("--max-prefill-tokens",), human_readable_int),
    Flag(("--context-length",), human_readable_int),
    Flag(("--max-total-tokens",), human_readable_int),
    Flag(("--max-running-requests",), int),
    Flag(("--max-queued-requests",), int),
    Flag(("--page-size",), int),
    Flag(("--random-seed",), int),
    Flag(("--schedule-policy",), str, SCHEDULE_POLICIES),
    Flag(("--schedule-conservativeness",), float),
    Flag(("--stream-interval",), int),
    Flag(("--tool-call-parser",), str, TOOL_CALL_PARSERS),
    Flag(("--reasoning-parser",), str, REASONING_PARSERS),
    Flag(("--host",)),
    Flag(("--port",), int),
    Flag(("--api-key",)),
    Flag(("--log-level",)),
    Flag(("--decode-log-interval",), int),
    Flag(("--speculative-algorithm",)),
    Flag(("--speculative-dspark-block-size",), int),
    Flag(("--speculative-dspark-sps-table-path",)),
    Flag(("--speculative-dspark-confidence-sts-path",)),
    Flag(("--speculative-num-draft-tokens",), int),
    Flag(("--speculative-num-steps",), int),
    Flag(("--speculative-eagle-topk",), int),
    Flag(("--speculative-draft-model-path", "--speculative-draft-model")),
    Flag(("--nnodes",), int),
    Flag(("--node-rank",), int),
    Flag(("--dist-init-addr", "--nccl-init-addr")),
    Flag(("--dist-timeout",), int),
    Flag(("--watchdog-timeout",), float),
    Flag(("--enable-cache-report",), None),
    Flag(("--enable-metrics",), None),
    Flag(("--sleep-on-idle",), None),
    Flag(("--disable-radix-cache",), None),
    Flag(("--disable-cuda-graph",), None),
    Flag(("--disable-overlap-schedule",), None),
    Flag(("--skip-server-warmup",), None),
    Flag(("--log-requests",), None),
    Flag(("--show-time-cost",), None),
    Flag(("--enable-torch-compile",), None),
)

# SGLang's defaults for the flags whose value the stand-in uses.
DEFAULTS = {"host": "127.0.0.1", "port": 30000, "tp_size": 1, "ep_size": 1, "nnodes": 1, "node_rank": 0,
            "load_format": "auto", "watchdog_timeout": 300.0, "log_level": "info", "schedule_policy": "fcfs",
            "stream_interval": 1, "max_prefill_tokens": 16384}
