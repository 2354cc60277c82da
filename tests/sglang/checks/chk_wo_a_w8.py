"""wo_a_w8 on SGLang's real DeepSeek-V4 modules (CPU torch, TP 1).

argv: a scratch directory. Builds SGLang's own attention layers (MqaAttentionBase, the target's, and
DSparkAttention, the draft's), loads their wo_a the way DeepseekV4ForCausalLM.load_weights does: the
checkpoint's fp8 E4M3 weight with 32 x 32 E8M0 scales through SGLang's _dequant_fp8_wo_a_streaming
and the layer's weight loader (one more target layer gets a bf16 weight no fp8 tile holds exactly).
Armed, the adapter's post-load hook twins the layers, and every product goes through SGLang's
_apply_wo_a_bf16_matmul as MQALayer.forward and DSparkAttention.forward call it, at decode, verify
and prefill row counts; each result is compared with SGLang's own function (the wrapped original)
and with a float32 product of the loaded bf16 weight. The Triton kernel runs too (interpreted).
"""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton: the kernel runs on CPU tensors
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit, installer, marked  # noqa: E402
from rankenv import start_rank, v41_config  # noqa: E402

import torch  # noqa: E402

ROWS = (1, 6, 8, 9, 12, 24, 192, 193)
PREFILL_ROWS = (6, 300)


