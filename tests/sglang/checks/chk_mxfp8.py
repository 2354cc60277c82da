"""mxfp8_b12x on the real fp8_utils / fp8 modules: routing per shape, and the zero-block scale
repair in front of Fp8LinearMethod._prepare_block_fp8_as_mxfp8."""

import sys
from types import SimpleNamespace

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit, marked  # noqa: E402

import torch  # noqa: E402

from sglang.srt.layers.quantization import fp8_utils  # noqa: E402
from sglang.srt.layers.quantization.fp8 import Fp8LinearMethod  # noqa: E402
from sglang.srt.layers.quantization.fp8_utils import Mxfp8DenseGemmBackend  # noqa: E402

result = {"marked_dispatch": marked(fp8_utils.dispatch_block_fp8_mxfp8_linear)}

# --- routing -------------------------------------------------------------------------------
linear = fp8_utils.dispatch_block_fp8_mxfp8_linear(Mxfp8DenseGemmBackend.FLASHINFER_CUTLASS)
result["routed_type"] = type(linear).__name__
result["preferred_backend"] = getattr(getattr(linear, "preferred", None), "keywords", {}).get("backend")
result["fallback_backend"] = getattr(getattr(linear, "fallback", None), "keywords", {}).get("backend")
result["triton_backend_untouched"] = type(fp8_utils.dispatch_block_fp8_mxfp8_linear(Mxfp8DenseGemmBackend.UNSUPPORTED)).__name__

if result["routed_type"] == "ShapeRoutedLinear":
    calls = []

    def reference(input, weight, weight_scale, input_scale=None, bias=None, **kw):
        calls.append("fallback")
        return input @ weight.t()

    def preferred(input, weight, weight_scale, input_scale=None, bias=None, **kw):
        # Stands in for the b12x kernel on CPU: right for N=64, wrong for N=96, raises for N=128.
        calls.append("preferred")
        if weight.shape[0] == 128:
            raise RuntimeError("unsupported tile")
        out = input @ weight.t()
        return out * 1.5 if weight.shape[0] == 96 else out

    linear.preferred, linear.fallback = preferred, reference
    x = torch.randn(4, 64)
    outs = {}
    for n in (64, 96, 128):
        w = torch.randn(n, 64)
        for _ in range(2):
            calls.clear()
            y = linear(input=x, weight=w, weight_scale=None, input_scale=None, bias=None)
            outs.setdefault(n, []).append({"calls": list(calls), "exact": bool(torch.allclose(y, x @ w.t()))})
    result["routes"] = {str(n): v for n, v in outs.items()}
    result["decisions"] = sorted(f"{k[1]}:{v}" for k, v in linear.routes.decisions().items())

# --- scale repair on the real _prepare_block_fp8_as_mxfp8 ------------------------------------
def prepare(zero_scale_over_nonzero=False):
    n, k = 96, 64
    w = torch.randn(n, k).clamp(-2, 2).to(torch.float8_e4m3fn)
    w[64:] = 0  # padded heads: all-zero rows, i.e. whole 32x32 blocks
    scale = torch.full((n // 32, k // 32), 0.5)
    scale[2:] = 0.0  # padding carried a zero scale
    if zero_scale_over_nonzero:
        scale[0, 0] = 0.0
    layer = SimpleNamespace(weight=SimpleNamespace(data=w, shape=w.shape), weight_scale_inv=SimpleNamespace(data=scale), prefix="layers.0.wq_b")
    received = []
    method = SimpleNamespace(
        weight_block_size=[32, 32],
        _process_mxfp8_linear_weight_scale=lambda layer, scale_u8=None: received.append(scale_u8),
    )
    Fp8LinearMethod._prepare_block_fp8_as_mxfp8(method, layer)
    return {
        "ready": bool(getattr(layer, "block_fp8_mxfp8_ready", False)),
        "scales": scale.tolist(),
        "e8m0_rows": None if not received else list(received[0].shape),
    }


result["marked_prepare"] = marked(Fp8LinearMethod._prepare_block_fp8_as_mxfp8)
result["padded_layer"] = prepare()
result["broken_checkpoint"] = prepare(zero_scale_over_nonzero=True)
emit(result)
