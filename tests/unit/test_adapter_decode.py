"""The decode adapters' pure parts: settings, the rules they apply, what fails closed, and the
memory their fp8 copies cost per rank at TP 3 beside the example configuration's figures."""

from __future__ import annotations

import io
import types
from types import SimpleNamespace

import pytest

from adapter import block_verify, decode_shapes, draft_head_fp8, draft_tau, folded_fence, verify_cap, wo_a_w8
from adapter.patching import ON_IMPORT, Refused
from dsv41.adapterlog import AdapterLog
from dsv41.ranksettings import SettingError

pytestmark = pytest.mark.unit
MIB = 2**20


def log() -> AdapterLog:
    return AdapterLog(io.StringIO())


# --- wo_a_w8 ---------------------------------------------------------------------------------

def test_wo_a_settings_follow_w8_and_its_options():
    assert wo_a_w8.settings_from_env({}) is None
    # The packaged defaults set MID and DROP: switching W8 off alone is the rollback.
    assert wo_a_w8.settings_from_env({"DSV41_WO_A_W8": "0", "DSV41_WO_A_W8_MID": "1", "DSV41_WO_A_W8_DROP": "1"}) is None
    s = wo_a_w8.settings_from_env({"DSV41_WO_A_W8": "1", "DSV41_WO_A_W8_MID": "1", "DSV41_WO_A_W8_DROP": "0"})
    assert (s.mid, s.drop, s.draft) == (True, False, False)
    with pytest.raises(SettingError, match=r"DSV41_WO_A_W8_DROP='2': expected 1 or 0"):
        wo_a_w8.settings_from_env({"DSV41_WO_A_W8": "1", "DSV41_WO_A_W8_DROP": "2"})


@pytest.mark.parametrize("rows, mode, mid, fp8", [
    (1, "decode", False, True), (6, "verify", False, True), (8, "verify", False, True),
    (9, "verify", False, False), (12, "verify", True, True), (24, "verify", True, True),
    (192, "verify", True, True), (193, "verify", True, False), (6, "prefill", True, False),
    (768, "prefill", True, False), (0, "verify", True, False), (6, "extend", True, False),
])
def test_wo_a_rows_served_by_the_twin(rows, mode, mid, fp8):
    flags = dict(decode=mode == "decode", verify=mode == "verify", prefill=mode == "prefill")
    assert wo_a_w8.serves_fp8(rows, mid=mid, **flags) is fp8


def test_wo_a_layers_on_sglangs_own_paths_keep_them():
    bf16 = SimpleNamespace(dtype="torch.bfloat16")

    def layer(**kw):
        return SimpleNamespace(wo_a=SimpleNamespace(weight=kw.pop("weight", bf16)), **kw)

    assert wo_a_w8.skip_reason(layer(), "target") is None
    assert wo_a_w8.skip_reason(layer(wo_a_fp8=True), "target") == "SGLang's fp8 wo_a"
    assert wo_a_w8.skip_reason(layer(use_mega_attention=True), "target") == "mega attention"
    assert wo_a_w8.skip_reason(layer(weight=SimpleNamespace(dtype="torch.float8_e4m3fn")), "target") \
        == "wo_a is torch.float8_e4m3fn"
    assert wo_a_w8.skip_reason(SimpleNamespace(wo_a=SimpleNamespace()), "target") == "no wo_a weight (GGUF)"
    assert wo_a_w8.skip_reason(layer(_use_fast_kernel=False), "draft").startswith("SGLANG_DSPARK_FAST_KERNEL=0")
    assert wo_a_w8.skip_reason(layer(_use_fast_kernel=False), "target") is None


