"""Padding plan for tensor-parallel sizes that do not divide the model's dimensions (pure).

DeepSeek-V4.1-Flash has 64 attention heads in 8 output groups (wo_a is a grouped projection,
8 heads per group), a 129,280-token vocabulary and 128 DSpark draft experts. At TP=3 none of these
split evenly. The plan pads:

- heads by whole output groups, to the fewest groups that split evenly over the ranks *and* give
  each rank a local head count the sparse-MLA kernels exist for (8/16/32/64/128): TP=3 gives
  12 groups / 96 heads / 32 local heads; rank 2's attention shard is all padding;
- the vocabulary to a multiple of lcm(64, tp): TP=3 gives 129,408;
- the draft's routed experts to a multiple of tp: 128 -> 129.

Padding is exact when the padded rows of the column-parallel weights (query projection, grouped
output projection wo_a, vocab/LM head, router) are zero, the matching input columns of the
row-parallel wo_b are zero, FP8 block scales over padding are 1.0 (a zero scale is not a valid
e8m0 power of two), and padded experts can never be routed to (router bias far below any score).
tp_padding_torch.py applies this to tensors; tp3_pad.py wires it into SGLang's loaders.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

SUPPORTED_LOCAL_HEADS = (8, 16, 32, 64, 128)
VOCAB_ALIGN = 64


class PaddingError(ValueError):
    """The model cannot be padded for this TP size."""


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class ModelDims:
    heads: int
    groups: int
    vocab: int
    draft_experts: int | None = None

    def __post_init__(self) -> None:
        if self.heads <= 0 or self.groups <= 0 or self.vocab <= 0:
            raise PaddingError(f"dimensions must be positive: {self}")
        if self.heads % self.groups:
            raise PaddingError(f"{self.heads} heads do not form {self.groups} equal output groups")
        if self.draft_experts is not None and self.draft_experts <= 0:
            raise PaddingError(f"draft_experts must be positive, got {self.draft_experts}")


@dataclass(frozen=True)
class PadPlan:
    tp: int
    heads: int
    padded_heads: int
    groups: int
    padded_groups: int
    vocab: int
    padded_vocab: int
    draft_experts: int | None
    padded_draft_experts: int | None

    @property
    def heads_per_group(self) -> int:
        return self.heads // self.groups

    @property
    def local_heads(self) -> int:
        return self.padded_heads // self.tp

    @property
    def local_groups(self) -> int:
        return self.padded_groups // self.tp

    @property
    def vocab_per_rank(self) -> int:
        return self.padded_vocab // self.tp

    @property
    def pads_attention(self) -> bool:
        return self.padded_heads != self.heads

    @property
    def pads_experts(self) -> bool:
        return self.draft_experts is not None and self.padded_draft_experts != self.draft_experts

    @property
    def needed(self) -> bool:
        return self.pads_attention or self.padded_vocab != self.vocab or self.pads_experts

    def head_range(self, rank: int) -> range:
        return range(rank * self.local_heads, (rank + 1) * self.local_heads)

    def group_range(self, rank: int) -> range:
        return range(rank * self.local_groups, (rank + 1) * self.local_groups)

    def vocab_range(self, rank: int) -> range:
        return range(rank * self.vocab_per_rank, (rank + 1) * self.vocab_per_rank)

    def padded_size(self, have: int, want: int) -> str | None:
        """Which padded dimension a loaded size `have` -> sharded global size `want` is, if any.

        "attention" when the pair scales like heads/groups (query rows, wo_a rows, wo_b columns,
        attention sinks and their block scales), "experts" when it is the draft's expert count.
        None for anything else: such a mismatch is a real error and must not be padded over.
        """
        if have >= want:
            return None
        if self.pads_attention and have * self.padded_groups == want * self.groups:
            return "attention"
        if self.pads_experts and (have, want) == (self.draft_experts, self.padded_draft_experts):
            return "experts"
        return None

    def describe(self) -> str:
        parts = [f"tp={self.tp}"]
        if self.pads_attention:
            parts.append(
                f"heads {self.heads}->{self.padded_heads} ({self.groups}->{self.padded_groups} groups, "
                f"{self.local_heads} per rank)"
            )
        if self.padded_vocab != self.vocab:
            parts.append(f"vocab {self.vocab}->{self.padded_vocab}")
        if self.pads_experts:
            parts.append(f"draft experts {self.draft_experts}->{self.padded_draft_experts}")
        if not self.needed:
            parts.append("nothing to pad")
        return ", ".join(parts)

    def as_dict(self) -> dict[str, int | None]:
        return asdict(self)


def pad_groups(heads: int, groups: int, tp: int) -> int:
    """The fewest output groups >= `groups`, divisible by tp, with a supported local head count."""
    per_group = heads // groups
    count = round_up(groups, tp)
    while count * per_group // tp <= SUPPORTED_LOCAL_HEADS[-1]:
        if count * per_group // tp in SUPPORTED_LOCAL_HEADS and (count * per_group) % tp == 0:
            return count
        count += tp
    raise PaddingError(
        f"no padding of {heads} heads in {groups} groups gives TP={tp} a local head count in "
        f"{SUPPORTED_LOCAL_HEADS}"
    )


def plan_padding(dims: ModelDims, tp: int) -> PadPlan:
    if tp < 1:
        raise PaddingError(f"tp must be >= 1, got {tp}")
    groups = pad_groups(dims.heads, dims.groups, tp)
    experts = None if dims.draft_experts is None else round_up(dims.draft_experts, tp)
    return PadPlan(
        tp=tp,
        heads=dims.heads,
        padded_heads=groups * (dims.heads // dims.groups),
        groups=dims.groups,
        padded_groups=groups,
        vocab=dims.vocab,
        padded_vocab=round_up(dims.vocab, math.lcm(VOCAB_ALIGN, tp)),
        draft_experts=dims.draft_experts,
        padded_draft_experts=experts,
    )
