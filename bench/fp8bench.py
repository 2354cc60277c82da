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
  sglang_w8a8_block  only where SGLang imports: SGLang's own block-fp8 linear (per_token_group_quant_fp8
                  with groups of 128, then its Triton w8a8_block_fp8_matmul) on the weight re-quantised
                  to 128 x 128 tiles, one launch pair per group; W8A8, so its error adds the
                  activation's rounding, and 128 x 128 tiles do not hold the 32 x 32 checkpoint exactly

The tile sweep (sweep()) times the adapters' kernel over launch configurations per row count: the
GEMV path (BLOCK_M < 16) and the tl.dot path, several BLOCK_N / BLOCK_K / warps / stages, and split-K
1-16 where it gives a sensible number of programs. Configurations run config by config (each
compiles once), the adapter's own choices first, within a time budget; one that fails to compile
is reported and skipped. It prints each row count's best beside the adapter's choice and a launch
table per row bucket in fp8_gemm's form, ready to paste.
"""

from __future__ import annotations

import importlib
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


def sglang_block_fp8():
    """SGLang's block-fp8 functions, ((per_token_group_quant_fp8, w8a8_block_fp8_matmul), where),
    or (None, why not): the module moved between SGLang releases, and importing SGLang may fail."""
    tried = []
    for quant_module, gemm_module, gemm_name in (
        ("sglang.srt.layers.quantization.fp8_kernel", "sglang.srt.layers.quantization.fp8_kernel",
         "w8a8_block_fp8_matmul"),
        ("sglang.kernels.ops.quantization.fp8_kernel", "sglang.kernels.ops.gemm.fp8_kernel",
         "w8a8_block_fp8_matmul_triton"),
    ):
        try:
            quant = importlib.import_module(quant_module).per_token_group_quant_fp8
            gemm = getattr(importlib.import_module(gemm_module), gemm_name)
        except Exception as e:  # noqa: BLE001 - SGLang absent, or an import it cannot satisfy here
            tried.append(f"{quant_module}: {type(e).__name__}: {e}"[:200])
            continue
        return (quant, gemm), f"{gemm_module}.{gemm_name}"
    return None, "; ".join(tried)


SGLANG_BLOCK = 128  # SGLang's block-fp8 linear: 128 x 128 weight tiles, activation groups of 128


def variants(weight, blocks, rowwise, sglang=None) -> dict[str, Callable]:
    """The products for one weight; `sglang` (sglang_block_fp8()'s functions) adds SGLang's column."""
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
        # wo_a_w8's DROP path: fp8_gemm.dequantize (a Triton kernel on CUDA, torch elsewhere).
        return torch.einsum("tgk,gnk->tgn", x, fp8_gemm.dequantize(blocks, x.dtype))

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

    out = {"bf16_einsum": bf16_einsum, "bf16_bmm": bf16_bmm, "fp8_w8a16": fp8_w8a16,
           "dequant_bf16": dequant_bf16, "fp8_scaled_mm": fp8_scaled_mm}
    if sglang is not None and on_cuda:
        quant, gemm = sglang
        copy = fp8_blocks.quantize(weight, block=SGLANG_BLOCK)
        tile = [SGLANG_BLOCK, SGLANG_BLOCK]

        def sglang_w8a8_block(x):
            outs = []
            for g in range(copy.groups):
                xq, xs = quant(x[:, g].contiguous(), SGLANG_BLOCK)
                outs.append(gemm(xq, copy.weight[g], xs, copy.scale[g], tile, output_dtype=x.dtype))
            return torch.stack(outs, dim=1)

        out["sglang_w8a8_block"] = sglang_w8a8_block
    return out


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


# ----- the tile sweep of the adapters' kernel -----

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # a table entry serves rows up to its bound
LAST = 1 << 30  # the bound of a table's last entry: every larger row count
# (block_n, block_k, warps, stages) per path; block_m comes from the row bucket (block_ms).
GEMV_SHAPES = ((32, 256, 2, 3), (64, 128, 4, 3), (64, 256, 4, 3), (128, 128, 8, 3), (128, 256, 8, 3))
# The last two: narrow tiles with deep K steps, many programs without split-K (no second kernel).
DOT_SHAPES = ((32, 128, 4, 3), (64, 128, 4, 3), (64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 3),
              (128, 128, 8, 3), (64, 64, 4, 4), (128, 64, 4, 4), (64, 128, 8, 3), (16, 256, 1, 4),
              (32, 256, 2, 4))
SPLITS = (1, 2, 4, 8, 16)
CHUNK = 32  # the kernel's reduction chunk: one scale column (fp8_blocks.BLOCK)
CPU_CONFIGS = 3  # per row count on the CPU (interpreted): a smoke test of the sweep, not a measurement


def bucket_of(rows: int) -> int:
    return next((b for b in ROW_BUCKETS if rows <= b), LAST)


def block_ms(bucket: int) -> list[int]:
    """BLOCK_M candidates for a row bucket: the GEMV path's (the bucket itself) up to 4 rows (past
    that its fp32 multiply-adds, one per row and weight element, no longer hide under the memory
    time), then the tl.dot path's one or two sizes around the row count."""
    gemv = [bucket] if bucket <= 4 else []
    if bucket <= 16:
        dot = [16]
    elif bucket <= 32:
        dot = [16, 32]
    elif bucket <= 64:
        dot = [32, 64]
    else:
        dot = [64, 128]
    return gemv + dot


