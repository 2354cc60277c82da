"""bench/decode_fp8 (bench/wo_a_fp8 and bench/draft_head_fp8) end to end on the CPU with tiny shapes,
in the cached venv's torch and triton (the GPU machine runs the same scripts on CUDA), with SGLang made
unimportable: every product is measured (SGLang's column is left out and says why), the adapters'
kernel (interpreted) equals the float32 product, the tile sweep (--quick --sweep, a few
configurations per row count on the CPU) times the adapter's choice and prints a launch table, and
the memory lines are the model's shapes at TP 3."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from adapter import decode_shapes as ds
from tests.sglang.harness import REPO, venv

pytestmark = pytest.mark.sglang
VARIANTS = {"bf16_einsum", "bf16_bmm", "fp8_w8a16", "dequant_bf16", "fp8_scaled_mm"}


def test_decode_fp8_benches_run_without_sglang_on_the_cpu(tmp_path) -> None:
    blocker = tmp_path / "sglang"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('the GPU benches must not import sglang')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSV41_", "PYTHON", "TRITON_"))}
    env["PYTHONPATH"] = str(tmp_path)
    done = subprocess.run([str(venv() / "bin" / "python"), str(REPO / "bench" / "decode_fp8"), "--device", "cpu",
                           "--quick", "--sweep"], capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp_path))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"bench"')]
    assert [r["bench"] for r in reports] == ["wo_a_fp8", "draft_head_fp8"]
    assert "FAILED" not in done.stdout
    wo_a, head = reports
    shapes = ds.rank_shapes(tp=3)

    assert wo_a["twin_exact"] is True and [r["rows"] for r in wo_a["results"]] == [1, 6, 24, 48]
    for row in wo_a["results"]:
        assert set(row["time_us"]) == VARIANTS and all(v is not None and v > 0 for v in row["time_us"].values()), row
        e = row["rel_error"]
        assert e["fp8_w8a16"] <= 1e-6  # the twin is exact and the interpreted kernel keeps float32
        assert e["bf16_einsum"] <= 2.0**-8 and e["dequant_bf16"] <= 2.0**-8
        assert 2.0**-8 < e["fp8_scaled_mm"] <= 2.0**-4  # W8A8: the activation's E4M3 rounding
    one = ds.wo_a_layer(shapes)
    assert wo_a["memory"]["W8"] == {"added": 40 * one.fp8, "released": 0, "net": 40 * one.fp8}
    assert wo_a["memory"]["W8+DROP"]["net"] == 40 * (one.fp8 - one.bf16)
    assert "W8+DROP        +  642.5 MiB twins, - 1280.0 MiB bf16, net -637.5 MiB" in done.stdout

    assert [r["rows"] for r in head["results"]] == [5, 20]
    for row in head["results"]:
        assert set(row["time_us"]) == VARIANTS and all(v is not None and v > 0 for v in row["time_us"].values()), row
        assert 2.0**-8 < row["rel_error"]["fp8_w8a16"] <= 2.0**-4  # a bf16 head: one E4M3 rounding
        assert 0.0 <= row["argmax_agrees"]["fp8_w8a16"] <= 1.0
    assert head["memory"]["net"] == ds.draft_head(shapes).fp8

    # SGLang's own block-fp8 column needs SGLang (and CUDA): left out, with the reason printed.
    assert wo_a["sglang"] is None and head["sglang"] is None
    assert done.stdout.count("sglang_w8a8_block: not measured (") == 2
    # The sweep: every row count has the adapter's choice timed, a best, and a table entry per bucket.
    for report, table in ((wo_a, "NARROW"), (head, "NARROW")):
        sweep = report["sweep"]
        assert sweep["table"] == table and sweep["failed"] == {} and sweep["skipped"] == 0
        for row in report["results"]:
            timed = {c: v for c, v in row["tile_sweep_us"].items() if isinstance(v, float)}
            assert row["adapter_tiles"] in timed and row["sweep_best"] in timed and len(timed) >= 2, row
        assert [e[0] for e in sweep["entries"]][-1] == 1 << 30
    assert [e[0] for e in wo_a["sweep"]["entries"]] == [1, 8, 32, 1 << 30]
    assert done.stdout.count("ready to paste into adapter/fp8_gemm.py:") == 2
    assert "NARROW = (\n    (1, Tiles(" in done.stdout
    assert "the fp8 copy adds 210.6 MiB codes + 842 KiB scales = +211.4 MiB" in done.stdout
