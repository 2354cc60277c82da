"""bench/engram_lookup end to end on the CPU with tiny sizes, in the cached venv's torch (the GPU
machine runs the same script on CUDA): every arm is measured and its rows equal the resident
table's bit for bit."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.sglang.harness import REPO, venv

pytestmark = pytest.mark.sglang


def test_bench_runs_every_arm_on_the_cpu(tmp_path) -> None:
    cmd = [str(venv() / "bin" / "python"), str(REPO / "bench" / "engram_lookup"), "--device", "cpu",
           "--dir", str(tmp_path), "--rows", "30001", "--steps", "2", "--requests", "1,4", "--chunk", "32",
           "--layer-ms", "0.1", "--prefill-ms", "2", "--prefill-layer-ms", "0.1", "--io-threads", "4",
           "--fio-seconds", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "rows equal the resident table's bit for bit: yes" in out
    assert re.search(r"^  +1 +144 ", out, re.M) and re.search(r"^  +4 +576 ", out, re.M), out
    assert re.search(r"^goal: prefetch exposed <= 0.5 ms per decode step .* -> (met|NOT met) \(", out, re.M)
    report = json.loads(out.strip().splitlines()[-1])
    assert report["outputs_equal_resident"] is True and report["device"] == "cpu"
    arms = {"resident_warm", "sync_cold", "sync_warm", "prefetch_cold", "prefetch_warm"}
    assert [row["requests"] for row in report["decode"]] == [1, 4]
    assert all(arms <= set(row) for row in report["decode"])
    assert {"resident_warm", "sync_cold", "staged_cold", "staged_warm"} <= set(report["prefill"])
    assert report["prefill"]["ids_per_layer"] == 32 * 24
    assert report["cuda_graph"] == {"error": "no CUDA"} and set(report["busy_python_thread"]) == {"5 ms", "0.5 ms"}
    assert not list(tmp_path.iterdir())  # the packs are removed
