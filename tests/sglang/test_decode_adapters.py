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


def test_wo_a_triton_kernel_matches_the_float32_product(wo_a) -> None:
    for name in ("w8", "all"):
        kernel = wo_a[name][0]["triton_max_rel_vs_float32"]
        assert set(kernel) == {"twin_6", "twin_24", "twin_100", "odd_7_strided"}
        assert all(v <= 1e-6 for v in kernel.values()), kernel
