"""The adapters' W8A16 kernel and fp8 dequantisation (adapter/fp8_gemm.py) in Triton's interpreter,
in the cached venv's torch and triton (checks/chk_fp8_gemm.py): every launch path equals the float32
product of the dequantised weight up to summation order, and the launch tables are well formed."""

from __future__ import annotations

import pytest

from tests.sglang.harness import Sglang

pytestmark = pytest.mark.sglang

FLOAT32_ORDER = 1e-6  # float32 sums of exact products, in another order
BF16_STORE = 2.0**-7  # one bf16 rounding (truncation in the interpreter) of the largest output


@pytest.fixture(scope="module")
def facts(sglang: Sglang) -> dict:
    result, _ = sglang.check("chk_fp8_gemm", armed=False, timeout=600)
    return result


def test_every_launch_path_matches_the_float32_product(facts) -> None:
    cases = facts["max_rel_vs_float32"]
    assert {f"dot_split{s}_m5_n80_k256" for s in (1, 2, 3, 4, 8)} <= set(cases)
    assert {"dot_m1", "gemv_m1", "gemv_m1_split4", "dot_m33_bm32_n40", "gemv_m9_bm8_k200",
            "head_default_5", "narrow_default_100", "wide_table_64"} <= set(cases)
    assert all(v <= FLOAT32_ORDER for v in cases.values()), cases


def test_the_bf16_output_is_rounded_once_and_split_k_is_deterministic(facts) -> None:
    out = facts["bf16_out"]
    assert out["dtype"] == "torch.bfloat16" and out["shape"] == [6, 4, 64]
    assert out["max_rel"] <= BF16_STORE and out["deterministic"] is True
    assert facts["empty_rows"] == [0, 4, 64]
    assert facts["linear_cpu_is_reference"] is True


def test_launch_tables(facts) -> None:
    """Well formed, whatever the entries (bench/decode_fp8 --sweep prints replacements)."""
    assert facts["classes"] == {"wo_a": "narrow", "head": "wide"}
    for name, table in facts["tables"].items():
        bounds = [most for most, _ in table]
        assert bounds == sorted(set(bounds)) and bounds[-1] == 1 << 30, name
        # tiles_for picks the first entry whose bound holds the rows.
        shape = "wo_a" if name == "narrow" else "head"
        for rows in (1, 6, 16, 17, 32, 64, 192, 768):
            want = next(label for most, label in table if rows <= most)
            assert facts["tiles_for"][f"{shape}_{rows}"] == want, (name, rows)
    assert facts["split_range"] == {"4096_128_8": [512, 8], "4096_128_16": [256, 16], "256_64_3": [128, 2],
                                    "200_128_2": [128, 2], "5120_128_1": [5120, 1], "256_128_8": [128, 2]}
    refused = facts["refused"]
    assert all(refused.values()), refused
    assert "power of two" in refused["block_m_3"] and "does not fit" in refused["wrong_k"]


def test_the_triton_dequantisation_gives_the_same_values(facts) -> None:
    same = facts["dequant_same"]
    assert len(same) == 8 and all(same.values()), same
