"""What the decode adapters' fp8 copies cost or save per rank, from DeepSeek-V4.1-Flash's shapes (pure).

The shapes are the checkpoint's, padded for the TP size as tp_padding.py pads them (at TP 3: 8 output
groups -> 12, 4 per rank; vocabulary 129,280 -> 129,408, 43,136 rows per rank):

- wo_a, per layer and rank: [local groups x o_lora_rank, heads per group x head_dim] =
  [4 x 1024, 8 x 512] at TP 3, bf16 in SGLang (it dequantises the checkpoint's fp8 at load);
- the LM head the draft shares with the target, per rank: [vocab per rank, hidden] bf16.

An fp8 copy holds one byte per value plus one float32 scale per 32 x 32 tile (fp8_blocks.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from adapter.tp_padding import ModelDims, plan_padding

MIB = 2**20
SCALE_BLOCK = 32
SCALE_BYTES = 4  # float32 power-of-two scales
BF16_BYTES = 2


@dataclass(frozen=True)
class ModelShapes:
    hidden: int = 5120
    heads: int = 64
    groups: int = 8
    head_dim: int = 512  # qk_nope 448 + rope 64
    o_lora_rank: int = 1024
    vocab: int = 129_280
    layers: int = 40  # target layers (each has a wo_a)
    draft_stages: int = 3  # DSpark draft layers (each has a wo_a)
    draft_experts: int = 128


V41_FLASH = ModelShapes()


@dataclass(frozen=True)
class RankShapes:
    tp: int
    local_groups: int
    o_lora_rank: int
    wo_a_in: int  # heads per group x head_dim
    vocab_per_rank: int
    hidden: int
    layers: int
    draft_stages: int

    @property
    def wo_a_out(self) -> int:
        return self.local_groups * self.o_lora_rank


def rank_shapes(model: ModelShapes = V41_FLASH, tp: int = 3) -> RankShapes:
    plan = plan_padding(ModelDims(model.heads, model.groups, model.vocab, model.draft_experts), tp)
    return RankShapes(
        tp=tp,
        local_groups=plan.local_groups,
        o_lora_rank=model.o_lora_rank,
        wo_a_in=plan.heads_per_group * model.head_dim,
        vocab_per_rank=plan.vocab_per_rank,
        hidden=model.hidden,
        layers=model.layers,
        draft_stages=model.draft_stages,
    )


def _tiles(n: int, k: int) -> int:
    return -(-n // SCALE_BLOCK) * -(-k // SCALE_BLOCK)


@dataclass(frozen=True)
class Copy:
    """Bytes of one bf16 weight and of its fp8 copy (codes and scales)."""

    bf16: int
    codes: int
    scales: int

    @property
    def fp8(self) -> int:
        return self.codes + self.scales


def wo_a_layer(s: RankShapes) -> Copy:
    n, k = s.o_lora_rank, s.wo_a_in
    per_group = Copy(bf16=n * k * BF16_BYTES, codes=n * k, scales=_tiles(n, k) * SCALE_BYTES)
    return Copy(per_group.bf16 * s.local_groups, per_group.codes * s.local_groups, per_group.scales * s.local_groups)


def draft_head(s: RankShapes) -> Copy:
    n, k = s.vocab_per_rank, s.hidden
    return Copy(bf16=n * k * BF16_BYTES, codes=n * k, scales=_tiles(n, k) * SCALE_BYTES)


@dataclass(frozen=True)
class Delta:
    """Bytes per rank an adapter setting allocates and releases."""

    added: int
    released: int

    @property
    def net(self) -> int:
        return self.added - self.released


def wo_a_delta(s: RankShapes, drop: bool, draft: bool) -> Delta:
    """DSV41_WO_A_W8 (twins of the target's wo_a; with _DRAFT also the draft's), _DROP releasing the
    bf16 copies of every twinned layer."""
    layers = s.layers + (s.draft_stages if draft else 0)
    one = wo_a_layer(s)
    return Delta(added=layers * one.fp8, released=layers * one.bf16 if drop else 0)


def draft_head_delta(s: RankShapes) -> Delta:
    """DSV41_DRAFT_HEAD_FP8: an fp8 copy beside the target's bf16 head, which the target keeps."""
    return Delta(added=draft_head(s).fp8, released=0)


def mib(n: int) -> str:
    return f"{n / MIB:+.1f} MiB" if n else "0 MiB"
