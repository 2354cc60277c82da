"""The pre-launch matrix-product check's contract (standard library only): the job's one result line,
the arithmetic, and the floor's decision.

The job (adapter/matmul_check.py) runs in the rank's runtime and prints one line

    DSV41_MATMUL {"tflops": 612.4, "device": "NVIDIA H100 80GB HBM3", "dtype": "bfloat16", "size": 8192,
                  "iterations": 20, "seconds": 0.036}

the agent returns it and the coordinator's preflight compares it with PREFLIGHT_TFLOPS_MIN.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

PREFIX = "DSV41_MATMUL "


@dataclass(frozen=True)
class MatmulResult:
    tflops: float
    device: str
    dtype: str
    size: int
    iterations: int
    seconds: float


def tflops(size: int, iterations: int, seconds: float) -> float:
    """A square product of `size` does 2·size³ floating-point operations (a multiply and an add each)."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    return 2.0 * size ** 3 * iterations / seconds / 1e12


def result_line(result: MatmulResult) -> str:
    return PREFIX + json.dumps(asdict(result), sort_keys=True)


def parse_result(output: str) -> MatmulResult:
    """The last result line in the job's output; ValueError naming what is wrong otherwise."""
    lines = [line[line.index(PREFIX) + len(PREFIX):] for line in output.splitlines() if PREFIX in line]
    if not lines:
        raise ValueError(f"no {PREFIX.strip()} line in the job's output")
    try:
        fields = json.loads(lines[-1])
        return MatmulResult(float(fields["tflops"]), str(fields["device"]), str(fields["dtype"]),
                            int(fields["size"]), int(fields["iterations"]), float(fields["seconds"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"unreadable {PREFIX.strip()} line {lines[-1][:200]!r}: {exc}") from None


def below_floor(results: dict[str, MatmulResult], floor_tflops: float) -> list[tuple[str, MatmulResult]]:
    """The nodes below the floor, slowest first; none when the floor is 0 (the check is off)."""
    if floor_tflops <= 0:
        return []
    slow = [(node, r) for node, r in results.items() if r.tflops < floor_tflops]
    return sorted(slow, key=lambda item: item[1].tflops)


def describe(node: str, result: MatmulResult, floor_tflops: float) -> str:
    return (f"{node}: {result.tflops:.1f} TFLOPS on {result.device} ({result.dtype} {result.size}³ x "
            f"{result.iterations}), floor {floor_tflops:g} TFLOPS (PREFLIGHT_TFLOPS_MIN); a GPU latched in "
            "its slow state runs at about two thirds of its clock: check `dsv41ctl status`'s GPU line, and "
            "remove the node's AC power to clear it")
