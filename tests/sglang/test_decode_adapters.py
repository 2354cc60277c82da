"""The decode adapters on SGLang 0.5.23's real DeepSeek-V4.1 and DSpark modules (CPU torch).

Each check script builds SGLang's own classes at small sizes and runs the code path the adapter
changes where it runs on CPU; Triton kernels (the adapters' W8A16 kernel, SGLang's rejection
sampler) run in Triton's interpreter. Runs without DSV41_SOURCE show SGLang's own behaviour.
"""

from __future__ import annotations

import pytest

from adapter.wo_a_w8 import serves_fp8
from tests.sglang.harness import Sglang, adapter_lines

pytestmark = pytest.mark.sglang

W8 = {"DSV41_WO_A_W8": "1"}
W8_ALL = {"DSV41_WO_A_W8": "1", "DSV41_WO_A_W8_MID": "1", "DSV41_WO_A_W8_DROP": "1", "DSV41_WO_A_W8_DRAFT": "1"}
BF16_ROUNDING = 2.0**-8  # relative error of a product rounded once to bf16
E4M3_ROUNDING = 2.0**-4  # relative error bound of one E4M3 rounding


def installed(stderr: str) -> list[str]:
    return [line.split()[1] for line in adapter_lines(stderr) if " installed (" in line]


@pytest.fixture(scope="module")
def wo_a(sglang: Sglang) -> dict:
    runs = {}
    for name, env in (("plain", None), ("w8", W8), ("all", W8_ALL)):
        result, err = sglang.check("chk_wo_a_w8", str(sglang.root / f"wo_a_{name}"), armed=env is not None, env=env)
        runs[name] = (result, err)
    return runs


def test_wo_a_unarmed_is_sglangs_own_path(wo_a) -> None:
    result, err = wo_a["plain"]
    assert result["marked_matmul"] is None and result["marked_post_load"] is None and "twinned" not in result
    assert all(c["same_as_sglang"] and not c["fp8"] for c in result["calls"])
    assert adapter_lines(err) == []


def test_wo_a_installs_on_the_real_modules(wo_a) -> None:
    for name, (result, err) in wo_a.items():
        if name == "plain":
            continue
        assert result["marked_matmul"] == "wo_a_w8" and result["marked_post_load"] == "wo_a_w8"
        # The draft's attention calls the same (hooked) function; its loader hook only with _DRAFT.
        assert result["draft_calls_the_hooked_function"] is True
        assert result["marked_draft_post_load"] == ("wo_a_w8" if name == "all" else None)
        assert installed(err).count("wo_a_w8") == 1
        assert result["twinned_again"] == 0  # a second post_load_weights twins nothing twice
    assert wo_a["w8"][0]["fail_closed"] is False and wo_a["all"][0]["fail_closed"] is True


def test_wo_a_twin_holds_the_checkpoints_values(wo_a) -> None:
    for name in ("w8", "all"):
        result, _ = wo_a[name]
        draft = name == "all"
        assert result["twinned"] == [True, True, True, draft]
        # Layers loaded from the checkpoint's fp8 + E8M0 tiles come back bit for bit; a bf16 weight no
        # tile holds (layer 2) within one E4M3 rounding per element.
        assert result["twin_exact"] == [True, True, False, True if draft else None]
        assert result["twin_within_e4m3"] == [True, True, True, True if draft else None]


def test_wo_a_drop_releases_the_bf16_weights(wo_a) -> None:
    kept, _ = wo_a["w8"]
    dropped, err = wo_a["all"]
    g, r, d = dropped["shape"]
    assert kept["weight_storage_bytes"] == [g * r * d * 2] * 4
    assert dropped["weight_storage_bytes"] == [2] * 4 and all(dropped["weight_shape_kept"])
    lines = [line for line in adapter_lines(err) if "layers twinned" in line]
    assert lines[0].startswith("dsv41-adapter: wo_a_w8: target: 3 layers twinned: fp8 +") and "bf16 -" in lines[0]
    assert lines[1].startswith("dsv41-adapter: wo_a_w8: draft: 1 layers twinned")


