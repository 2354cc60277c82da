"""The W8A16 product of block-scaled fp8 weights (adapter/fp8_blocks.py): a Triton kernel on CUDA.

y[t, g, :] = x[t, g, :] @ dequant(weight[g])^T for x [T, G, K] bf16, weight [G, N, K] E4M3 with one
power-of-two scale per SCALE_BLOCK x SCALE_BLOCK tile (32 here). At decode row counts the product is
bound by reading the weight, so the kernel reads it as fp8 (half the bytes of bf16) and keeps the
work per weight byte small:

- the reduction runs in chunks of CHUNK = min(BLOCK_K, SCALE_BLOCK) columns, inside one scale
  column: each chunk's partial product takes its scale once per output feature (a [BLOCK_N] vector
  of scales, not one per weight element). Dot path (BLOCK_M >= 16): acc += dot(x, codes^T) * s, the
  codes converted fp8 -> bf16 (exact) and multiplied by bf16 activations with fp32 accumulation,
  as a bf16 GEMM does. GEMV path (BLOCK_M < 16, no tl.dot; meant for 1-4 rows): one activation
  row at a time, acc[row] += sum(x * codes) * s in fp32. Both are exact up to summation order:
  bf16 x E4M3 products are exact in fp32 and the scales are powers of two. The activation is not
  quantised.
- split-K (Tiles.split_k) spreads the reduction over more programs when the output alone gives too
  few to keep the memory system busy (wo_a: 4 x 1024 outputs). Each split writes an fp32 partial
  [S, T, G, N] and a second small kernel sums the partials in a fixed order (deterministic) and
  rounds once to the output dtype. No host sync and no host-side fill: it can be captured in a
  CUDA graph (the workspace is a torch.empty from the caching allocator).
- `tiles_for(rows, n, k, groups)` picks the launch configuration from a table per row bucket and
  shape class; bench/wo_a_fp8 and bench/draft_head_fp8 sweep the alternatives (--sweep) and print
  a table to paste here.

`grouped_w8a16` is what the adapters call: Triton on CUDA tensors, the float32 reference elsewhere.
`triton_w8a16` runs the kernel itself; under TRITON_INTERPRET=1 it runs on CPU tensors (the tests),
with float32 dot operands, since Triton's interpreter has no bf16 dot (bf16 x bf16 products are
exact in float32, so only the summation order differs). `dequantize` is the copy back to bf16 (a
Triton kernel on CUDA, fp8_blocks.dequantize elsewhere). Needs torch and triton only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from adapter.fp8_blocks import Fp8Blocks, reference_matmul
from adapter.fp8_blocks import dequantize as torch_dequantize

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only environment without triton: the reference serves
    triton = None
    tl = None


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


@dataclass(frozen=True)
class Tiles:
    """A launch configuration: rows, output features and reduction per program; how many programs
    share the reduction (split_k); warps; pipeline stages. block_m < 16 selects the GEMV path (no
    tl.dot), block_m >= 16 the tensor-core path. Powers of two."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    warps: int = 4
    stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "warps"):
            if not _pow2(getattr(self, name)):
                raise ValueError(f"Tiles.{name} must be a power of two, not {getattr(self, name)}")
        if self.split_k < 1 or self.stages < 1:
            raise ValueError(f"Tiles: split_k and stages must be >= 1 ({self})")
        if not self.gemv and (self.block_n < 16 or self.block_k < 16):
            raise ValueError(f"Tiles: the tl.dot path needs block_n and block_k >= 16 ({self})")

    @property
    def gemv(self) -> bool:
        return self.block_m < 16

    def label(self) -> str:
        """Short name for tables: BLOCK_M x BLOCK_N x BLOCK_K, then split, warps, stages."""
        return f"{self.block_m}x{self.block_n}x{self.block_k}/s{self.split_k}w{self.warps}p{self.stages}"

    def code(self) -> str:
        return (f"Tiles({self.block_m}, {self.block_n}, {self.block_k}, split_k={self.split_k}, "
                f"warps={self.warps}, stages={self.stages})")


