"""CPU-rehearsal shim for sgl_kernel, installed only into the real-engine environment
(tools/sglang-venv.sh); not SGLang's kernel library.

With SGLANG_USE_CPU_ENGINE=1, SGLang 0.5.23 imports CPU helpers from sgl_kernel at module level, and
PyPI ships sgl_kernel only as CUDA builds (no CPU wheel, no sdist). A dense model on a CPU without
AMX calls exactly one of them; it is implemented here in torch, after the reference it mirrors.
Every other top-level name resolves, so that imports succeed, and raises when called; submodules
(sgl_kernel.scalar_type, .kvcacheio, ...) do not exist, which SGLang's optional imports handle.
"""

from __future__ import annotations

import torch

__version__ = "0.0.0+dsv41.cpu.shim"


class ShimNotImplemented(NotImplementedError):
    pass


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """Called by sglang/srt/mem_cache/allocation.py (assign_req_to_token_pool_func) on CPU. Mirrors
    that file's Triton kernel assign_req_to_token_pool: request i's slots are the next
    end_offset[i] - start_offset[i] entries of out_cache_loc (after those of requests 0..i-1), written
    into row req_pool_indices[i] of req_to_token at columns [start_offset[i], end_offset[i])."""
    if req_to_token.shape[1] != pool_len:
        raise ValueError(f"pool_len {pool_len} is not req_to_token's row length {req_to_token.shape[1]}")
    taken = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        count = end - start
        req_to_token[row, start:end] = out_cache_loc[taken:taken + count].to(req_to_token.dtype)
        taken += count


def _unimplemented(path: str):
    def call(*args, **kwargs):
        raise ShimNotImplemented(f"{path}: not implemented by the CPU shim of sgl_kernel "
                                 "(tools/engine/shims/sgl_kernel); only assign_req_to_token_pool_cpu is")
    call.__qualname__ = call.__name__ = path.rsplit(".", 1)[-1]
    return call


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _unimplemented(f"{__name__}.{name}")