@pytest.mark.parametrize("name, mid, draft", [("w8", False, False), ("all", True, True)])
def test_wo_a_rows_are_served_as_configured_and_match_bf16(wo_a, name, mid, draft) -> None:
    result, _ = wo_a[name]
    for c in result["calls"]:
        twinned = c["layer"] < 3 or draft
        want = twinned and serves_fp8(c["rows"], decode=c["mode"] == "decode", verify=c["mode"] == "verify",
                                      prefill=c["mode"] == "prefill", mid=mid)
        assert c["fp8"] is want, c
        assert c["shape"] == [c["rows"], result["shape"][0], result["shape"][1]]
        exact_weights = c["layer"] != 2
        if not c["fp8"] and (exact_weights or name == "w8"):
            # SGLang's bf16 path: with DROP fed the twin dequantised, which is the loaded weight.
            assert c["same_as_sglang"], c
        if exact_weights:
            # The fp8 twin of a checkpoint layer differs from the float32 product only by the one
            # bf16 rounding of the output, as SGLang's own bf16 product does.
            assert c["rel_vs_float32"] <= BF16_ROUNDING and c["sglang_rel_vs_float32"] <= BF16_ROUNDING, c
        elif c["fp8"] or name == "all":
            # Within the fp8 block quantisation error of the bf16 projection, and visibly not exact.
            assert BF16_ROUNDING < c["rel_vs_float32"] <= E4M3_ROUNDING, c
    assert result["strided_rel"] <= BF16_ROUNDING


def test_wo_a_kernel_failure_falls_back_only_while_the_bf16_weight_is_kept(wo_a) -> None:
    assert wo_a["w8"][0]["after_kernel_failure"] == {"same_as_sglang": True, "kernel_failed": True}
    assert "dsv41-adapter: wo_a_w8: the fp8 kernel failed (RuntimeError: stand-in kernel failure); wo_a stays on " \
           "SGLang's bf16 path" in adapter_lines(wo_a["w8"][1])
    assert wo_a["all"][0]["after_kernel_failure"] == {"raised": "stand-in kernel failure"}


def test_wo_a_triton_kernel_matches_the_float32_product(wo_a) -> None:
    for name in ("w8", "all"):
        kernel = wo_a[name][0]["triton_max_rel_vs_float32"]
        assert set(kernel) == {"twin_6", "twin_24", "twin_100", "odd_7_strided"}
        assert all(v <= 1e-6 for v in kernel.values()), kernel


# --- draft_head_fp8 --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def head(sglang: Sglang) -> dict:
    runs = {}
    for name, env in (("plain", None), ("fp8", {"DSV41_DRAFT_HEAD_FP8": "1"}),
                      ("fp32", {"DSV41_DRAFT_HEAD_FP8": "1", "SGLANG_DSPARK_FP32_LM_HEAD": "1"})):
        runs[name] = sglang.check("chk_draft_head_fp8", str(sglang.root / f"head_{name}"), armed=env is not None,
                                  env=env)
    return runs


def test_draft_head_unarmed_is_sglangs_projection(head) -> None:
    result, err = head["plain"]
    assert result["marked_project"] is None and result["copy"] is None
    assert all(v["same_as_sglang"] and not v["fp8"] for v in result["logits"].values())
    assert adapter_lines(err) == []