def checkpoint_wo_a(n, k, seed):
    """A wo_a as the V4.1 checkpoint stores it: E4M3 codes and one E8M0 scale per 32 x 32 tile."""
    g = torch.Generator().manual_seed(seed)
    codes = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    exponents = torch.randint(-14, -6, (n // 32, k // 32), generator=g).float()
    scale = torch.pow(2.0, exponents).to(torch.float8_e8m0fnu)
    return codes, scale


def load(layer, prefix, seed, raw_bf16=False):
    from sglang.srt.models.deepseek_v4 import _dequant_fp8_wo_a_streaming

    param = layer.wo_a.weight
    n, k = param.shape
    if raw_bf16:
        g = torch.Generator().manual_seed(seed)
        stream = [(f"{prefix}.wo_a.weight", (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16))]
    else:
        codes, scale = checkpoint_wo_a(n, k, seed)
        stream = _dequant_fp8_wo_a_streaming([(f"{prefix}.wo_a.weight", codes), (f"{prefix}.wo_a.scale", scale)])
    for name, tensor in stream:
        assert name.endswith(".wo_a.weight"), name
        param.weight_loader(param, tensor)
    return param.detach().clone()


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def main():
    start_rank(sys.argv[1])
    import sglang.srt.models.deepseek_v4 as dsv4
    import sglang.srt.models.deepseek_v4_dspark as dspark

    from adapter import fp8_blocks, fp8_gemm

    result = {"marked_matmul": marked(dsv4._apply_wo_a_bf16_matmul),
              "marked_post_load": marked(dsv4.DeepseekV4ForCausalLM.post_load_weights),
              "marked_draft_post_load": marked(dspark.DeepseekV4ForCausalLMDSpark.post_load_weights),
              "draft_calls_the_hooked_function": dspark._apply_wo_a_bf16_matmul is dsv4._apply_wo_a_bf16_matmul}
    cfg = v41_config(num_hidden_layers=3, compress_ratios=[0, 0, 0])
    target = torch.nn.Module()
    target.layers = torch.nn.ModuleList(dsv4.MqaAttentionBase(cfg, i, None, f"model.layers.{i}.self_attn")
                                        for i in range(3))
    draft = torch.nn.Module()
    draft.stages = torch.nn.ModuleList([dspark.DSparkAttention(cfg, 0, None, "stages.0.self_attn")])
    loaded = [load(layer, f"model.layers.{i}.self_attn", seed=i, raw_bf16=(i == 2))
              for i, layer in enumerate(target.layers)]
    loaded.append(load(draft.stages[0], "stages.0.self_attn", seed=7))
    layers = [*target.layers, draft.stages[0]]
    g, r = layers[0].n_local_groups, layers[0].o_lora_rank
    result["shape"] = [g, r, loaded[0].shape[1]]

    spec = installer().spec("wo_a_w8") if installer() else None
    adapter = spec.state if spec is not None else None
    if adapter is not None:
        made = adapter.build_twins(target, "target")
        if adapter.settings.draft:
            made += adapter.build_twins(draft, "draft")
        again = adapter.build_twins(target, "target")  # SGLang's loader calls post_load_weights twice
        twins = [adapter.twins.get(layer.wo_a.weight.data_ptr()) for layer in layers]
        result["twinned"] = [t is not None for t in twins]
        result["twinned_again"] = len(again)
        result["fail_closed"] = spec.fail_closed
        result["weight_storage_bytes"] = [layer.wo_a.weight.untyped_storage().nbytes() for layer in layers]
        result["weight_shape_kept"] = [list(layer.wo_a.weight.shape) == list(w.shape) for layer, w in
                                       zip(layers, loaded)]
        # The twin's values: the checkpoint's exactly (layers 0, 1, draft); within E4M3 rounding (layer 2).
        exact, within = [], []
        for twin, weight in zip(twins, loaded):
            if twin is None:
                exact.append(None)
                within.append(None)
                continue
            dq = fp8_blocks.dequantize(twin.blocks).view_as(weight)
            exact.append(bool(torch.equal(dq.view(torch.int16), weight.view(torch.int16))))
            bound = fp8_blocks.quantization_bound(weight.view(g, r, -1), twin.blocks).view_as(weight)
            within.append(bool(((dq.float() - weight.float()).abs() <= bound).all()))
        result["twin_exact"], result["twin_within_e4m3"] = exact, within

    original = getattr(dsv4._apply_wo_a_bf16_matmul, "__wrapped__", dsv4._apply_wo_a_bf16_matmul)
    gen = torch.Generator().manual_seed(11)
    calls = []
    cases = [(rows, "verify") for rows in ROWS] + [(1, "decode")] + [(rows, "prefill") for rows in PREFILL_ROWS]
    for index, (layer, weight) in enumerate(zip(layers, loaded)):
        for rows, mode in cases:
            o = torch.randn(rows, g, weight.shape[1], generator=gen).to(torch.bfloat16)
            flags = dict(is_decode=mode == "decode", is_target_verify=mode == "verify", is_prefill=mode == "prefill")
            before = adapter.fp8_calls if adapter else 0
            out = dsv4._apply_wo_a_bf16_matmul(o, layer.wo_a.weight.view(g, r, -1), fast_path=True, **flags)
            sglang_out = original(o, weight.view(g, r, -1), fast_path=True, **flags)
            ref = torch.einsum("tgd,grd->tgr", o.float(), weight.view(g, r, -1).float())
            calls.append({"layer": index, "rows": rows, "mode": mode, "shape": list(out.shape),
                          "fp8": bool(adapter and adapter.fp8_calls > before),
                          "same_as_sglang": bool(torch.equal(out.view(torch.int16), sglang_out.view(torch.int16))),
                          "rel_vs_float32": rel(out, ref), "sglang_rel_vs_float32": rel(sglang_out, ref)})
    # A verify input as MQALayer.forward makes it (heads sliced, then viewed by group) is strided.
    o = torch.randn(6, 2 * g, loaded[0].shape[1], generator=gen).to(torch.bfloat16)[:, ::2]
    strided = dsv4._apply_wo_a_bf16_matmul(o, layers[0].wo_a.weight.view(g, r, -1), is_decode=False,
                                           is_target_verify=True, fast_path=True)
    result["strided_rel"] = rel(strided, torch.einsum("tgd,grd->tgr", o.float(), loaded[0].view(g, r, -1).float()))
    result["calls"] = calls
    if adapter is not None and twins[0] is not None:
        # The kernel the adapter runs on CUDA, interpreted, on a real twin and on odd shapes (partial
        # tiles, partial scale blocks, strided x): its float32 accumulator against the float32
        # product of the dequantised weight. (Stored as float32: the interpreter's bf16 cast
        # truncates where a GPU rounds.)
        kernel = {}
        odd = fp8_blocks.quantize((torch.randn(3, 40, 80, generator=gen) * 0.05).to(torch.bfloat16))
        for label, blocks, rows, stride in (("twin_6", twins[0].blocks, 6, 1), ("twin_24", twins[0].blocks, 24, 1),
                                            ("twin_100", twins[0].blocks, 100, 1), ("odd_7_strided", odd, 7, 2)):
            o = torch.randn(rows, blocks.groups * stride, blocks.in_features, generator=gen).to(torch.bfloat16)
            o = o[:, ::stride]
            out = torch.empty((rows, blocks.groups, blocks.out_features), dtype=torch.float32)
            y = fp8_gemm.triton_w8a16(o, blocks, out=out)
            ref = torch.einsum("tgk,gnk->tgn", o.float(), fp8_blocks.dequantize(blocks, torch.float32))
            kernel[label] = float((y - ref).abs().max() / ref.abs().max())
        result["triton_max_rel_vs_float32"] = kernel

        # A kernel that fails (a stand-in for a Triton build error on some GPU): with the bf16 weight
        # kept SGLang's path takes over; with DROP there is nothing to fall back to and the error stands.
        def broken(*_a, **_k):
            raise RuntimeError("stand-in kernel failure")

        fp8_gemm.grouped_w8a16 = broken
        o = torch.randn(6, g, loaded[0].shape[1], generator=gen).to(torch.bfloat16)
        try:
            out = dsv4._apply_wo_a_bf16_matmul(o, layers[0].wo_a.weight.view(g, r, -1), is_decode=False,
                                               is_target_verify=True, fast_path=True)
            result["after_kernel_failure"] = {
                "same_as_sglang": bool(torch.equal(out.view(torch.int16), original(
                    o, loaded[0].view(g, r, -1), is_decode=False, is_target_verify=True,
                    fast_path=True).view(torch.int16))), "kernel_failed": adapter.kernel_failed}
        except RuntimeError as e:
            result["after_kernel_failure"] = {"raised": str(e)}
    emit(result)


if __name__ == "__main__":
    main()
