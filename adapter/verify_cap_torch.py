"""The verify cap's tensor rules (verify_cap.py): device ops only, so CUDA graphs capture them.

Rows of a static DSpark verify are request-major: request r owns rows [r * stride, (r + 1) * stride),
row r * stride is its anchor, and `live[r]` = 1 + k of them are live.
"""

from __future__ import annotations

import torch


def live_lengths(confidence: torch.Tensor, threshold: float, minimum: int = 1) -> torch.Tensor:
    """[bs, gamma] per-draft survival estimates -> int64 [bs] live rows, 1 + k, where k counts the
    leading drafts whose running product stays >= threshold, clamped to [minimum, gamma]
    (verify_cap.live_drafts for one request)."""
    gamma = int(confidence.shape[1])
    survival = torch.cumprod(confidence.float().clamp(0.0, 1.0), dim=1)
    k = (survival >= threshold).to(torch.int64).cumprod(dim=1).sum(dim=1)
    return k.clamp(min=min(minimum, gamma), max=gamma) + 1


def dead_row_sources(live: torch.Tensor, rows: int, stride: int) -> torch.Tensor:
    """int64 [rows]: each verify row's own index while live, its anchor's once dead."""
    index = torch.arange(rows, device=live.device)
    request = torch.div(index, stride, rounding_mode="floor")
    dead = (index - request * stride) >= live[request]
    return torch.where(dead, request * stride, index)


def zero_dead_drafts(draft_probs: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """[bs, gamma, vocab] draft distributions with the rows of dead drafts (index >= k) set to 0,
    in place; the sampled accept then never accepts a dead draft and samples the bonus from p."""
    bs, gamma = int(draft_probs.shape[0]), int(draft_probs.shape[1])
    keep = torch.arange(gamma, device=draft_probs.device)[None, :] < (live[:bs] - 1)[:, None]
    return draft_probs.masked_fill_(~keep.unsqueeze(-1), 0.0)
