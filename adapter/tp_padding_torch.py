"""Tensor side of the TP padding plan: pad checkpoint tensors before SGLang shards them.

The loaders receive the full checkpoint tensor and cut out this rank's slice. For a padded model
the parameter's global size (local size x tp) is larger than the checkpoint tensor, so the tensor
is first padded along the sharded dimension with:

- 0 for weights (padded heads / groups / experts contribute nothing),
- 1.0 for FP8 block scales (dequantised zeros stay zero, and the scale stays a valid positive
  power of two for the MXFP8 / e8m0 kernels, which reject 0),
- ROUTER_PAD_BIAS for a router's score-correction bias, so a padded expert is never selected.
"""

from __future__ import annotations

import torch

ROUTER_PAD_BIAS = -1.0e9
SCALE_FILL = 1.0


def pad_dim(t: torch.Tensor, dim: int, size: int, fill: float) -> torch.Tensor:
    """`t` extended along `dim` to `size` with `fill` (returned unchanged if already as large)."""
    have = t.shape[dim]
    if have >= size:
        return t
    shape = list(t.shape)
    shape[dim] = size - have
    # float8 has no arithmetic kernels on every device; build the fill in float32 and cast.
    extra = torch.full(shape, fill, dtype=torch.float32, device=t.device).to(t.dtype)
    return torch.cat([t, extra], dim=dim)


def fill_for(kind: str, scale: bool, ndim: int) -> float:
    """The padding value for a tensor padded as `kind` ("attention" or "experts").

    `scale`: the tensor holds quantisation scales. A 1-D tensor padded over experts is the
    router's score-correction bias (the router weight itself is 2-D and pads with zeros).
    """
    if scale:
        return SCALE_FILL
    if kind == "experts" and ndim == 1:
        return ROUTER_PAD_BIAS
    return 0.0


def shard(t: torch.Tensor, dim: int, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s contiguous slice of `t` along `dim` (the size must divide by tp)."""
    size = t.shape[dim]
    if size % tp:
        raise ValueError(f"dimension {dim} of size {size} does not split over tp={tp}")
    part = size // tp
    return t.narrow(dim, rank * part, part)


def dequant_block(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Block-FP8 weight [N, K] with scales [ceil(N/bn), ceil(K/bk)] -> float32 [N, K]."""
    bn, bk = block
    n, k = weight.shape
    s = scale.float().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return weight.float() * s
