"""The W8A16 product of block-scaled fp8 weights (adapter/fp8_blocks.py): a Triton kernel on CUDA.

y[t, g, :] = x[t, g, :] @ dequant(weight[g])^T for x [T, G, K] bf16, weight [G, N, K] E4M3 with
power-of-two tile scales. Each program loads its weight tile as fp8 (half the bytes of bf16: the
saving at decode row counts, where the product is bound by reading the weight), multiplies by the
tile's scale in registers (exact in bf16) and accumulates bf16 x bf16 products in fp32, as a bf16
GEMM does. The activation is not quantised.

`grouped_w8a16` is what the adapters call: Triton on CUDA tensors, the float32 reference elsewhere.
`triton_w8a16` runs the kernel itself; under TRITON_INTERPRET=1 it runs on CPU tensors (the tests),
with float32 dot operands, since Triton's interpreter has no bf16 dot (bf16 x bf16 products are
exact in float32, so only the summation order differs). Needs torch and triton only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from adapter.fp8_blocks import Fp8Blocks, reference_matmul

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only environment without triton: the reference serves
    triton = None
    tl = None


@dataclass(frozen=True)
class Tiles:
    """A launch configuration: rows, output features and reduction per program; warps; stages."""

    block_m: int
    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 3


# Decode and verify rows (<= 32: a single 16- or 32-row tile) read the weight once per token tile,
# so narrow output tiles give more programs to stream it; wider tiles from 64 rows on.
SMALL = Tiles(16, 32, 128)
MEDIUM = Tiles(32, 64, 128)
LARGE = Tiles(64, 64, 64)


def tiles_for(rows: int) -> Tiles:
    if rows <= 16:
        return SMALL
    if rows <= 64:
        return MEDIUM
    return LARGE


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


if triton is not None:

    @triton.jit
    def _w8a16_kernel(
        x_ptr, w_ptr, s_ptr, y_ptr,
        M, N, K,
        sxm, sxg, sxk,
        swg, swn, swk,
        ssg, ssn, ssk,
        sym, syg, syn,
        SCALE_BLOCK: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DOT_BF16: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        g = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        x_base = x_ptr + g * sxg
        w_base = w_ptr + g * swg
        s_base = s_ptr + g * ssg
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            x_mask = (rm[:, None] < M) & (kk[None, :] < K)
            x = tl.load(x_base + rm[:, None] * sxm + kk[None, :] * sxk, mask=x_mask, other=0.0)
            w_mask = (rn[:, None] < N) & (kk[None, :] < K)
            # The codes arrive as bytes: a masked load needs no fp8 constant, then a bitcast to E4M3.
            w = tl.load(w_base + rn[:, None] * swn + kk[None, :] * swk, mask=w_mask, other=0)
            w = w.to(tl.float8e4nv, bitcast=True)
            # One scale per SCALE_BLOCK x SCALE_BLOCK tile: a warp's lanes mostly read one address.
            s = tl.load(s_base + (rn[:, None] // SCALE_BLOCK) * ssn + (kk[None, :] // SCALE_BLOCK) * ssk,
                        mask=w_mask, other=0.0)
            w = w.to(tl.float32) * s
            if DOT_BF16:
                acc += tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
            else:
                acc += tl.dot(x.to(tl.float32), tl.trans(w))
        y_mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(y_ptr + rm[:, None] * sym + g * syg + rn[None, :] * syn, acc.to(y_ptr.dtype.element_ty), mask=y_mask)


def triton_w8a16(x: torch.Tensor, blocks: Fp8Blocks, tiles: Tiles | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, G, K] (any strides) -> [T, G, N] in x's dtype, by the Triton kernel."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    t, g, k = x.shape
    if g != blocks.groups or k != blocks.in_features:
        raise ValueError(f"x {tuple(x.shape)} does not fit the fp8 weight {tuple(blocks.weight.shape)}")
    n = blocks.out_features
    if out is None:
        out = torch.empty((t, g, n), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    cfg = tiles or tiles_for(t)
    w, s = blocks.weight.view(torch.uint8), blocks.scale
    grid = (triton.cdiv(t, cfg.block_m), triton.cdiv(n, cfg.block_n), g)
    _w8a16_kernel[grid](
        x, w, s, out, t, n, k,
        x.stride(0), x.stride(1), x.stride(2),
        w.stride(0), w.stride(1), w.stride(2),
        s.stride(0), s.stride(1), s.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        SCALE_BLOCK=blocks.block, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_BF16=not interpreting(), num_warps=cfg.warps, num_stages=cfg.stages,
    )
    return out


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
