#!/usr/bin/env python3
"""The pre-launch matrix-product check (adapter/matmul_check.py) against a sustained baseline measured
in the same run: how close the short check a preflight runs comes to what the GPU sustains, and
how much it spreads from one run to the next. Each check runs as its own process, as preflight's
job does (a cold CUDA context every time).

    python3 bench/matmul_check.py [--runs 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dsv41.matmul import parse_result  # noqa: E402


def job(*args: str):
    out = subprocess.run([sys.executable, "-m", "adapter.matmul_check", *args], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    result = parse_result(out)
    return result.tflops, result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    lines = []
    baseline, info = job("--iterations", "500")
    lines.append(f"device: {info.device}, {info.dtype} {info.size}^3")
    lines.append(f"baseline (500 products, one process): {baseline:.1f} TFLOPS")
    for iterations in (5, 20, 50):
        figures = [job("--iterations", str(iterations))[0] for _ in range(args.runs)]
        lines.append(f"check of {iterations:>3} products x {args.runs} runs: median {statistics.median(figures):.1f} "
                     f"TFLOPS = {statistics.median(figures) / baseline:.3f} x baseline; "
                     f"min {min(figures) / baseline:.3f}, max {max(figures) / baseline:.3f} x baseline")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "matmul_check.txt").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