def test_wo_a_fails_closed_only_when_the_bf16_copies_go():
    kept = wo_a_w8.build({"DSV41_WO_A_W8": "1", "DSV41_WO_A_W8_MID": "1"}, log())
    dropped = wo_a_w8.build({"DSV41_WO_A_W8": "1", "DSV41_WO_A_W8_DROP": "1", "DSV41_WO_A_W8_DRAFT": "1"}, log())
    assert kept.fail_closed is False and dropped.fail_closed is True
    assert [p.target for p in kept.patches] == [
        "sglang.srt.models.deepseek_v4._apply_wo_a_bf16_matmul",
        "sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM.post_load_weights"]
    assert dropped.patches[-1].target == "sglang.srt.models.deepseek_v4_dspark.DeepseekV4ForCausalLMDSpark.post_load_weights"
    assert kept.detail == "fp8 twins serve decode/verify forwards of 1-192 rows, target layers, bf16 copies kept"


# --- verify_cap ------------------------------------------------------------------------------

def test_verify_cap_syntax():
    assert verify_cap.parse_cap("") is None and verify_cap.parse_cap("0") is None
    assert verify_cap.parse_cap("conf:0.1") == 0.1 and verify_cap.parse_cap(" conf:1 ") == 1.0
    for bad in ("conf:0", "conf:1.5", "conf:x", "0.1", "3", "off", "conf:"):
        with pytest.raises(SettingError) as info:
            verify_cap.parse_cap(bad)
        assert str(info.value) == (f"DSV41_VERIFY_CAP={bad!r}: expected 0 (off) or conf:<T> with 0 < T <= 1, "
                                   "e.g. conf:0.1")


@pytest.mark.parametrize("confidence, threshold, k", [
    ([0.9, 0.9, 0.9, 0.9, 0.9], 0.1, 5),  # 0.9^5 = 0.59 >= 0.1: every draft verified
    ([0.5, 0.5, 0.5, 0.5, 0.5], 0.1, 3),  # 0.5, 0.25, 0.125 >= 0.1; 0.0625 < 0.1
    ([0.5, 0.2, 0.9, 0.9, 0.9], 0.1, 2),  # 0.5, 0.1 (= T, kept), 0.09 < T
    ([0.05, 0.9, 0.9, 0.9, 0.9], 0.1, 1),  # below T at once: the first draft is always verified
    ([1.0, 1.0, 0.0, 1.0, 1.0], 0.5, 2),  # a zero stops the product for good
    ([1.7, 1.0, 1.0, 1.0, 1.0], 1.0, 5),  # estimates are clamped to [0, 1]
    ([0.3, 0.9, 0.9, 0.9, 0.9], 0.3, 1),  # 0.27 < 0.3 after the first
])
def test_verify_cap_rule_on_constructed_confidences(confidence, threshold, k):
    assert verify_cap.live_drafts(confidence, threshold) == k


def test_verify_cap_minimum_and_refusals():
    assert verify_cap.live_drafts([0.0] * 5, 0.1, minimum=2) == 2
    assert verify_cap.live_drafts([0.0] * 5, 0.1, minimum=0) == 0
    spec = verify_cap.build({"DSV41_VERIFY_CAP": "conf:0.1"}, log())
    assert spec.fail_closed and spec.detail.startswith("confidence cap 0.1")
    assert verify_cap.build({"DSV41_VERIFY_CAP": "0"}, log()) is None
    # Asked for and impossible: the rank stops where SGLang's DSpark verify is imported.
    for env, message in (
        ({"DSV41_VERIFY_CAP": "conf:2"}, "verify_cap: DSV41_VERIFY_CAP='conf:2': expected 0 (off) or conf:<T>"),
        ({"DSV41_VERIFY_CAP": "conf:0.1", "SGLANG_RAGGED_VERIFY_MODE": "cap-accept"},
         "verify_cap: SGLANG_RAGGED_VERIFY_MODE=cap-accept schedules verify lengths itself"),
    ):
        refusal = verify_cap.build(env, log())
        assert refusal.fail_closed and len(refusal.patches) == 1
        patch = refusal.patches[0]
        assert (patch.module, patch.kind) == (verify_cap.VERIFY, ON_IMPORT)
        with pytest.raises(Refused) as info:
            patch.hook(types.ModuleType(patch.module))
        assert str(info.value.code).startswith("dsv41-adapter: " + message)
        assert str(info.value.code).endswith("; the rank does not start")