def test_draft_head_projects_through_the_fp8_copy_within_its_quantisation_error(head) -> None:
    result, err = head["fp8"]
    assert result["marked_project"] == "draft_head_fp8" and result["marked_attach"] == "draft_head_fp8"
    assert result["draft_calls_the_hooked_function"] is True
    n, k = result["head_shape"]
    assert result["copy"] == {"shape": [1, n, k], "bytes": n * k + (n // 32) * (k // 32) * 4,
                              "dtype": "torch.float8_e4m3fn"}
    for rows, v in result["logits"].items():
        assert v["fp8"] and v["shape"][0] == int(rows)
        assert v["sglang_rel_vs_float32"] <= BF16_ROUNDING
        assert BF16_ROUNDING < v["rel_vs_float32"] <= E4M3_ROUNDING, v
    # The target's head is the same tensor with the same values: the target's logits are untouched.
    assert result["head_unchanged"] is True
    assert result["after_kernel_failure"] == {"same_as_sglang": True, "kernel_failed": True}
    line = next(line for line in adapter_lines(err) if "draft LM head" in line)
    assert line == f"dsv41-adapter: draft_head_fp8: draft LM head [{n} x {k}] per rank: fp8 copy +0.1 MiB; " \
                   "the target keeps the bf16 head"


def test_draft_head_stays_bf16_where_sglang_does_not_use_the_projection(head) -> None:
    result, err = head["fp32"]
    assert result["copy"] is None and not any(v["fp8"] for v in result["logits"].values())
    assert all(v["rel_vs_float32"] == 0.0 for v in result["logits"].values())  # SGLang's float32 projection
    assert "dsv41-adapter: draft_head_fp8: the draft keeps the bf16 head: SGLANG_DSPARK_FP32_LM_HEAD=1 projects the " \
           "draft in float32" in adapter_lines(err)


# --- verify_cap ------------------------------------------------------------------------------

CAP = {"DSV41_VERIFY_CAP": "conf:0.1"}
# chk_verify_cap's constructed confidences give k = 5, 3, 2, 1: live rows 1 + k.
LIVE = [6, 4, 3, 2]


@pytest.fixture(scope="module")
def cap(sglang: Sglang) -> dict:
    runs = {}
    for name, env, tp in (("plain", None, "1"), ("armed", CAP, "1"), ("tp3", CAP, "3")):
        runs[name] = sglang.check("chk_verify_cap", str(sglang.root / f"cap_{name}"), tp, armed=env is not None,
                                  env=env, timeout=600)
    return runs


def test_verify_cap_installs_on_the_real_modules(cap) -> None:
    result, err = cap["armed"]
    rank = result["ranks"][0]
    assert set(rank["marks"].values()) == {"verify_cap"} and rank["fail_closed"] is True
    assert rank["stride"] == 6 and rank["live_after_init"] == [6, 6, 6, 6]  # verify-all until a confidence
    assert installed(err).count("verify_cap") == 1
    plain = cap["plain"][0]["ranks"][0]
    assert set(plain["marks"].values()) == {None} and plain["confidence_head"] is None


def test_verify_cap_builds_the_confidence_head_in_static_mode(cap) -> None:
    result, err = cap["armed"]
    assert result["ranks"][0]["confidence_head"] == "DSparkConfidenceHead"
    assert "dsv41-adapter: verify_cap: built the draft's confidence head in the static verify mode (present)" \
        in adapter_lines(err)


def test_verify_cap_live_lengths_follow_the_rule_and_rank_0(cap) -> None:
    assert cap["armed"][0]["ranks"][0]["live"] == LIVE == cap["armed"][0]["ranks"][0]["own_rule"]
    ranks = cap["tp3"][0]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2]
    # Ranks 1 and 2 see request 2's running product a hair under T and would verify one draft less;
    # every rank uses rank 0's lengths.
    assert [r["own_rule"] for r in ranks] == [LIVE, [6, 4, 2, 2], [6, 4, 2, 2]]
    assert all(r["live"] == LIVE for r in ranks)


def test_verify_cap_accepts_and_rejects_exactly_as_its_rule_says(cap) -> None:
    plain = cap["plain"][0]["ranks"][0]
    armed = cap["armed"][0]["ranks"][0]
    predict = plain["eager"]["predict"]
    native = plain["eager"]["correct_len"]
    assert native == [5, 1, 5, 5]  # the target agrees with every draft but request 1's second
    want = [min(n, live - 1) for n, live in zip(native, LIVE)]
    assert want == [5, 1, 2, 1]
    for path in ("eager", "folded"):
        got = armed[path]
        assert got["correct_len"] == want, path
        # The bonus is the target's token at the row after the last accepted draft.
        assert got["bonus"] == [predict[r][c] for r, c in enumerate(want)], path
        assert plain[path]["correct_len"] == native
    assert armed["eager"]["cap_trim"] == [n - w for n, w in zip(native, want)]
    assert armed["folded"]["commit_lens"] == [w + 1 for w in want]
    # The fused accept tail never caps: SGLang serves it at TP 1, the cap takes the capped accept.
    assert plain["folded_serves_tail"] is True and armed["folded_serves_tail"] is False


def test_verify_cap_zeroes_the_dead_drafts_distributions(cap) -> None:
    armed = cap["armed"][0]["ranks"][0]["draft_probs"]
    assert armed["zero_rows"] == [list(range(live - 1, 5)) for live in LIVE]
    assert armed["live_rows_max_diff"] == 0.0
    assert cap["plain"][0]["ranks"][0]["draft_probs"]["zero_rows"] == [[], [], [], []]


