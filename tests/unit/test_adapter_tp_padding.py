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


def flash_config(tp: int, draft: bool = False):
    from types import SimpleNamespace

    hf = SimpleNamespace(
        architectures=["DeepseekV4ForCausalLM"], num_attention_heads=64, o_groups=8, vocab_size=129_280, dspark_n_routed_experts=128
    )
    return SimpleNamespace(hf_config=hf, hf_text_config=hf, num_attention_heads=64, is_draft_model=draft), SimpleNamespace(tp_size=tp)


def test_config_hook_pads_deepseek_v4_once_and_only_when_needed() -> None:
    import io

    from dsv41.adapterlog import AdapterLog
    from adapter.tp3_pad import Tp3Pad

    buf = io.StringIO()
    pad = Tp3Pad(AdapterLog(buf))
    config, args = flash_config(4)
    pad.after_from_server_args(config, args)
    assert config.num_attention_heads == 64 and not pad.plans  # TP4 divides everything
    config, args = flash_config(3)
    pad.after_from_server_args(config, args)
    pad.after_from_server_args(config, args)  # the same object again: not padded twice
    hf = config.hf_config
    assert (config.num_attention_heads, hf.num_attention_heads, hf.o_groups, hf.dspark_n_routed_experts) == (96, 96, 12, 129)
    assert hf.dsv41_tp_pad["padded_vocab"] == 129_408 and len(pad.plans) == 1
    assert buf.getvalue().count("tp3_pad: model padded") == 1
    other = flash_config(3)[0]
    other.hf_config.architectures = ["LlamaForCausalLM"]
    pad.after_from_server_args(other, args)
    assert other.hf_config.num_attention_heads == 64


def test_vocab_hook_only_touches_the_token_vocabulary() -> None:
    import io

    from dsv41.adapterlog import AdapterLog
    from adapter.tp3_pad import Tp3Pad

    pad = Tp3Pad(AdapterLog(io.StringIO()))
    layer = object()
    assert pad.before_vocab_init(layer, 129_280, 5120) is None  # no plan yet
    config, args = flash_config(3)
    pad.after_from_server_args(config, args)
    assert pad.before_vocab_init(layer, 129_280, 5120, padding_size=64) == ((layer, 129_280, 5120), {"padding_size": 192})
    assert pad.before_vocab_init(layer, 384_006_168, 256) is None  # an Engram table keeps its layout
