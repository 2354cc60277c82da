"""What bench/wo_a_fp8 and bench/draft_head_fp8 share: weights, the products they compare, timing.

Needs torch (and triton for the adapter's kernel on CUDA), never SGLang. Products of x [T, G, K] with
a weight [G, N, K]; every variant returns [T, G, N]:

  bf16_einsum     torch.einsum on the bf16 weight (SGLang's generic wo_a path; the head's matmul)
  bf16_bmm        torch.bmm into a token-major output (SGLang's _wo_a_bf16_bmm_token_major)
  fp8_w8a16       the adapters' Triton kernel on the fp8 copy (adapter/fp8_gemm.py)
  dequant_bf16    the fp8 copy dequantised to bf16 per call, then einsum (wo_a_w8's path for rows the
                  twin does not serve once DSV41_WO_A_W8_DROP released the bf16 weight)
  fp8_scaled_mm   torch._scaled_mm on H100/H200 fp8 tensor cores: the activation quantised per row
                  (W8A8) and the weight re-quantised with one scale per output row; its error adds
                  the activation's rounding (SGLang's ROCm fp8 LM head works this way)
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def prepare(device: str) -> None:
    """On the CPU the Triton kernel runs in Triton's interpreter (set before triton is imported)."""
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"


def checkpoint_weight(groups: int, n: int, k: int, seed: int, device):
    """A bf16 weight as SGLang holds the V4.1 checkpoint's fp8 tensors: E4M3 codes times a power-of-two
    scale per 32 x 32 tile, exact in bf16."""
    import torch

    from adapter.fp8_blocks import Fp8Blocks, dequantize

    g = torch.Generator(device="cpu").manual_seed(seed)
    codes = (torch.randn(groups, n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.pow(2.0, torch.randint(-14, -8, (groups, -(-n // 32), -(-k // 32)), generator=g).float())
    return dequantize(Fp8Blocks(codes.to(device), scales.to(device)))


def rowwise_fp8(w):
    """[G, N, K] -> (E4M3 [G, N, K], float32 [G, N, 1]) with one scale per output row."""
    import torch

    scale = w.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 448.0
    return (w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def variants(weight, blocks, rowwise) -> dict[str, Callable]:
    import torch

    from adapter import fp8_blocks, fp8_gemm

    on_cuda = weight.is_cuda

    def bf16_einsum(x):
        return torch.einsum("tgk,gnk->tgn", x, weight)

    def bf16_bmm(x):
        out = torch.empty((x.shape[0], weight.shape[0], weight.shape[1]), dtype=x.dtype, device=x.device)
        torch.bmm(x.transpose(0, 1), weight.transpose(1, 2), out=out.transpose(0, 1))
        return out

    def fp8_w8a16(x):
        if on_cuda:
            return fp8_gemm.triton_w8a16(x, blocks)
        # Interpreted: stored as float32, since the interpreter's bf16 store truncates.
        out = torch.empty((x.shape[0], blocks.groups, blocks.out_features), dtype=torch.float32)
        return fp8_gemm.triton_w8a16(x, blocks, out=out)

    def dequant_bf16(x):
        return torch.einsum("tgk,gnk->tgn", x, fp8_blocks.dequantize(blocks, x.dtype))

    codes, scale = rowwise
    scale_b = [scale[g].t().contiguous() for g in range(scale.shape[0])]  # [1, N] per group

    def fp8_scaled_mm(x):
        t = x.shape[0]
        pad = (-t) % 16  # cuBLASLt's fp8 GEMM wants 16-aligned rows
        outs = []
        for g in range(codes.shape[0]):
            xg = x[:, g]
            if pad:
                xg = torch.nn.functional.pad(xg, (0, 0, 0, pad))
            xs = xg.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 448.0
            xq = (xg.float() / xs).clamp(-448, 448).to(torch.float8_e4m3fn)
            y = torch._scaled_mm(xq, codes[g].t(), scale_a=xs, scale_b=scale_b[g], out_dtype=x.dtype)
            outs.append(y[:t])
        return torch.stack(outs, dim=1)

    return {"bf16_einsum": bf16_einsum, "bf16_bmm": bf16_bmm, "fp8_w8a16": fp8_w8a16,
            "dequant_bf16": dequant_bf16, "fp8_scaled_mm": fp8_scaled_mm}


def rel_error(y, ref) -> float:
    return float((y.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def median_us(run: Callable[[], None], count: int, device: str, iters: int, graph: bool) -> tuple[float, str]:
    """Median microseconds of one `run()` (which does `count` products) divided by `count`, and how
    it was timed: a CUDA graph replay (no launch overhead, as the rank's decode graphs) or eager."""
    import torch

    if device != "cuda":
        run()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6 / count, "eager (cpu)"
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    how, replay = "eager", run
    if graph:
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                run()
            g.replay()
            torch.cuda.synchronize()
            how, replay = "cuda graph", g.replay
        except Exception as e:  # noqa: BLE001 - a variant that cannot be captured is timed eagerly
            how = f"eager ({type(e).__name__} in capture)"
            torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times) / count, how


def device_name(device: str) -> str:
    import torch

    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        return f"{p.name} (sm{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs)"
    return "cpu (Triton interpreted): a smoke test of the code paths, not a measurement"


def versions() -> str:
    import torch

    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = "none"
    return f"torch {torch.__version__}, triton {tv}, python {sys.version.split()[0]}"