def test_verify_cap_routes_dead_rows_like_their_anchor(cap) -> None:
    routing = cap["armed"][0]["ranks"][0]["routing"]
    outside = routing["outside"]
    for kind in ("hash", "grouped"):
        verify = routing["verify"][kind]
        for row, experts in enumerate(verify):
            request, position = divmod(row, 6)
            source = request * 6 if position >= LIVE[request] else row
            assert experts == outside[kind][source], (kind, row)
        # Dead rows exist in requests 1-3 and their experts differ from their own without the cap.
        assert verify != outside[kind]
        # Not a target verify, not the target, or not every row of the step: SGLang's routing.
        for other in ("decode", "draft_verify", "verify_odd_rows"):
            assert routing[other][kind] == outside[kind][: len(routing[other][kind])], other
        assert routing["verify_split_rows"][kind] == outside[kind][:18]
    assert routing["remapped_gates"] == 1 and routing["after_forward"] is True


# --- sampled accepts on constructed distributions ---------------------------------------------

CHI2_26_P001 = 54.05  # chi-square, 26 degrees of freedom, p = 0.001


@pytest.fixture(scope="module")
def sampled(sglang: Sglang) -> dict:
    out = {}
    for env, runs in (
        (None, ["uncut_block:block:none:1", "native_block:block:native:1", "native_token:token:native:1",
                "tau_unadapted:token:none:0.5"]),
        ({"DSV41_VERIFY_CAP": "conf:0.2"}, ["cap_block:block:adapter:1", "cap_token:token:adapter:1"]),
        ({"DSV41_DRAFT_TAU": "0.5"}, ["tau_token:token:none:0.5", "tau_block:block:none:0.5"]),
    ):
        result, _ = sglang.check("chk_sampled_accept", str(sglang.root / f"sampled_{len(out)}"), *runs,
                                 armed=env is not None, env=env, timeout=900)
        out.update(result)
    return out


def test_block_verification_is_lossless_on_constructed_distributions(sampled) -> None:
    assert sampled["uncut_block"]["chi_square"] < CHI2_26_P001
    assert sampled["uncut_block"]["lengths"][5] > 0  # whole blocks are accepted too


def test_capped_sampled_rows_stay_lossless_only_with_the_dead_drafts_zeroed(sampled) -> None:
    for name in ("cap_block", "cap_token"):
        run = sampled[name]
        assert run["chi_square"] < CHI2_26_P001, name
        assert run["lengths"][3:] == [0, 0, 0] and run["lengths"][2] > 0, name  # at most k = 2, and k reached
        assert run["cap_trimmed"] == 0, name  # q = 0 stops the kernel at k itself
    # SGLang's own cutoff after block verification lets the dead rows' garbage decide: not lossless.
    # (Token by token it is: the accept reads no row past k.)
    assert sampled["native_block"]["chi_square"] > 10 * CHI2_26_P001
    assert sampled["native_token"]["chi_square"] < CHI2_26_P001


def test_draft_tau_keeps_the_accept_lossless(sampled) -> None:
    assert sampled["tau_token"]["chi_square"] < CHI2_26_P001
    assert sampled["tau_block"]["chi_square"] < CHI2_26_P001
    # Drafts at 0.5 x T accepted against the request's temperature are not.
    assert sampled["tau_unadapted"]["chi_square"] > 2 * CHI2_26_P001


# --- block_verify, draft_tau, folded_fence -----------------------------------------------------

@pytest.fixture(scope="module")
def accept(sglang: Sglang) -> dict:
    env = {"DSV41_BLOCK_VERIFY": "1", "DSV41_DRAFT_TAU": "0.5", "DSV41_FOLDED_FENCE": "1"}
    return {"plain": sglang.check("chk_dspark_accept", str(sglang.root / "accept_plain"), armed=False),
            "armed": sglang.check("chk_dspark_accept", str(sglang.root / "accept_armed"), env=env)}


def test_block_verify_switches_dsparks_constructors(accept) -> None:
    plain, armed = accept["plain"][0]["block_verify"], accept["armed"][0]["block_verify"]
    assert (plain["executor"], plain["region"], plain["marked_executor"]) == (False, False, None)
    assert (armed["executor"], armed["region"], armed["marked_executor"]) == (True, True, "block_verify")
    # The executor's sampled accept is SGLang's block verification (same draws), not token by token.
    assert armed["executor_equals_block"] and not armed["executor_equals_token"] and armed["block_differs_from_token"]
    assert plain["executor_equals_token"] and not plain["executor_equals_block"]
    assert installed(accept["armed"][1]).count("block_verify") == 1


