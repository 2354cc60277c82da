"""The TP padding plan for DeepSeek-V4.1-Flash's dimensions."""

from __future__ import annotations

import pytest

from adapter.tp_padding import SUPPORTED_LOCAL_HEADS, ModelDims, PaddingError, pad_groups, plan_padding

pytestmark = pytest.mark.unit

FLASH = ModelDims(heads=64, groups=8, vocab=129_280, draft_experts=128)


def test_tp3_matches_the_reference_shapes() -> None:
    plan = plan_padding(FLASH, 3)
    assert (plan.padded_heads, plan.padded_groups, plan.local_heads, plan.local_groups) == (96, 12, 32, 4)
    assert plan.padded_vocab == 129_408 and plan.padded_vocab % 192 == 0
    assert plan.padded_draft_experts == 129
    assert plan.needed
    # Rank 2's attention shard is all padding: its heads start at the checkpoint's 64.
    assert plan.head_range(2) == range(64, 96)
    assert plan.group_range(0) == range(0, 4) and plan.group_range(1) == range(4, 8)
    assert plan.vocab_range(2) == range(2 * 43_136, 129_408)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_sizes_that_divide_need_nothing(tp: int) -> None:
    plan = plan_padding(FLASH, tp)
    assert not plan.needed
    assert plan.describe().endswith("nothing to pad")


@pytest.mark.parametrize("tp", range(1, 17))
def test_every_tp_gets_a_supported_even_split(tp: int) -> None:
    plan = plan_padding(FLASH, tp)
    assert plan.padded_groups % tp == 0 and plan.padded_heads % tp == 0
    assert plan.local_heads in SUPPORTED_LOCAL_HEADS
    assert plan.padded_heads // plan.padded_groups == 8  # whole groups only
    assert plan.padded_vocab % tp == 0 and plan.padded_vocab % 64 == 0
    assert plan.padded_vocab - plan.vocab < 64 * tp
    assert plan.padded_draft_experts % tp == 0 and plan.padded_draft_experts - 128 < tp
    # Minimal: one group fewer per rank would not give a supported split.
    smaller = plan.padded_groups - tp
    assert smaller < 8 or smaller * 8 // tp not in SUPPORTED_LOCAL_HEADS


def test_padded_size_tells_padding_from_real_mismatches() -> None:
    plan = plan_padding(FLASH, 3)
    assert plan.padded_size(64 * 512, 96 * 512) == "attention"  # wq_b rows
    assert plan.padded_size(8 * 1024, 12 * 1024) == "attention"  # wo_a rows / wo_b columns
    assert plan.padded_size(64 * 512 // 32, 96 * 512 // 32) == "attention"  # their 32x32 block scales
    assert plan.padded_size(64, 96) == "attention"  # attention sinks
    assert plan.padded_size(128, 129) == "experts"
    assert plan.padded_size(5120, 5121) is None
    assert plan.padded_size(100, 200) is None
    assert plan.padded_size(96, 96) is None


def test_impossible_layouts_are_refused_with_the_reason() -> None:
    with pytest.raises(PaddingError, match="equal output groups"):
        ModelDims(heads=64, groups=7, vocab=10)
    with pytest.raises(PaddingError, match="local head count"):
        pad_groups(heads=3 * 128 * 2, groups=2, tp=1)
    with pytest.raises(PaddingError, match="tp must be"):
        plan_padding(FLASH, 0)
