"""Repair of non-positive block-FP8 scales on all-zero weight blocks (torch).

A block whose weights are all zero (TP padding, or a checkpoint that zeroed unused rows) may
carry a scale of 0 (or a negative / NaN one). Its dequantised value is zero whatever the scale,
but SGLang's MXFP8 conversion (`block_fp8_scale_to_mxfp8_e8m0`) needs every scale to be a
positive power of two and otherwise leaves the whole layer on the slow Triton kernel. Setting
those scales to 1.0 changes no output. A non-positive scale over non-zero weights is a broken
checkpoint and is left alone (SGLang still rejects it).
"""

from __future__ import annotations

import torch


ROW_BLOCKS_PER_CHUNK = 64  # bounds the temporary mask to 64 block rows of the weight


def _nonzero(weight: torch.Tensor) -> torch.Tensor:
    if weight.element_size() == 1 and weight.dtype.is_floating_point:
        # FP8: compare the bits without the sign, so -0 counts as zero; no float8 kernels needed.
        return (weight.view(torch.uint8) & 0x7F) != 0
    return weight != 0


def zero_blocks(weight: torch.Tensor, block: tuple[int, int], grid: tuple[int, int]) -> torch.Tensor:
    """Bool [grid] mask: True where the weight block holds only zeros (either sign)."""
    bn, bk = block
    gn, gk = grid
    n, k = weight.shape
    out = torch.empty(gn, gk, dtype=torch.bool, device=weight.device)
    for r0 in range(0, gn, ROW_BLOCKS_PER_CHUNK):
        r1 = min(gn, r0 + ROW_BLOCKS_PER_CHUNK)
        rows = weight[r0 * bn : min(n, r1 * bn)]
        mask = torch.zeros((r1 - r0) * bn, gk * bk, dtype=torch.bool, device=weight.device)
        mask[: rows.shape[0], :k] = _nonzero(rows)
        out[r0:r1] = ~mask.view(r1 - r0, bn, gk, bk).any(dim=3).any(dim=1)
    return out


def repair_block_scales(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> int:
    """Set to 1.0, in place, the scales <= 0 or NaN whose weight block is all zero; how many."""
    if weight.dim() != 2 or scale.dim() != 2:
        return 0
    grid = (scale.shape[0], scale.shape[1])
    bn, bk = block
    n, k = weight.shape
    if -(-n // bn) != grid[0] or -(-k // bk) != grid[1]:
        return 0  # not the layout we know; leave it to SGLang's own checks
    values = scale.float()
    bad = ~(values > 0)  # catches 0, negatives and NaN
    if not bool(bad.any()):
        return 0
    fix = bad & zero_blocks(weight, block, grid)
    count = int(fix.sum())
    if count:
        scale[fix] = torch.ones((), dtype=scale.dtype, device=scale.device)
    return count
