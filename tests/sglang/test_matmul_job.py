"""The pre-launch matrix-product check's job (adapter/matmul_check.py) for real, with the SGLang
environment's CPU torch, as the agent runs it in a rank's runtime."""

from __future__ import annotations

import subprocess

import pytest

from dsv41.matmul import parse_result, tflops
from tests.sglang.harness import REPO, venv

pytestmark = pytest.mark.sglang


def run_job(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv() / "bin" / "python"), "-m", "adapter.matmul_check", *flags], cwd=REPO,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin"}, capture_output=True, text=True, timeout=120)


def test_the_job_times_the_product_on_the_cpu_and_prints_one_line():
    done = run_job("--size", "256", "--iterations", "4")
    assert done.returncode == 0, done.stderr[-2000:]
    result = parse_result(done.stdout)
    assert (result.device, result.dtype, result.size, result.iterations) == ("cpu", "float32", 256, 4)
    assert result.tflops > 0 and result.tflops == pytest.approx(tflops(256, 4, result.seconds), rel=0.01, abs=0.001)
    assert done.stdout.count("DSV41_MATMUL") == 1


def test_a_gpu_asked_of_a_cpu_runtime_is_refused():
    done = run_job("--device", "cuda")
    assert done.returncode == 2 and "torch sees no GPU" in done.stderr
