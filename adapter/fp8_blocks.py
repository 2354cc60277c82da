"""Block-scaled FP8 (E4M3) weights with power-of-two scales, and the reference W8A16 product.

The decode adapters keep fp8 copies of bf16 projections (wo_a_w8: the target's grouped wo_a;
draft_head_fp8: the draft's LM head). A copy is a weight [G, N, K] in float8_e4m3fn plus one
float32 scale per BLOCK x BLOCK tile, [G, ceil(N/B), ceil(K/B)]. Each scale is the power of two
2^ceil(log2(amax / 448)), the E8M0 convention of DeepSeek-V4.1's checkpoint (32 x 32 tiles). Two
consequences the adapters rely on:

- dequantised values (code x scale) are exact in bfloat16, so a kernel can dequantise in registers
  and multiply in bf16 without a second rounding;
- a bf16 weight that SGLang dequantised from the checkpoint's own 32 x 32 E8M0 tiles (wo_a) is
  quantised back without loss: the new scale is never larger than the checkpoint's, so every code
  only shifts by a power of two.

Needs torch only (bench/ uses it on a GPU machine without SGLang).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 32  # V4.1's checkpoint tiles


@dataclass(frozen=True)
class Fp8Blocks:
    """An fp8 copy of a bf16 weight: codes [G, N, K] and scales [G, ceil(N/B), ceil(K/B)]."""

    weight: torch.Tensor
    scale: torch.Tensor
    block: int = BLOCK

    @property
    def groups(self) -> int:
        return int(self.weight.shape[0])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[2])

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + self.scale.numel() * self.scale.element_size()


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(amax / 448)) elementwise, exactly (frexp, no log rounding); 1.0 where amax is 0."""
    ratio = amax.float() / FP8_MAX
    mantissa, exponent = torch.frexp(ratio)
    # ratio = m * 2^e with m in [0.5, 1): ceil(log2 ratio) is e, or e - 1 when ratio is a power of two.
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
    scale = torch.ldexp(torch.ones_like(ratio), exponent)
    return torch.where(ratio > 0, scale, torch.ones_like(ratio))


def _padded(w: torch.Tensor, block: int) -> torch.Tensor:
    g, n, k = w.shape
    pn, pk = (-n) % block, (-k) % block
    if pn or pk:
        w = torch.nn.functional.pad(w, (0, pk, 0, pn))
    return w


def quantize(weight: torch.Tensor, block: int = BLOCK) -> Fp8Blocks:
    """[G, N, K] (or [N, K], taken as G = 1) floating weight -> Fp8Blocks on the same device.

    One group at a time: the float32 temporaries are one group's, not the layer's."""
    w = weight.unsqueeze(0) if weight.dim() == 2 else weight
    if w.dim() != 3 or not w.is_floating_point():
        raise ValueError(f"expected a floating [G, N, K] or [N, K] weight, got {tuple(weight.shape)} {weight.dtype}")
    g, n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    codes = torch.empty((g, n, k), dtype=FP8, device=w.device)
    scales = torch.empty((g, nb, kb), dtype=torch.float32, device=w.device)
    for i in range(g):
        tiles = _padded(w[i : i + 1].float(), block).view(nb, block, kb, block)
        scale = pow2_scale(tiles.abs().amax(dim=(1, 3)))
        q = (tiles / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
        codes[i] = q.view(nb * block, kb * block)[:n, :k]
        scales[i] = scale
    return Fp8Blocks(codes, scales, block)


def dequantize(blocks: Fp8Blocks, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The [G, N, K] weight the copy stands for (exact in bf16, see the module docstring)."""
    b = blocks.block
    g, n, k = blocks.weight.shape
    if n % b == 0 and k % b == 0 and dtype in (torch.bfloat16, torch.float32):
        # Whole tiles: convert the codes straight to the output dtype and scale there (a power of
        # two, so code x scale is the same exact value), without float32 temporaries.
        codes = blocks.weight.view(g, n // b, b, k // b, b).to(dtype)
        return (codes * blocks.scale.to(dtype)[:, :, None, :, None]).view(g, n, k)
    codes = _padded(blocks.weight.float(), b)
    nb, kb = codes.shape[1] // b, codes.shape[2] // b
    values = codes.view(g, nb, b, kb, b) * blocks.scale[:, :, None, :, None]
    return values.view(g, nb * b, kb * b)[:, :n, :k].to(dtype)


def reference_matmul(x: torch.Tensor, blocks: Fp8Blocks) -> torch.Tensor:
    """x [T, G, K] @ weight[g]^T -> [T, G, N] in x's dtype: the float32 product of the dequantised
    weight, what the W8A16 kernel computes up to summation order."""
    w = dequantize(blocks, torch.float32)
    return torch.einsum("tgk,gnk->tgn", x.float(), w).to(x.dtype)


def quantization_bound(weight: torch.Tensor, blocks: Fp8Blocks) -> torch.Tensor:
    """Largest |weight - dequantised| E4M3 rounding allows, per element: half an ulp of 3 mantissa
    bits (|w| x 2^-4) for normal codes, scale x 2^-10 below the smallest normal (2^-6)."""
    b = blocks.block
    g, n, k = blocks.weight.shape
    scale = blocks.scale.repeat_interleave(b, 1).repeat_interleave(b, 2)[:, :n, :k]
    w = (weight.unsqueeze(0) if weight.dim() == 2 else weight).float()
    return torch.maximum(w.abs() * 2.0**-4, scale * 2.0**-10)