# Launch tables: (largest row count, Tiles), first match wins; the last entry serves every larger
# row count. Measured on sm90 (H200, 132 SMs) by the sweeps of bench/wo_a_fp8 and
# bench/draft_head_fp8, which print tables in this form; GB10 (sm121) has fewer SMs and a tenth
# of the bandwidth, so a sweep there may choose otherwise. At decode row counts the product
# streams the weight once: enough programs in flight to cover the memory latency, K steps of
# 32-column chunks (one scale column each), fp32 partials across split-K small beside the weight.
#
# NARROW: few output features per launch (wo_a, 4 groups x 1024, K 4096: 64 tiles of 64 outputs),
# so split-K makes the programs: 64 x 8 = 512 at decode rows. Fewer splits as rows grow, so the
# partials (split x rows x 16 KiB) stay well under the 16 MiB weight.
NARROW = (  # measured on an NVIDIA H200: bench/decode_fp8 --sweep (bench/results/decode_fp8-h200.txt)
    (1, Tiles(1, 32, 256, split_k=8, warps=2, stages=3)),
    (16, Tiles(16, 64, 64, split_k=8, warps=4, stages=4)),
    (32, Tiles(32, 64, 64, split_k=8, warps=4, stages=4)),
    (64, Tiles(32, 64, 128, split_k=4, warps=4, stages=3)),
    (128, Tiles(128, 32, 128, split_k=2, warps=4, stages=3)),
    (256, Tiles(64, 64, 64, split_k=2, warps=4, stages=4)),
    (1 << 30, Tiles(128, 32, 128, split_k=1, warps=4, stages=3)),
)
# WIDE: many output features (the draft's LM head shard, 43,136 x 5120: 674 tiles of 64 outputs):
# the outputs alone give enough programs, each streaming all of K.
WIDE = (  # measured likewise
    (16, Tiles(16, 64, 128, split_k=1, warps=4, stages=3)),
    (32, Tiles(32, 128, 64, split_k=2, warps=4, stages=4)),
    (1 << 30, Tiles(32, 64, 128, split_k=1, warps=4, stages=3)),
)
NARROW_OUTPUTS = 16384  # groups x out_features up to this is NARROW


def shape_class(n: int, groups: int = 1) -> str:
    return "narrow" if n * groups <= NARROW_OUTPUTS else "wide"


def table_for(n: int, groups: int = 1) -> tuple[tuple[int, Tiles], ...]:
    return NARROW if shape_class(n, groups) == "narrow" else WIDE


