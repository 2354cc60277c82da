"""Writes the CPU rehearsal's model: a tiny LlamaForCausalLM that real SGLang serves on a CPU, with
an offline byte-level tokenizer. Deterministic: the same files, byte for byte, on every run.

    <engine venv>/bin/python tools/engine/tiny_model.py OUT_DIR

Its weights are random except where they make it a bigram machine: the residual stream is the
last token's embedding (one direction per state below) plus small random attention and MLP terms,
so greedy decoding follows a fixed table whatever the TP size, while every layer's attention,
MLP, KV cache and all-reduce still runs on real numbers:

    <|assistant|> -> "4" -> "2" -> <|end|>   every chat answer is "42", finish_reason stop
    a -> b -> ... -> z -> a                  a prompt ending in a letter never stops (a loop)
    # -> #                                   a prompt ending in # repeats one token
    anything else -> <|end|>

One token per byte, so a prompt's length in tokens is its length in bytes plus the template's.
It proves the serving path (tokenizer, chat template, TP group, detokenizer, finish reasons), not
the engine's arithmetic on DeepSeek-V4.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

HIDDEN = 192
LAYERS = 2
HEADS = 6  # divisible by TP 1, 2, 3 and 6
KV_HEADS = 6
INTERMEDIATE = 384
VOCAB = 384  # the tokenizer's 256 bytes + specials, padded to a multiple of 64 and of 3
CONTEXT = 16384
SPECIALS = ("<|begin|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
BOS, EOS, ASSISTANT = 256, 257, 260
NOISE = 0.02  # the random weights' scale: far below the embedding's one-hot direction
LOGIT = 10.0
SHARD = "model-00001-of-00001.safetensors"
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def byte_symbols() -> list[str]:
    """GPT-2's byte-to-unicode table: symbol i stands for byte i."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def successors() -> dict[int, int]:
    """token -> the token greedy decoding emits after it; tokens not listed go to <|end|>."""
    table = {ASSISTANT: ord("4"), ord("4"): ord("2"), ord("2"): EOS, ord("#"): ord("#")}
    letters = [ord(c) for c in "abcdefghijklmnopqrstuvwxyz"]
    table.update({a: b for a, b in zip(letters, letters[1:] + letters[:1])})
    return table


def tokenizer() -> Tokenizer:
    vocab = {symbol: i for i, symbol in enumerate(byte_symbols())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    return tok


def weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)

    def noise(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * NOISE

    table = successors()
    states = {token: 1 + i for i, token in enumerate(sorted(table))}  # direction 0: every other token
    embed = torch.zeros(VOCAB, HIDDEN)
    for token in range(VOCAB):
        embed[token, states.get(token, 0)] = 1.0
    head = torch.zeros(VOCAB, HIDDEN)
    head[EOS, 0] = LOGIT
    for token, nxt in table.items():
        head[nxt, states[token]] = LOGIT
    head_dim = HIDDEN // HEADS
    tensors = {"model.embed_tokens.weight": embed, "lm_head.weight": head, "model.norm.weight": torch.ones(HIDDEN)}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        tensors.update({
            p + "input_layernorm.weight": torch.ones(HIDDEN),
            p + "post_attention_layernorm.weight": torch.ones(HIDDEN),
            p + "self_attn.q_proj.weight": noise(HEADS * head_dim, HIDDEN),
            p + "self_attn.k_proj.weight": noise(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": noise(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": noise(HIDDEN, HEADS * head_dim),
            p + "mlp.gate_proj.weight": noise(INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": noise(INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": noise(HIDDEN, INTERMEDIATE),
        })
    return {name: t.to(torch.bfloat16).contiguous() for name, t in sorted(tensors.items())}


def config() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
        "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HIDDEN // HEADS, "intermediate_size": INTERMEDIATE,
        "vocab_size": VOCAB, "max_position_embeddings": CONTEXT, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": BOS, "eos_token_id": EOS,
    }


def write(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    tensors = weights()
    save_file(tensors, str(out / SHARD), metadata={"format": "pt"})
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": size}, "weight_map": {name: SHARD for name in tensors}}
    files = {
        "config.json": config(),
        "generation_config.json": {"bos_token_id": BOS, "eos_token_id": EOS, "do_sample": False},
        "model.safetensors.index.json": index,
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[0], "eos_token": SPECIALS[1],
            "pad_token": SPECIALS[1], "model_max_length": CONTEXT, "chat_template": CHAT_TEMPLATE,
            "add_bos_token": False, "clean_up_tokenization_spaces": False},
        "special_tokens_map.json": {"bos_token": SPECIALS[0], "eos_token": SPECIALS[1], "pad_token": SPECIALS[1]},
    }
    for name, body in files.items():
        (out / name).write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    tokenizer().save(str(out / "tokenizer.json"))
    return sorted(out.iterdir())


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    for path in write(Path(sys.argv[1])):
        print(path)
