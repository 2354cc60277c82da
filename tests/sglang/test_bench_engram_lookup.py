"""bench/engram_lookup end to end on the CPU with tiny sizes, in the cached venv's torch (the GPU
machine runs the same script on CUDA): every arm of both readers is measured and their rows equal
the resident table's bit for bit; without a compiler it measures the Python path and fails."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from tests.sglang.harness import REPO, venv

pytestmark = pytest.mark.sglang


def run_bench(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [str(venv() / "bin" / "python"), str(REPO / "bench" / "engram_lookup"), "--device", "cpu",
           "--dir", str(tmp_path), "--rows", "30001", "--steps", "2", "--chunk", "32", "--layer-ms", "0.1",
           "--prefill-ms", "2", "--prefill-layer-ms", "0.1", "--io-threads", "4", "--busy-seconds", "5", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_bench_runs_every_arm_of_both_readers_on_the_cpu(tmp_path) -> None:
    done = run_bench(tmp_path, "--quick")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert re.search(r"^native Engram row reader ready in [0-9.]+ s \(.*/torch_extensions/dsv41_engram_reader-[0-9a-f]{16}/", out, re.M), out
    assert "rows equal the resident table's bit for bit: python yes, native yes" in out
    for reader in ("python", "native"):
        assert re.search(rf"^ +{reader} +1 +144 ", out, re.M) and re.search(rf"^ +{reader} +4 +576 ", out, re.M), out
        assert re.search(rf"^goal: prefetch exposed <= 0.5 ms per decode step, {reader} reader .* -> (met|NOT met) \(", out, re.M)
    report = json.loads(out.strip().splitlines()[-1])
    assert report["quick"] is True and report["device"] == "cpu" and report["native_build"]["ok"] is True
    assert report["outputs_equal_resident"] == {"python": True, "native": True}
    arms = {"sync_cold", "sync_warm", "prefetch_cold", "prefetch_warm"}
    assert [row["requests"] for row in report["decode"]] == [1, 4]  # --quick's batch sizes
    for row in report["decode"]:
        assert "resident_warm" in row and set(row["python"]) == set(row["native"]) == arms
        assert all(v["steps"] == 2 for v in row["native"].values())
    prefill = report["prefill"]
    assert "resident_warm" in prefill and prefill["ids_per_layer"] == 32 * 24
    assert set(prefill["python"]) == set(prefill["native"]) == {"sync_cold", "sync_warm", "staged_cold", "staged_warm"}
    assert all(v["steps"] == 3 for v in prefill["native"].values())  # --quick: 3 chunks
    assert report["cuda_graph"] == {"python": {"error": "no CUDA"}, "native": {"error": "no CUDA"}}
    busy = report["busy_python_thread"]
    assert set(busy) == {"python", "native"} and all(set(b) == {"5 ms", "0.5 ms"} for b in busy.values())
    assert set(busy["native"]["5 ms"]) == {"no_lookup_step_ms", "sync_warm", "prefetch_warm", "staged_warm"}
    assert "staged_warm" not in busy["python"]["5 ms"] and busy["python"]["0.5 ms"]["staged_warm"]["steps"] == 1
    assert not list(tmp_path.iterdir())  # the packs and the build are removed


def test_bench_without_a_compiler_says_so_and_fails(tmp_path) -> None:
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler")}
    cmd = [str(venv() / "bin" / "python"), str(REPO / "bench" / "engram_lookup"), "--device", "cpu",
           "--dir", str(tmp_path), "--rows", "3001", "--steps", "1", "--requests", "1", "--chunk", "8",
           "--layer-ms", "0", "--prefill-ms", "0", "--prefill-layer-ms", "0", "--io-threads", "2",
           "--busy-seconds", "1", "--fio-seconds", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert re.search(r"^native Engram row reader unavailable \(.+\); rows are read by the Python path", done.stdout, re.M)
    assert "native reader: NOT built; only the Python path is measured" in done.stdout
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["native_build"]["ok"] is False and report["outputs_equal_resident"] == {"python": True}