def test_draft_tau_scales_the_draft_temperature_only(accept) -> None:
    plain, armed = accept["plain"][0]["draft_tau"], accept["armed"][0]["draft_tau"]
    temps = [0.7, 1.0, 0.5, 0.9]
    assert armed["marked_resolve"] == "draft_tau" and plain["marked_resolve"] is None
    for key in ("eager", "staged"):
        # Sampled rows (top-k > 1) draft at 0.5 x T, greedy rows stay at 0; `temperatures` stays T.
        assert armed[f"{key}_step"] == pytest.approx([0.35, 0.0, 0.25, 0.0])
        assert plain[f"{key}_step"] == pytest.approx([0.7, 0.0, 0.5, 0.0])
        assert armed[f"{key}_temperatures"] == pytest.approx(temps) == plain[f"{key}_temperatures"]
    assert armed["draft_probs_temperature"] == [0.4] and plain["draft_probs_temperature"] == [0.8]
    assert armed["blockwise_equals_draft_temperature"] == {"0.4": True, "0.8": False}
    assert plain["blockwise_equals_draft_temperature"] == {"0.4": False, "0.8": True}


def test_folded_fence_returns_the_same_results_in_their_own_memory(accept) -> None:
    plain, armed = accept["plain"][0]["fence"], accept["armed"][0]["fence"]
    assert armed["marked_accept"] == "folded_fence" and plain["marked_accept"] is None
    assert armed["fields"] == ["correct_len", "bonus", "cap_trim_lens", "commit_lens", "new_seq_lens", "out_tokens"]
    # One stream: the fenced results equal the buffers the folded accept wrote (what SGLang returns).
    assert armed["equal_to_buffers"] and plain["equal_to_buffers"]
    # The next step's accept overwrites every buffer; only the fenced copies keep the step's results.
    assert all(armed["changed_by_next_step"]) and all(plain["changed_by_next_step"])
    assert all(armed["own_memory"]) and all(armed["kept_after_next_step"])
    assert not any(plain["own_memory"]) and not any(plain["kept_after_next_step"])


# --- the example configuration's decode block, every adapter at once ---------------------------

def rank_env(**changes) -> dict[str, str]:
    """The adapters' variables in the environment the coordinator renders for spark2's rank."""
    from adapter import boot
    from coordinator import config, plan
    from tests.configtext import HOME, SEED_TEXT, edited

    cfg = config.parse(edited(**changes) if changes else SEED_TEXT, "cluster.env", HOME)
    env = plan.render_node(cfg, "spark2").to_json()["env"]
    return {k: v for k, v in env.items() if k in boot.env_keys() and k != "DSV41_SOURCE"}


@pytest.mark.parametrize("mode", ["HookRegistry", "import hook"])
@pytest.mark.parametrize("changes", [{}, {"DSV41_WO_A_W8_DRAFT": "1", "DSV41_DRAFT_TAU": "0.8",
                                          "DSV41_FOLDED_FENCE": "1"}], ids=["example", "every-key-on"])
def test_the_decode_adapters_install_together(sglang: Sglang, changes, mode) -> None:
    env = rank_env(**changes)
    assert env["DSV41_VERIFY_CAP"] == "conf:0.1" and env["DSV41_WO_A_W8_DROP"] == "1"
    legacy = mode == "import hook"
    result, err = sglang.check("chk_decode_stack", *(["legacy"] if legacy else []), env=env, armed=not legacy)
    assert all(line.endswith(f"; via {mode})") for line in adapter_lines(err) if " installed (" in line)
    on = {"wo_a_w8", "draft_head_fp8", "verify_cap", "block_verify"} | ({"draft_tau", "folded_fence"} if changes else set())
    assert {a for a, v in result["on"].items() if v} == on
    assert not [line for line in adapter_lines(err) if "could not patch" in line or "stays out" in line
                or "does not start" in line]
    assert set(installed(err)) >= on and all(installed(err).count(a) == 1 for a in on)
    # Every hook of every adapter landed, including on the targets two adapters share.
    targets = result["targets"]
    assert result["not_applied"] == []
    verify = "sglang.srt.speculative.dspark_components.dspark_verify"
    assert targets[f"{verify}.TargetVerifyExecutor.__init__"] == ["block_verify", "verify_cap"]
    assert set(targets[f"{verify}._draft_probs"]) == ({"verify_cap", "draft_tau"} if changes else {"verify_cap"})
    if changes:
        assert targets[f"{verify}.TargetVerifyExecutor.accept_and_finalize"] == ["folded_fence"]
        assert "sglang.srt.models.deepseek_v4_dspark.DeepseekV4ForCausalLMDSpark.post_load_weights" in targets
    assert result["fail_closed"]["wo_a_w8"] is True and result["fail_closed"]["draft_head_fp8"] is False