def tiles_for(rows: int, n: int, k: int, groups: int = 1) -> Tiles:
    """The launch configuration for x [rows, groups, k] @ w [groups, n, k]^T. (k only bounds the
    split: the kernel never splits past one K step per program.)"""
    table = table_for(n, groups)
    for most, tiles in table:
        if rows <= most:
            return tiles
    return table[-1][1]


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def split_range(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(columns per split, a multiple of block_k; number of splits that get columns)."""
    steps = -(-k // block_k)
    per = -(-steps // max(1, min(split_k, steps)))
    k_split = per * block_k
    return k_split, -(-k // k_split)


if triton is not None:

    @triton.jit(do_not_specialize=["M"])
    def _w8a16_kernel(
        x_ptr, w_ptr, s_ptr, y_ptr,
        M, N, K, K_SPLIT, SPLITS,
        sxm, sxg, sxk,
        swg, swn, swk,
        ssg, ssn, ssk,
        sy_s, sym, syg, syn,
        SCALE_BLOCK: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GEMV: tl.constexpr,
        EVEN_K: tl.constexpr,
        DOT_BF16: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_z = tl.program_id(2)
        g = pid_z // SPLITS
        split = pid_z % SPLITS
        k_lo = split * K_SPLIT
        k_hi = tl.minimum(k_lo + K_SPLIT, K)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rc = tl.arange(0, CHUNK)
        # Rows past M and outputs past N read a valid row instead (their results are not stored),
        # so the loads need no row masks.
        xm = rm % M
        wn = rn % N
        x_base = x_ptr + g * sxg
        w_base = w_ptr + g * swg
        s_rows = s_ptr + g * ssg + (wn // SCALE_BLOCK) * ssn  # [BLOCK_N]: this tile's scale rows
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if GEMV:
            # One activation row at a time against the [BLOCK_N, CHUNK] codes (the products exact in
            # fp32, summed over the chunk, then scaled): small row loads broadcast across the tile
            # without a layout change; rows accumulate into their line of acc.
            w_rows = w_base + wn[None, :, None] * swn  # [1, BLOCK_N, 1]
            row0 = pid_m * BLOCK_M
            lines = tl.arange(0, BLOCK_M)[:, None]  # [BLOCK_M, 1]
            for k0 in range(k_lo, k_hi, BLOCK_K):
                for j in tl.static_range(BLOCK_K // CHUNK):
                    kc = k0 + j * CHUNK
                    kk = kc + rc[None, None, :]
                    if EVEN_K:
                        w = tl.load(w_rows + kk * swk)
                        s = tl.load(s_rows + (kc // SCALE_BLOCK) * ssk)
                    else:
                        w = tl.load(w_rows + kk * swk, mask=kk < k_hi, other=0)
                        s = tl.load(s_rows + (kc // SCALE_BLOCK) * ssk, mask=(rn * 0 + kc) < k_hi, other=0.0)
                    # The codes arrive as bytes (a masked load needs no fp8 constant), then E4M3.
                    wf = w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                    for i in tl.static_range(BLOCK_M):
                        x_row = x_base + ((row0 + i) % M) * sxm
                        if EVEN_K:
                            x = tl.load(x_row + kk * sxk)
                        else:
                            x = tl.load(x_row + kk * sxk, mask=kk < k_hi, other=0.0)
                        part = tl.sum(x.to(tl.float32) * wf, axis=2) * s[None, :]  # [1, BLOCK_N]
                        if BLOCK_M == 1:
                            acc += part
                        else:
                            acc = tl.where(lines == i, acc + part, acc)
        else:
            x_rows = x_base + xm[:, None] * sxm  # [BLOCK_M, 1]
            w_rows = w_base + wn[:, None] * swn  # [BLOCK_N, 1]
            for k0 in range(k_lo, k_hi, BLOCK_K):
                for j in tl.static_range(BLOCK_K // CHUNK):
                    kc = k0 + j * CHUNK
                    kk = kc + rc[None, :]
                    if EVEN_K:
                        x = tl.load(x_rows + kk * sxk)
                        w = tl.load(w_rows + kk * swk)
                        s = tl.load(s_rows + (kc // SCALE_BLOCK) * ssk)
                    else:
                        x = tl.load(x_rows + kk * sxk, mask=kk < k_hi, other=0.0)
                        w = tl.load(w_rows + kk * swk, mask=kk < k_hi, other=0)
                        s = tl.load(s_rows + (kc // SCALE_BLOCK) * ssk, mask=(rn * 0 + kc) < k_hi, other=0.0)
                    w = w.to(tl.float8e4nv, bitcast=True)
                    if DOT_BF16:
                        part = tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
                    else:
                        part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
                    acc += part * s[None, :]
        y_mask = (rm[:, None] < M) & (rn[None, :] < N)
        y = y_ptr + split * sy_s + rm[:, None] * sym + g * syg + rn[None, :] * syn
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=y_mask)

    @triton.jit
    def _sum_splits_kernel(
        ws_ptr, y_ptr, G, N, sws, sym, syg, syn,
        SPLITS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)  # t * G + g of the contiguous [S, T, G, N] workspace
        rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = rn < N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLITS):  # a fixed order: the same sum on every call
            acc += tl.load(ws_ptr + s * sws + row * N + rn, mask=mask, other=0.0)
        t = row // G
        g = row % G
        tl.store(y_ptr + t * sym + g * syg + rn * syn, acc.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _dequant_kernel(
        w_ptr, s_ptr, y_ptr, N, K,
        swg, swn, swk, ssg, ssn, ssk, syg, syn, syk,
        SCALE_BLOCK: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        g = tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rc = tl.arange(0, CHUNK)
        n_ok = rn < N
        for j in tl.static_range(BLOCK_K // CHUNK):
            kc = pid_k * BLOCK_K + j * CHUNK
            kk = kc + rc
            w_ptrs = w_ptr + g * swg + rn[:, None] * swn + kk[None, :] * swk
            y_ptrs = y_ptr + g * syg + rn[:, None] * syn + kk[None, :] * syk
            s_ptrs = s_ptr + g * ssg + (rn // SCALE_BLOCK) * ssn + (kc // SCALE_BLOCK) * ssk
            if EVEN:
                w = tl.load(w_ptrs)
                s = tl.load(s_ptrs)
            else:
                mask = n_ok[:, None] & (kk[None, :] < K)
                w = tl.load(w_ptrs, mask=mask, other=0)
                s = tl.load(s_ptrs, mask=n_ok & ((rn * 0 + kc) < K), other=0.0)
            v = w.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s[:, None]
            if EVEN:
                tl.store(y_ptrs, v.to(y_ptr.dtype.element_ty))
            else:
                tl.store(y_ptrs, v.to(y_ptr.dtype.element_ty), mask=mask)


def triton_w8a16(x: torch.Tensor, blocks: Fp8Blocks, tiles: Tiles | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, G, K] (any strides) -> [T, G, N] in x's dtype (or into `out`), by the Triton kernel."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    t, g, k = x.shape
    if g != blocks.groups or k != blocks.in_features:
        raise ValueError(f"x {tuple(x.shape)} does not fit the fp8 weight {tuple(blocks.weight.shape)}")
    n = blocks.out_features
    if out is None:
        out = torch.empty((t, g, n), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (t, g, n):
        raise ValueError(f"out {tuple(out.shape)} is not [{t}, {g}, {n}]")
    if t == 0:
        return out
    cfg = tiles or tiles_for(t, n, k, g)
    scale_block = blocks.block
    chunk = min(cfg.block_k, scale_block)
    if not _pow2(scale_block) or (not cfg.gemv and chunk < 16):
        raise ValueError(f"{cfg} does not fit scale blocks of {scale_block}")
    k_split, splits = split_range(k, cfg.block_k, cfg.split_k)
    if splits > 1:
        target = torch.empty((splits, t, g, n), dtype=torch.float32, device=x.device)
        y_strides = target.stride()
    else:
        target = out
        y_strides = (0, *out.stride())
    w, s = blocks.weight.view(torch.uint8), blocks.scale
    grid = (triton.cdiv(t, cfg.block_m), triton.cdiv(n, cfg.block_n), g * splits)
    _w8a16_kernel[grid](
        x, w, s, target, t, n, k, k_split, splits,
        x.stride(0), x.stride(1), x.stride(2),
        w.stride(0), w.stride(1), w.stride(2),
        s.stride(0), s.stride(1), s.stride(2),
        *y_strides,
        SCALE_BLOCK=scale_block, CHUNK=chunk, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GEMV=cfg.gemv, EVEN_K=k % cfg.block_k == 0, DOT_BF16=not interpreting(),
        num_warps=cfg.warps, num_stages=cfg.stages,
    )
    if splits > 1:
        block = min(1024, triton.next_power_of_2(n))
        _sum_splits_kernel[(t * g, triton.cdiv(n, block))](
            target, out, g, n, target.stride(0), out.stride(0), out.stride(1), out.stride(2),
            SPLITS=splits, BLOCK=block, num_warps=4,
        )
    return out


def triton_dequantize(blocks: Fp8Blocks, dtype: torch.dtype = torch.bfloat16,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """The [G, N, K] weight the copy stands for, by a Triton kernel (one read of the codes, one write)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    g, n, k = blocks.weight.shape
    if out is None:
        out = torch.empty((g, n, k), dtype=dtype, device=blocks.weight.device)
    if out.numel() == 0:
        return out
    w, s = blocks.weight.view(torch.uint8), blocks.scale
    chunk = min(blocks.block, 128)
    block_n, block_k = 64, max(chunk, 256 // chunk * chunk)
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k), g)
    _dequant_kernel[grid](
        w, s, out, n, k, *w.stride(), *s.stride(), *out.stride(),
        SCALE_BLOCK=blocks.block, CHUNK=chunk, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN=n % block_n == 0 and k % block_k == 0, num_warps=4,
    )
    return out


_dequant_failed = False


def dequantize(blocks: Fp8Blocks, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """fp8_blocks.dequantize, by the Triton kernel on CUDA (the same values, exactly); should the
    kernel fail, by torch from then on."""
    global _dequant_failed
    if blocks.weight.is_cuda and triton is not None and not _dequant_failed:
        try:
            return triton_dequantize(blocks, dtype)
        except Exception:  # noqa: BLE001 - torch computes the same values
            _dequant_failed = True
    return torch_dequantize(blocks, dtype)


def grouped_w8a16(x: torch.Tensor, blocks: Fp8Blocks) -> torch.Tensor:
    """The adapters' entry: Triton on CUDA, the float32 reference on any other device."""
    if x.is_cuda and triton is not None:
        return triton_w8a16(x, blocks)
    return reference_matmul(x, blocks)


def linear_w8a16(x: torch.Tensor, blocks: Fp8Blocks) -> torch.Tensor:
    """x [M, K] @ weight^T for a one-group copy (an LM head): [M, N]."""
    if blocks.groups != 1:
        raise ValueError(f"linear_w8a16 takes a one-group weight, not {blocks.groups} groups")
    return grouped_w8a16(x.unsqueeze(1), blocks).squeeze(1)
