"""The pre-launch matrix-product check's contract (dsv41/matmul.py) and its job's edges without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dsv41.matmul import MatmulResult, below_floor, describe, parse_result, result_line, tflops

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def result(value: float, device: str = "NVIDIA GB10") -> MatmulResult:
    return MatmulResult(value, device, "bfloat16", 8192, 20, 0.5)


def test_tflops_counts_a_multiply_and_an_add_per_term():
    # 8192³ x 20 products in 0.25 s: 2 x 8192³ x 20 / 0.25 / 1e12
    assert tflops(8192, 20, 0.25) == pytest.approx(87.96, abs=0.01)
    with pytest.raises(ValueError, match="seconds must be > 0"):
        tflops(8192, 20, 0.0)


def test_the_result_line_round_trips_and_the_last_line_wins():
    first, second = result(40.0), result(95.5)
    output = f"some torch warning\n{result_line(first)}\n[rank] {result_line(second)}\n"
    assert parse_result(output) == second


@pytest.mark.parametrize("output, message", [
    ("nothing here\n", "no DSV41_MATMUL line"),
    ('DSV41_MATMUL {"tflops": 1}\n', "unreadable DSV41_MATMUL line"),
    ("DSV41_MATMUL not json\n", "unreadable DSV41_MATMUL line"),
])
def test_a_missing_or_torn_line_is_an_error_naming_it(output, message):
    with pytest.raises(ValueError, match=message):
        parse_result(output)


def test_below_floor_names_the_slow_nodes_slowest_first_and_zero_is_off():
    results = {"spark1": result(96.0), "spark2": result(41.5), "spark3": result(58.0)}
    assert [node for node, _ in below_floor(results, 60.0)] == ["spark2", "spark3"]
    assert below_floor(results, 0.0) == []
    assert below_floor(results, 40.0) == []


def test_the_failure_names_node_figure_floor_key_and_remedy():
    text = describe("spark2", result(41.5), 60.0)
    assert text.startswith("spark2: 41.5 TFLOPS on NVIDIA GB10 (bfloat16 8192³ x 20), floor 60 TFLOPS")
    assert "PREFLIGHT_TFLOPS_MIN" in text and "AC power" in text


def test_the_job_without_torch_exits_2_saying_so():
    try:
        import torch  # noqa: F401
        pytest.skip("this Python has torch; the sglang venv's run covers the job")
    except ImportError:
        pass
    done = subprocess.run([sys.executable, "-m", "adapter.matmul_check"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2
    assert "torch is not importable in this runtime" in done.stderr


def test_the_job_refuses_bad_arguments():
    done = subprocess.run([sys.executable, "-m", "adapter.matmul_check", "--iterations", "0"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 2 and "--iterations 1..10000" in done.stderr