def effective(tiles, k: int):
    """The configuration as it runs on a reduction of k: split_k as the kernel clamps it (no split
    gets less than one K step)."""
    import dataclasses

    from adapter.fp8_gemm import split_range

    return dataclasses.replace(tiles, split_k=split_range(k, tiles.block_k, tiles.split_k)[1])


def compile_key(tiles) -> tuple:
    """What a Triton compile depends on (split_k is a runtime argument)."""
    return tiles.block_m, tiles.block_n, tiles.block_k, tiles.warps, tiles.stages


def candidates(rows: int, n: int, k: int, groups: int, sms: int) -> list:
    """The launch configurations swept at `rows`: every shape of the bucket's paths that loads 16
    bytes of codes per thread (GEMV), or keeps at most 32 fp32 accumulators and 128 activation
    operands per thread and fits the shared memory (tl.dot; larger ones spill on sm90), with each
    split-K that leaves every split two K steps or more and no more than 8 programs per SM."""
    from adapter.fp8_gemm import Tiles

    out = []
    for bm in block_ms(bucket_of(rows)):
        for bn, bk, warps, stages in (GEMV_SHAPES if bm < 16 else DOT_SHAPES):
            if bm < 16 and bn * min(bk, CHUNK) < 16 * 32 * warps:  # narrower code loads per thread
                continue
            if bm >= 16 and (bm * bn > 32 * 32 * warps or bm * bk > 128 * 32 * warps
                             or stages * (2 * bm + bn) * bk > 200 * 1024):
                continue
            base = -(-rows // bm) * -(-n // bn) * groups
            steps = -(-k // bk)
            for split in SPLITS:
                if split > 1 and (steps < 2 * split or base * split > 8 * sms):
                    continue
                out.append(Tiles(bm, bn, bk, split, warps, stages))
    return out


def sweep(rows_list, n: int, k: int, groups: int, make_run: Callable, device: str, iters: int, count: int,
          budget_s: float) -> dict:
    """Time the kernel at every candidate configuration of every row count (make_run(tiles, rows) -> a
    callable doing `count` products), configuration by configuration: the adapter's own choices first,
    then one compile key after another. Past budget_s the rest are skipped (reported); a configuration
    that fails (a compile error, too little shared memory) is reported and skipped for every row."""
    import torch

    from adapter import fp8_gemm

    cpu = device != "cuda"
    sms = 132 if cpu else torch.cuda.get_device_properties(0).multi_processor_count
    chosen = {rows: effective(fp8_gemm.tiles_for(rows, n, k, groups), k) for rows in rows_list}
    wanted: dict = {}  # tiles -> row counts, in sweep order
    for rows in rows_list:
        wanted.setdefault(chosen[rows], []).append(rows)
    per_row = {}
    for rows in rows_list:
        cands = candidates(rows, n, k, groups, sms)
        if cpu:
            cands = cands[:: max(1, len(cands) // (CPU_CONFIGS - 1))][: CPU_CONFIGS - 1]
        per_row[rows] = cands
    by_key: dict = {}
    for rows in rows_list:
        for tiles in per_row[rows]:
            by_key.setdefault(compile_key(tiles), {}).setdefault(tiles, []).append(rows)
    for group in by_key.values():
        for tiles, rows in group.items():
            for r in rows:
                if r not in wanted.setdefault(tiles, []):
                    wanted[tiles].append(r)
    started = time.monotonic()
    times = {rows: {} for rows in rows_list}
    failed: dict = {}
    skipped = 0
    for tiles, rows_for in wanted.items():
        key, label = compile_key(tiles), tiles.label()
        for rows in rows_for:
            if key in failed:
                times[rows][label] = "failed"
                continue
            if time.monotonic() - started > budget_s:
                times[rows][label] = "skipped"
                skipped += 1
                continue
            try:
                times[rows][label] = median_us(make_run(tiles, rows), count, device, iters, graph=True)[0]
            except Exception as e:  # noqa: BLE001 - a configuration this GPU or Triton cannot build
                first = (str(e).strip().splitlines() or [""])[0]
                failed[key] = f"{type(e).__name__}: {first}"[:240]
                times[rows][label] = "failed"
                print(f"  sweep: {label} failed ({failed[key]}); skipped", flush=True)
                if not cpu:
                    try:
                        torch.cuda.synchronize()
                    except Exception:  # noqa: BLE001 - the error was the device's: nothing more to learn
                        pass
    return {"times": times, "adapter": {rows: chosen[rows].label() for rows in rows_list},
            "tiles": {t.label(): t for t in list(wanted)},
            "failed": {"x".join(map(str, key)): err for key, err in failed.items()},
            "skipped": skipped, "seconds": time.monotonic() - started, "configs": len(wanted), "sms": sms}


def _measured(row_times: dict) -> dict:
    return {label: v for label, v in row_times.items() if isinstance(v, float)}


def report_sweep(result: dict, rows_list, nbytes: int, table: str, source: str, unit: str) -> dict:
    """Print each row count's best configuration beside the adapter's, then the best table per row
    bucket in fp8_gemm's form (ready to paste); return the JSON summary."""
    times, adapter, tiles = result["times"], result["adapter"], result["tiles"]
    print(f"\nfp8_w8a16 tile sweep ({unit}; BLOCK_M x BLOCK_N x BLOCK_K / split_k, warps, stages; BLOCK_M < 16 is "
          f"the GEMV path): {result['configs']} configurations, {sum(len(_measured(t)) for t in times.values())} "
          f"timed in {result['seconds']:.0f} s" + (f", {result['skipped']} skipped past the time budget"
                                                    if result["skipped"] else ""))
    print(f"{'rows':>6}  {'best':<22} {'us':>9} {'GB/s':>6}   {'adapter (tiles_for)':<22} {'us':>9}  "
          f"{'x best':>6}  next best")
    best_of = {}
    for rows in rows_list:
        measured = _measured(times[rows])
        mine = times[rows].get(adapter[rows])
        if not measured:
            print(f"{rows:>6}  (nothing measured)")
            continue
        ranked = sorted(measured, key=measured.get)
        best = ranked[0]
        best_of[rows] = best
        mine_us = f"{mine:>9.2f}" if isinstance(mine, float) else f"{str(mine):>9}"
        ratio = f"{mine / measured[best]:>6.2f}" if isinstance(mine, float) else f"{'':>6}"
        gbps = nbytes / (measured[best] * 1e-6) / 1e9
        nxt = "  ".join(f"{lb}={measured[lb]:.2f}" for lb in ranked[1:4])
        print(f"{rows:>6}  {best:<22} {measured[best]:>9.2f} {gbps:>6.0f}   {adapter[rows]:<22} {mine_us}  "
              f"{ratio}  {nxt}")
    for key, err in result["failed"].items():
        print(f"  failed to build or run: {key} (BLOCK_M x BLOCK_N x BLOCK_K x warps x stages): {err}")

    # One entry per row bucket that has measured rows: the configuration whose worst ratio to each
    # row's best is smallest among those measured at every row of the bucket.
    buckets: dict = {}
    for rows in rows_list:
        if rows in best_of:
            buckets.setdefault(bucket_of(rows), []).append(rows)
    entries = []
    for bucket in sorted(buckets):
        rows_in = sorted(buckets[bucket])
        common = None
        for rows in rows_in:
            labels = set(_measured(times[rows]))
            common = labels if common is None else common & labels
        if not common:
            continue

        def worst(label, rows_in=rows_in):
            return max(times[r][label] / times[r][best_of[r]] for r in rows_in)

        pick = min(sorted(common), key=lambda lb, rows_in=rows_in: (worst(lb), sum(times[r][lb] for r in rows_in)))
        entries.append((bucket, pick, worst(pick), rows_in))
    print(f"\nbest launch table by row bucket ({source}; each entry serves the rows up to its bound, the last "
          f"every larger count), ready to paste into adapter/fp8_gemm.py:")
    print(f"{table} = (")
    for i, (bucket, pick, w, rows_in) in enumerate(entries):
        bound = "1 << 30" if i == len(entries) - 1 else str(bucket)
        us = ", ".join(f"{times[r][pick]:.2f}" for r in rows_in)
        note = f"rows {', '.join(map(str, rows_in))}: {us} {unit.split(' ')[0]}" + (f" (worst {w:.2f}x of a row's best)"
                                                                                    if w > 1.0 else "")
        print(f"    ({bound}, {tiles[pick].code()}),  # {note}")
    print(")")
    return {"table": table, "entries": [[b if i < len(entries) - 1 else LAST, p, w, r]
                                        for i, (b, p, w, r) in enumerate(entries)],
            "failed": result["failed"], "skipped": result["skipped"], "seconds": result["seconds"],
            "configs": result["configs"]}
