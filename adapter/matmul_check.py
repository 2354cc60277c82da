"""matmul_check: the pre-launch check's job, run in the rank's runtime (its torch, its GPU): a short
fixed square matrix product, timed after a warm-up, printed as one DSV41_MATMUL line (dsv41/matmul.py).

    python3 -m adapter.matmul_check [--size N] [--iterations N] [--device cuda|cpu]

bf16 on a GPU (the engine's dtype; what the recipes' 60 TFLOPS floor on GB10 is stated in), fp32 on
a CPU (the demo and CI: a check that the path runs, not a figure to gate on).
"""

from __future__ import annotations

import argparse
import sys
import time

from dsv41.matmul import MatmulResult, result_line, tflops

GPU_SIZE, CPU_SIZE = 8192, 512
WARMUP = 3


def measure(torch, device: str, size: int, iterations: int) -> MatmulResult:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(WARMUP):
        a @ b
    sync()
    start = time.perf_counter()
    for _ in range(iterations):
        a @ b
    sync()
    seconds = time.perf_counter() - start
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return MatmulResult(round(tflops(size, iterations, seconds), 3), name, str(dtype).removeprefix("torch."),
                        size, iterations, round(seconds, 6))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="matmul_check", description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=0, help=f"0: {GPU_SIZE} on a GPU, {CPU_SIZE} on a CPU")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    args = parser.parse_args(argv)
    if args.size < 0 or not 1 <= args.iterations <= 10000:
        parser.error("--size must be >= 0 and --iterations 1..10000")
    try:
        import torch
    except ImportError as exc:
        print(f"matmul_check: torch is not importable in this runtime: {exc}", file=sys.stderr)
        return 2
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        print("matmul_check: --device cuda but torch sees no GPU", file=sys.stderr)
        return 2
    size = args.size or (GPU_SIZE if device == "cuda" else CPU_SIZE)
    print(result_line(measure(torch, device, size, args.iterations)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
