"""mxfp8_b12x: run the block-FP8 dense projections on the FlashInfer MXFP8 kernel named by
DSV41_MXFP8_BACKEND, shape by shape, and keep padded blocks eligible for it.

DeepSeek-V4.1's dense projections are 32x32 ue8m0 block-FP8, which SGLang can serve as MXFP8
(`Fp8LinearMethod` with `--fp8-gemm-backend flashinfer_cutlass`). On GB10 (SM121) FlashInfer's
own b12x kernel (16/32-row tiles) measured ~3x the CUTLASS SM120 kernel at decode sizes; cudnn is
the alternative; `cutlass` keeps SGLang's choice.

- Routing: `dispatch_block_fp8_mxfp8_linear` (after) returns, for the FlashInfer CUTLASS /
  CuTe-DSL backends, a ShapeRoutedLinear: the named backend with SGLang's kernel as the fallback.
  The first call of each shape (output features N, input features K, rows M rounded up to a
  bucket) outside CUDA-graph capture runs both and keeps the named backend only if it ran and
  its output agrees with the fallback's (relative error <= 2e-2); otherwise that shape stays on
  the fallback for the life of the process. Undecided shapes met during capture use the fallback.
- Scale repair: before `Fp8LinearMethod._prepare_block_fp8_as_mxfp8`, non-positive block scales
  over all-zero weight blocks (TP padding) are set to 1.0 (mxfp8_scales.py), so such layers are
  not left on the Triton kernel.

DSV41_MXFP8_BACKEND: b12x (default), cudnn, cutlass (no routing; the scale repair still applies).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Mapping
from typing import Any

from adapter.patching import AFTER, BEFORE, ON_IMPORT, AdapterSpec, Patch, PatchError
from dsv41 import rankadapters
from dsv41.adapterlog import AdapterLog

NAME = "mxfp8_b12x"
# The variables build() reads: dsv41ctl config check reports any other adapter key as no effect.
ENV_KEYS = rankadapters.BY_NAME[NAME].keys  # every variable build() reads, declared in dsv41
UTILS = "sglang.srt.layers.quantization.fp8_utils"
FP8 = "sglang.srt.layers.quantization.fp8"
BACKENDS = rankadapters.DSV41_MXFP8_BACKEND.choices
ROUTED = ("b12x", "cudnn")
TOLERANCE = 2e-2
PREFERRED, FALLBACK = "preferred", "fallback"

ShapeKey = tuple[int, int, int]  # (rows bucket, N, K)


def rows_bucket(rows: int) -> int:
    """Rows rounded up to the next kernel bucket: 16, 32, then powers of two."""
    if rows <= 16:
        return 16
    bucket = 32
    while bucket < rows:
        bucket *= 2
    return bucket


class ShapeRoutes:
    """Per-shape decisions (pure bookkeeping), shared by every routed layer of a process."""

    def __init__(self) -> None:
        self._choice: dict[ShapeKey, str] = {}
        self._reported: set[tuple[int, int]] = set()

    def get(self, key: ShapeKey) -> str | None:
        return self._choice.get(key)

    def decide(self, key: ShapeKey, choice: str) -> bool:
        """Record a decision; True when it is the first fallback reported for this (N, K)."""
        self._choice[key] = choice
        if choice == FALLBACK and key[1:] not in self._reported:
            self._reported.add(key[1:])
            return True
        return False

    def decisions(self) -> dict[ShapeKey, str]:
        return dict(self._choice)


def relative_error(out: Any, ref: Any) -> float:
    a, b = out.float(), ref.float()
    denom = float(b.norm())
    num = float((a - b).norm())
    if denom == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / denom


def _is_capturing() -> bool:
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


class ShapeRoutedLinear:
    """Drop-in for SGLang's MXFP8 linear callable: the preferred kernel where it is proven."""

    def __init__(
        self,
        preferred: Callable[..., Any],
        fallback: Callable[..., Any],
        routes: ShapeRoutes,
        backend: str,
        log: AdapterLog,
        capturing: Callable[[], bool] = _is_capturing,
        tolerance: float = TOLERANCE,
    ) -> None:
        self.preferred = preferred
        self.fallback = fallback
        self.routes = routes
        self.backend = backend
        self._log = log
        self._capturing = capturing
        self._tolerance = tolerance

    @staticmethod
    def shape_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> ShapeKey:
        x = kwargs["input"] if "input" in kwargs else args[0]
        w = kwargs["weight"] if "weight" in kwargs else args[1]
        shape = getattr(x, "shape", None)
        rows = 0
        if shape is not None and len(shape) >= 1:
            rows = 1
            for s in shape[:-1]:
                rows *= int(s)
        return rows_bucket(rows), int(w.shape[0]), int(w.shape[1])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = self.shape_key(args, kwargs)
        choice = self.routes.get(key)
        if choice == PREFERRED:
            return self.preferred(*args, **kwargs)
        if choice == FALLBACK or self._capturing():
            return self.fallback(*args, **kwargs)
        try:
            out = self.preferred(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - an unsupported shape must fall back, not crash
            self._decide(key, FALLBACK, f"{type(e).__name__}: {e}")
            return self.fallback(*args, **kwargs)
        ref = self.fallback(*args, **kwargs)
        err = relative_error(out, ref)
        if err <= self._tolerance:
            self._decide(key, PREFERRED, "")
            return out
        self._decide(key, FALLBACK, f"output differs from the fallback by {err:.3g} (relative)")
        return ref

    def _decide(self, key: ShapeKey, choice: str, reason: str) -> None:
        if self.routes.decide(key, choice):
            self._log.line(f"{NAME}: N={key[1]} K={key[2]} (rows<={key[0]}) stays on SGLang's kernel: {reason}")


class Mxfp8B12x:
    def __init__(self, backend: str, log: AdapterLog) -> None:
        self.backend = backend
        self._log = log
        self.routes = ShapeRoutes()
        self._linear: Callable[..., Any] | None = None
        self.repaired = 0

    def bind_utils(self, module: types.ModuleType) -> None:
        linear = getattr(module, "flashinfer_mxfp8_blockscaled_linear", None)
        if linear is None:
            raise PatchError(f"{module.__name__} has no flashinfer_mxfp8_blockscaled_linear")
        self._linear = linear

    def after_dispatch(self, result: Any, backend: Any, *_args: Any, **_kwargs: Any) -> Any:
        if self.backend not in ROUTED or self._linear is None:
            return None
        flashinfer = getattr(backend, "is_flashinfer_cutlass", None)
        cutedsl = getattr(backend, "is_flashinfer_cutedsl", None)
        if not ((flashinfer is not None and flashinfer()) or (cutedsl is not None and cutedsl())):
            return None
        preferred = functools.partial(self._linear, backend=self.backend, pin_tactic=True)
        return ShapeRoutedLinear(preferred, result, self.routes, self.backend, self._log)

    def before_prepare(self, method: Any, layer: Any, *_args: Any, **_kwargs: Any) -> None:
        weight = getattr(layer, "weight", None)
        scale = getattr(layer, "weight_scale_inv", None)
        block = getattr(method, "weight_block_size", None)
        if weight is None or scale is None or not block or len(block) != 2:
            return None
        from adapter.mxfp8_scales import repair_block_scales

        fixed = repair_block_scales(weight.data, scale.data, (int(block[0]), int(block[1])))
        if fixed and not self.repaired:
            where = getattr(layer, "prefix", None) or tuple(weight.shape)
            self._log.line(f"{NAME}: set {fixed} non-positive scales of all-zero blocks to 1.0 in {where} (further repairs not logged)")
        self.repaired += fixed
        return None


def build(env: Mapping[str, str], log: AdapterLog) -> AdapterSpec | None:
    backend = rankadapters.DSV41_MXFP8_BACKEND.read(env)
    adapter = Mxfp8B12x(backend, log)
    routing = f"route to FlashInfer {backend} per shape" if backend in ROUTED else "SGLang's kernel choice"
    patches = [
        Patch(FP8, "Fp8LinearMethod._prepare_block_fp8_as_mxfp8", BEFORE, adapter.before_prepare, params=("self", "layer")),
    ]
    if backend in ROUTED:
        patches = [
            Patch(UTILS, "", ON_IMPORT, adapter.bind_utils),
            Patch(UTILS, "dispatch_block_fp8_mxfp8_linear", AFTER, adapter.after_dispatch, params=("backend",)),
            *patches,
        ]
    return AdapterSpec(name=NAME, detail=f"{routing}; zero-block scale repair", patches=tuple(patches), state=adapter)