# --- the others ------------------------------------------------------------------------------

def test_draft_tau_syntax():
    assert draft_tau.parse_tau("") is None and draft_tau.parse_tau("1") is None and draft_tau.parse_tau("1.0") is None
    assert draft_tau.parse_tau("0.8") == 0.8
    for bad in ("0", "1.2", "-0.5", "warm"):
        with pytest.raises(SettingError, match=r"DSV41_DRAFT_TAU=.*: expected a factor in \(0, 1\], e.g. 0.8; 1 is off"):
            draft_tau.parse_tau(bad)
    assert draft_tau.build({"DSV41_DRAFT_TAU": "1"}, log()) is None
    assert draft_tau.build({"DSV41_DRAFT_TAU": "0.8"}, log()).fail_closed is True
    assert draft_tau.build({"DSV41_DRAFT_TAU": "2"}, log()).detail.startswith("refuses: DSV41_DRAFT_TAU='2'")


def test_which_decode_adapters_fail_closed():
    on = {"DSV41_DRAFT_HEAD_FP8": "1", "DSV41_BLOCK_VERIFY": "1", "DSV41_FOLDED_FENCE": "1"}
    assert draft_head_fp8.build(on, log()).fail_closed is False  # every rank gathers the same logits
    assert block_verify.build(on, log()).fail_closed is True
    assert folded_fence.build(on, log()).fail_closed is True
    off = {"DSV41_DRAFT_HEAD_FP8": "0", "DSV41_BLOCK_VERIFY": "0", "DSV41_FOLDED_FENCE": "0"}
    assert all(m.build(off, log()) is None for m in (draft_head_fp8, block_verify, folded_fence))
    assert block_verify.build({"DSV41_BLOCK_VERIFY": "maybe"}, log()).detail.startswith(
        "refuses: DSV41_BLOCK_VERIFY='maybe': expected 1 or 0")


def test_block_verification_is_switched_on_in_the_constructors_arguments():
    adapter = block_verify.BlockVerify()
    obj = object()
    assert adapter.before_init(obj, target_worker=None, block_verification=False) == (
        (obj,), {"target_worker": None, "block_verification": True})
    with pytest.raises(Refused, match="the NPU rejection sampler has no block verification"):
        adapter.check_platform(SimpleNamespace(_is_npu=True))


# --- memory per rank -------------------------------------------------------------------------

def test_memory_from_the_models_shapes_beside_the_configuration_comments():
    s = decode_shapes.rank_shapes(tp=3)
    assert (s.local_groups, s.o_lora_rank, s.wo_a_in, s.vocab_per_rank, s.hidden) == (4, 1024, 4096, 43136, 5120)
    layer = decode_shapes.wo_a_layer(s)
    assert (layer.bf16, layer.codes, layer.scales) == (32 * MIB, 16 * MIB, 64 * 1024)
    w8 = decode_shapes.wo_a_delta(s, drop=False, draft=False)
    dropped = decode_shapes.wo_a_delta(s, drop=True, draft=False)
    assert w8.net == 40 * (16 * MIB + 64 * 1024)  # +642.5 MiB
    assert dropped.net == 40 * (16 * MIB + 64 * 1024 - 32 * MIB)  # -637.5 MiB; the comment: net -640 MB/rank
    assert abs(dropped.net / MIB + 640) < 3
    # The comment's +688 MiB for W8 alone is 43 layers' codes: the 40 target layers and the 3 draft stages.
    assert 43 * layer.codes == 688 * MIB
    assert decode_shapes.wo_a_delta(s, drop=False, draft=True).added == 43 * layer.fp8
    head = decode_shapes.draft_head_delta(s)
    assert head.released == 0 and head.added == 43136 * 5120 + 1348 * 160 * 4  # +211.4 MiB; comment: +210 MiB
    assert abs(head.added / MIB - 210) < 2
    assert decode_shapes.mib(-dropped.released) == "-1280.0 MiB"
