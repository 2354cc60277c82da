"""The adapters installed onto the real sglang 0.5.23 modules (CPU torch) and exercised there.

Each check runs in a fresh venv interpreter that reaches the adapter the way a rank does (its
PYTHONPATH entry: sitecustomize.py, adapter/, dsv41_adapter.dist-info). Running the same check
without DSV41_SOURCE shows SGLang's own behaviour, so every test compares the two.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.sglang.harness import CHECKS, Sglang, adapter_lines

pytestmark = pytest.mark.sglang

EVERY_ADAPTER = [
    "admission_gate",
    "tp3_pad",
    "mxfp8_b12x",
    "autotune_keep",
    "prefill_empty_cache",
    "loop_abort",
    "max_new_tokens",
    "reasoning_effort",
    "inflight",
    "api_key",
    "engram_offload",
    "forward_progress",
    "wo_a_w8",
    "draft_head_fp8",
    "verify_cap",
    "block_verify",
    "draft_tau",
    "folded_fence",
]


def installed(stderr: str) -> list[str]:
    return [line.split()[1] for line in adapter_lines(stderr) if " installed (" in line]


def test_unarmed_rank_is_untouched(sglang: Sglang) -> None:
    result, err = sglang.check("chk_loop_abort", armed=False)
    assert result["armed"] is False and result["marked"] is None
    assert result["same_token"] == {"finished_at": None, "reason": None}
    assert adapter_lines(err) == []


def test_loop_abort_on_req_update_finish_state(sglang: Sglang) -> None:
    result, err = sglang.check("chk_loop_abort")
    assert result["mode"] == "HookRegistry" and result["marked"] == "loop_abort"
    assert result["same_token"] == {"finished_at": 64, "reason": {"type": "stop", "matched": "loop abort (same_token: token 5 x64)"}}
    assert result["lines"]["reason"]["type"] == "stop" and result["lines"]["reason"]["matched"].startswith("loop abort (lines")
    assert result["lines"]["finished_at"] == 2 + 8 * 8  # "Hello \n" + eight 8-token lines
    assert result["block"]["reason"]["matched"] == "loop abort (ngram: 42-token block x4)"
    assert result["table"] == {"finished_at": None, "reason": None}
    assert result["ignore_eos"] == {"finished_at": None, "reason": None}
    assert result["length_still_wins"]["reason"] == {"type": "length", "length": 30}
    assert installed(err).count("loop_abort") == 1


def test_max_new_tokens_and_reasoning_effort_on_chat_serving(sglang: Sglang) -> None:
    armed, err = sglang.check("chk_requests")
    plain, _ = sglang.check("chk_requests", armed=False)
    assert armed["marked_convert"] == "max_new_tokens" and armed["marked_encode"] == "reasoning_effort"
    # max_tokens: filled when omitted, clamped when larger, kept when smaller; SGLang fills nothing.
    assert armed["omitted"] == [32768, None] and plain["omitted"] == [None, None]
    assert armed["small"] == [None, 100]
    assert armed["large_completion"] == [32768, None] and plain["large_completion"] == [500_000, None]
    assert armed["large_both"] == [32768, 32768]
    # Named tiers become the publisher's budgets; without the adapter they go to recipe by name.
    budgets = {k: armed[f"tier_{k}"]["effort_budget"] for k in ("low", "high", "xhigh", "max")}
    assert budgets == {"low": 50, "high": 75, "xhigh": 88, "max": 100}
    assert plain["tier_high"] == {"effort_budget": None, "named": "high"}
    assert armed["float"]["effort_budget"] == 30 and armed["integer_string"]["effort_budget"] == 60
    assert armed["none_uses_default"]["effort_budget"] == 75
    assert armed["v4_keeps_tiers"] == {"effort_budget": None, "named": "high"}
    assert armed["openai_float"]["effort_budget"] == 42 and armed["openai_tier"]["effort_budget"] == 50
    assert armed["template_kwargs"]["effort_budget"] == 33
    assert {"max_new_tokens", "reasoning_effort"} <= set(installed(err))


def test_prefill_empty_cache_and_autotune_on_the_scheduler(sglang: Sglang) -> None:
    armed, _ = sglang.check("chk_scheduler")
    plain, _ = sglang.check("chk_scheduler", armed=False)
    assert "prefill_empty_cache" in armed["marked"] and armed["marked_autotune"] == "autotune_keep"
    assert "prefill_empty_cache" not in plain["marked"]
    assert (armed["long_prefill_chunk"], armed["mixed_batch"], armed["after_the_last_long_chunk"],
            armed["short_prefill"], armed["decode"]) == (1, 1, 1, 0, 0)
    assert (plain["long_prefill_chunk"], plain["mixed_batch"]) == (0, 0)
    threshold, _ = sglang.check("chk_scheduler", env={"DSV41_PREFILL_EMPTY_CACHE_TOKENS": "50000"})
    assert threshold["long_prefill_chunk"] == 0


def test_admission_gate_refuses_with_sglangs_own_result_on_the_real_prefill_adder(sglang: Sglang) -> None:
    # a guard no node can keep: every first step is held, alone too until its wait is over
    gate = {"DSV41_ADMISSION_GUARD_BYTES": str(1 << 50), "DSV41_ADMISSION_TOKEN_BYTES": "16384",
            "DSV41_ADMISSION_TRANSIENT_BYTES": "4"}
    armed, err = sglang.check("chk_admission_gate", env=gate)
    assert armed["marked_prefill"] == ["admission_gate"] and armed["marked_add_one_req"] == ["admission_gate"]
    assert (armed["busy"], armed["idle"], armed["waited"], armed["refusals"]) == ("OTHER", "OTHER", "SGLang's body", 2)
    # the step sized from SGLang's own Req fields: the chunk's 768 of the 1000 tokens past the cached prefix
    assert "admission_gate: request hit waits: its first step (768 tokens over a 60000-token prefix" in err
    plain, _ = sglang.check("chk_admission_gate")  # not asked for: SGLang's body both times
    assert plain["marked_add_one_req"] == [] and (plain["busy"], plain["idle"], plain["waited"]) == ("SGLang's body",) * 3


def test_admission_gate_ranks_agree_on_the_smallest_headroom_over_a_real_gloo_group(sglang: Sglang) -> None:
    result, _ = sglang.check("chk_admission_collective")
    assert result["minimum"] == [[150_000_001, 0]] * 3 and result["single"] == [42, 1]


def test_forward_progress_counts_every_run_batch_of_the_real_scheduler(sglang: Sglang, tmp_path: Path) -> None:
    (tmp_path / "armed").mkdir()
    (tmp_path / "plain").mkdir()
    armed, err = sglang.check("chk_progress", env={"DSV41_PROGRESS_DIR": str(tmp_path / "armed")})
    plain, _ = sglang.check("chk_progress", armed=False, env={"DSV41_PROGRESS_DIR": str(tmp_path / "plain")})
    assert "forward_progress" in armed["marked"] and armed["installed"] is True
    assert armed["counts"] == {"2": 3} and armed["pids"] == [True]  # TP rank 2, three forward steps
    assert plain["counts"] == {} and plain["marked"] == []
    assert installed(err).count("forward_progress") == 1


def test_mxfp8_routing_and_scale_repair(sglang: Sglang) -> None:
    armed, err = sglang.check("chk_mxfp8")
    plain, _ = sglang.check("chk_mxfp8", armed=False)
    assert armed["routed_type"] == "ShapeRoutedLinear" and plain["routed_type"] == "partial"
    assert (armed["preferred_backend"], armed["fallback_backend"]) == ("b12x", "cutlass")
    assert armed["triton_backend_untouched"] == "function"
    routes = armed["routes"]
    # First call of a shape runs both; then the proven kernel alone, or the fallback alone.
    assert routes["64"][0]["calls"] == ["preferred", "fallback"] and routes["64"][1]["calls"] == ["preferred"]
    assert routes["96"][1]["calls"] == ["fallback"] and routes["128"][1]["calls"] == ["fallback"]
    assert all(call["exact"] for shape in routes.values() for call in shape)
    assert armed["decisions"] == ["128:fallback", "64:preferred", "96:fallback"]
    assert sum("stays on SGLang's kernel" in line for line in adapter_lines(err)) == 2
    # Zero-scale padding: SGLang alone leaves the layer on Triton; repaired it converts.
    assert plain["padded_layer"]["ready"] is False
    assert armed["padded_layer"] == {"ready": True, "e8m0_rows": [96, 2], "scales": [[0.5, 0.5], [0.5, 0.5], [1.0, 1.0]]}
    assert armed["broken_checkpoint"]["ready"] is False and armed["broken_checkpoint"]["scales"][0][0] == 0.0
    cutlass, _ = sglang.check("chk_mxfp8", env={"DSV41_MXFP8_BACKEND": "cutlass"})
    assert cutlass["routed_type"] == "partial" and cutlass["padded_layer"]["ready"] is True


def test_tp3_pad_config_and_loaders(sglang: Sglang) -> None:
    armed, err = sglang.check("chk_tp3_pad", str(sglang.root / "model-armed"))
    plain, _ = sglang.check("chk_tp3_pad", str(sglang.root / "model-plain"), armed=False)
    assert set(armed["marked"].values()) == {"tp3_pad"}
    assert armed["tp3"]["heads"] == armed["tp3"]["hf_heads"] == 96 and armed["tp3"]["groups"] == 12
    assert armed["tp3"]["draft_experts"] == 129 and armed["tp3"]["plan"]["padded_vocab"] == 129_408
    assert armed["tp4"] == {"heads": 64, "hf_heads": 64, "groups": 8, "draft_experts": 128, "plan": None}
    assert plain["tp3"]["heads"] == 64 and plain["tp3"]["plan"] is None
    loaded = armed["loaded"]
    assert loaded["wq_b_rank0_is_checkpoint_heads_0_31"] and loaded["wq_b_rank2_all_zero"]
    assert loaded["scale_rank1_is_checkpoint"] and loaded["scale_rank2_values"] == [1.0]
    assert loaded["wo_b_rank1_is_groups_4_7"] and loaded["wo_b_rank2_all_zero"]
    assert loaded["sink_head_64_on_zero"] and loaded["router_bias_padding"] <= -1e8
    assert loaded["unexplained_mismatch"] == "error: AssertionError"
    # Without the adapter SGLang cannot load the checkpoint into a TP3 split at all.
    assert plain["loaded"]["wq_b_rank2_all_zero"] == "error: RuntimeError"
    assert plain["loaded"]["sink_head_64_on_zero"] == "error: AssertionError"
    assert any("tp3_pad: model padded: tp=3, heads 64->96" in line for line in adapter_lines(err))


@pytest.mark.parametrize("tp", [3, 4])
def test_tp_padding_is_exact_across_processes(sglang: Sglang, tp: int) -> None:
    result, _ = sglang.check("chk_tp_exactness", str(tp), str(sglang.root / f"exact{tp}"), armed=False)
    for name, err in result["errors"].items():
        assert err["max_abs"] <= 1e-12 * max(1.0, err["ref_max"]), (name, err)
    assert result["errors"]["logits"]["shape"] == [5, 129_280]
    ranks = result["ranks"]
    assert all(r["scales_positive"] and not r["padded_expert_chosen"] for r in ranks)
    if tp == 3:
        assert [r["local_heads"] for r in ranks] == [32, 32, 32]
        assert [r["padded_heads"] for r in ranks] == [0, 0, 32]
        assert ranks[2]["padded_heads_attend"] is True  # exact because of the zero blocks, not by luck
    else:
        assert [r["padded_heads"] for r in ranks] == [0] * 4 and not result["plan"]["padded_vocab"] - 129_280


def test_tp_padding_negative_control(sglang: Sglang) -> None:
    result, _ = sglang.check("chk_tp_exactness", "3", str(sglang.root / "leaky"), "leaky", armed=False)
    assert result["errors"]["attn"]["max_abs"] > 0.1


def test_inflight_route_on_the_http_server(sglang: Sglang) -> None:
    result, _ = sglang.check("chk_inflight")
    assert result["routes"] == ["/dsv41/inflight"] and result["marked_send_one"] == "inflight"
    assert result["before_start"][0] == 503
    assert result["status"] == 200
    body = result["body"]
    assert body["source"] == "tokenizer_manager"
    assert [(r["rid"], r["prompt_tokens"], r["prefilled_tokens"]) for r in body["requests"]] == [
        ("long-1", 150_000, 0),
        ("chat-2", 900, 900),
    ]
    ages = [r["age_s"] for r in body["requests"]]
    assert 30.0 <= ages[0] < 60.0 and 2.0 <= ages[1] < 30.0
    plain, _ = sglang.check("chk_inflight", armed=False)
    assert plain["routes"] == [] and plain["status"] == 404


def test_plugin_entry_point_alone_arms_the_adapter(sglang: Sglang) -> None:
    result, err = sglang.check("chk_plugin", sitecustomize=False)
    assert result["entry_points"] == ["dsv41=adapter.plugin:load"]
    assert result["armed_before_load_plugins"] is False
    assert result["armed"] is True and result["mode"] == "HookRegistry" and result["marked"] == "loop_abort"
    unarmed, _ = sglang.check("chk_plugin", sitecustomize=False, armed=False)
    assert unarmed["armed"] is False and unarmed["marked"] is None


def test_own_wrappers_and_changed_targets(sglang: Sglang) -> None:
    result, _ = sglang.check("chk_legacy", armed=False)
    assert result["mode"] == "import hook" and result["marked"] == "loop_abort" and result["has_wrapped"]
    assert result["finished_at"] == 64 and result["reason"]["type"] == "stop"
    log = result["log"]
    assert any("changed could not patch" in line and "parameters accepted_ids are gone" in line for line in log)
    assert any("missing could not patch" in line and "has no Req.update_finish_state_v2" in line for line in log)


def test_one_installed_line_per_adapter_in_the_http_process(sglang: Sglang) -> None:
    # The HTTP server process imports every patched module family; each adapter says so once.
    _, err = sglang.check("chk_inflight")
    names = installed(err)
    assert sorted(names) == sorted(set(names))
    assert {"inflight", "max_new_tokens", "loop_abort", "tp3_pad"} <= set(names) <= set(EVERY_ADAPTER)


API_KEY = "sglang-K3y_from-the-file"


def api_key_file(sglang: Sglang, name: str, content: str = API_KEY + "\n", mode: int = 0o600) -> str:
    path = Path(sglang.root) / name
    path.write_text(content)
    path.chmod(mode)
    return str(path)


def test_api_key_from_the_file_reaches_sglangs_middleware_and_never_its_log(sglang: Sglang) -> None:
    path = api_key_file(sglang, "api-key")
    armed, err = sglang.check("chk_api_key", env={"DSV41_API_KEY_FILE": path})
    assert armed["on"] and armed["marked_prepare"] == armed["marked_logging"] == "api_key"
    assert armed["parsed_is_key"] and armed["resolved_is_key"] and armed["serving_is_key"]
    assert (armed["http_without_key"], armed["http_wrong_key"], armed["http_with_key"]) == (401, 401, 200)
    assert armed["logged"] and not armed["logged_key"] and armed["logged_api_key_field"] == "'<redacted>'"
    assert armed["log_lines"] >= 1 and armed["log_lines_redacted"]  # SGLang logs server_args only through it
    assert armed["marked_dump"] == ["api_key", "api_key"]
    assert armed["dump_config_written"] and not armed["dump_has_key"]  # a crash dump carries no key
    assert API_KEY not in err
    assert f"dsv41-adapter: api_key: the HTTP API requires the key read from DSV41_API_KEY_FILE={path}" in err
    assert "api_key" in installed(err)
    # Without the variable SGLang serves without a key; given in argv, SGLang alone logs it.
    plain, _ = sglang.check("chk_api_key")
    assert plain["parsed_is_none"] and plain["serving_is_none"] and not plain["on"]
    assert plain["http_without_key"] == 200 and plain["logged_api_key_field"] == "None"
    leaky, _ = sglang.check("chk_api_key", "--api-key", API_KEY, armed=False)
    assert leaky["logged_key"] is True and leaky["logged_api_key_field"] == "the key"
    assert leaky["http_without_key"] == 401
    assert leaky["dump_has_key"] is True  # SGLang alone pickles the key into a crash dump


def refused(sglang: Sglang, env: dict[str, str], *args: str) -> tuple[int, str, str]:
    done = subprocess.run([str(sglang.python), str(CHECKS / "chk_api_key.py"), *args], capture_output=True,
                          text=True, timeout=300, env=sglang.env(True, env), cwd=str(sglang.root))
    lines = done.stderr.strip().splitlines()
    return done.returncode, done.stdout, lines[-1] if lines else ""


@pytest.mark.parametrize(
    "case",
    ["group_readable", "missing", "empty", "two_lines", "non_ascii", "key_in_argv"],
)
def test_api_key_refusals_stop_the_rank_in_prepare_server_args(sglang: Sglang, case: str) -> None:
    path = str(Path(sglang.root) / f"key-{case}")
    args: tuple[str, ...] = ()
    if case == "group_readable":
        api_key_file(sglang, f"key-{case}", mode=0o640)
        what = "mode 0640 lets group or other read the key; it must be 0600"
    elif case == "missing":
        what = "no such file"
    elif case == "empty":
        api_key_file(sglang, f"key-{case}", content="")
        what = "empty (it must hold the key on one line)"
    elif case == "two_lines":
        api_key_file(sglang, f"key-{case}", content=API_KEY + "\n" + API_KEY + "\n")
        what = "more than one line"
    elif case == "non_ascii":
        api_key_file(sglang, f"key-{case}", content="sglang-K\u00e9y-from-the-file\n")
        what = "not ASCII"
    else:
        api_key_file(sglang, f"key-{case}")
        args = ("--api-key", "argv-key-0123456")
        what = "visible to every local user in ps"
    status, stdout, last = refused(sglang, {"DSV41_API_KEY_FILE": path}, *args)
    assert status == 1 and stdout == ""  # SGLang never got past parsing its argv
    assert last.startswith("dsv41-adapter: api_key: ") and last.endswith("; the rank does not start")
    assert what in last and (case == "key_in_argv" or f"DSV41_API_KEY_FILE={path}: " in last)
    assert API_KEY not in last and "argv-key-0123456" not in last


def test_the_scheduler_publishes_its_requests_from_the_real_get_next_batch_to_run(sglang: Sglang,
                                                                                tmp_path: Path) -> None:
    (tmp_path / "armed").mkdir()
    (tmp_path / "plain").mkdir()
    armed, err = sglang.check("chk_scheduler_requests", env={"DSV41_PROGRESS_DIR": str(tmp_path / "armed")})
    plain, _ = sglang.check("chk_scheduler_requests", armed=False, env={"DSV41_PROGRESS_DIR": str(tmp_path / "plain")})
    assert armed["error"] is None and armed["plan_is_sglangs"] and armed["marked"] == "inflight"
    assert armed["installed"] and armed["writer_is_this_process"]
    # the chunked request grows by its 768-token chunk; behind it job-10 waits with the tree's
    # whole 12000-token prefix matched, job-11 with the 5000 it shares, job-12 with none: listed
    # as prefilled and cached, holding nothing of their own
    assert armed["records"] == [["job-1", "prefilling", 30_000, 6144, 768], ["job-10", "waiting", 20_000, 12_000, 0],
                                ["job-11", "waiting", 6000, 5000, 0], ["job-12", "waiting", 3000, 0, 0]]
    assert armed["cached"] == [0, 12_000, 5000, 0]
    # the KV pool's slots in use from SGLang's own allocators: 7044 taken, 1000 freed; a fresh paged one
    assert armed["kv_in_use"] == [7044, 6044, 0]
    assert armed["waiting_prefix_lens"] == [0, 0, 0] and armed["tree_still_matches"] == 12_000
    assert "prefix-cache match failed" not in err
    # listed before its launch; marked launched once SGLang's run_batch returned
    assert armed["launch_error"] is None and not armed["launched_before_run_batch"] and armed["launched_after_run_batch"]
    assert plain["error"] is None and plain["records"] is None and plain["marked"] is None
    assert installed(err).count("inflight") == 1


def test_drain_refuses_new_requests_on_the_http_server_behind_sglangs_api_key(sglang: Sglang) -> None:
    result, err = sglang.check("chk_drain")
    assert result["routes"] == ["/dsv41/drain"]
    assert result["post_without_key"]["status"] == 401 and result["chat_without_key"]["status"] == 401
    assert result["post"]["status"] == 200 and json.loads(result["post"]["body"])["draining"] is True
    assert result["bad_post"]["status"] == 400
    for name in ("chat", "generate"):
        refused = result[name]
        assert refused["status"] == 503 and refused["retry_after"] == "60", (name, refused)
        assert "draining for a restart: dsv41ctl restart --drain" in json.loads(refused["body"])["error"]["message"]
    assert json.loads(result["get"]["body"])["reason"] == "dsv41ctl restart --drain"
    assert json.loads(result["delete"]["body"]) == {"draining": False}
    assert result["chat_after"]["status"] != 503  # on to SGLang's own route (no engine here to answer it)
    assert "dsv41-adapter: drain: refusing new requests: dsv41ctl restart --drain" in err
