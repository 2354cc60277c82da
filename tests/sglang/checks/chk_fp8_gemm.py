"""The adapters' W8A16 kernel (adapter/fp8_gemm.py) in Triton's interpreter on CPU tensors.

No argv. Every launch path against the float32 product of the dequantised weight
(fp8_blocks.reference_matmul on float32 x): the tl.dot path and the GEMV path (BLOCK_M < 16), split-K
1-8 (and more splits than K steps), row counts that are not a multiple of BLOCK_M (1 included),
output features that are not a multiple of BLOCK_N or of the 32-row scale block, reductions that are
not a multiple of BLOCK_K, strided activations, the wo_a and LM head tables at small scale, the bf16
output, determinism, and the Triton dequantisation against fp8_blocks.dequantize. Outputs are
float32 where compared tightly (the interpreter's bf16 store truncates where a GPU rounds).
"""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton: the kernels run on CPU tensors
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit  # noqa: E402

import torch  # noqa: E402


def main():
    from adapter import fp8_blocks, fp8_gemm
    from adapter.fp8_gemm import Tiles

    gen = torch.Generator().manual_seed(5)

    def weight(g, n, k):
        return fp8_blocks.quantize((torch.randn(g, n, k, generator=gen) * 0.05).to(torch.bfloat16))

    def act(m, g, k, stride=1):
        return torch.randn(m, g * stride, k, generator=gen).to(torch.bfloat16)[:, ::stride]

    def max_rel(y, ref):
        return float((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))

    def run(blocks, x, tiles):
        out = torch.empty((x.shape[0], blocks.groups, blocks.out_features), dtype=torch.float32)
        return fp8_gemm.triton_w8a16(x, blocks, tiles=tiles, out=out)

    cases = {}

    def case(label, g, n, k, m, tiles, stride=1, blocks=None):
        blocks = blocks or weight(g, n, k)
        x = act(m, blocks.groups, blocks.in_features, stride)
        ref = fp8_blocks.reference_matmul(x.float(), blocks)
        cases[label] = max_rel(run(blocks, x, tiles), ref)

    # The tl.dot path: split-K (3 splits of 4 K steps leave 2 that get columns; 8 is past the steps),
    # partial M, N and K tiles, one row.
    for split in (1, 2, 3, 4, 8):
        case(f"dot_split{split}_m5_n80_k256", 2, 80, 256, 5, Tiles(16, 32, 64, split_k=split))
    case("dot_m1", 2, 64, 256, 1, Tiles(16, 64, 128, split_k=2))
    case("dot_m17_bm16", 2, 64, 256, 17, Tiles(16, 64, 64, split_k=4))
    case("dot_m33_bm32_n40", 1, 40, 128, 33, Tiles(32, 16, 32, split_k=2))
    case("dot_k200_split2", 2, 48, 200, 7, Tiles(16, 32, 128, split_k=2))
    case("dot_k80_bk16", 3, 40, 80, 3, Tiles(16, 16, 16, split_k=3))
    case("dot_strided_x", 3, 40, 80, 7, Tiles(16, 32, 64, split_k=1), stride=2)
    # The GEMV path (no tl.dot): 1-8 rows per program, with and without split-K.
    case("gemv_m1", 2, 80, 256, 1, Tiles(1, 32, 128, split_k=1))
    case("gemv_m1_split4", 2, 64, 256, 1, Tiles(1, 64, 64, split_k=4))
    case("gemv_m3_bm4_n40", 2, 40, 128, 3, Tiles(4, 64, 256, split_k=2))
    case("gemv_m9_bm8_k200", 1, 96, 200, 9, Tiles(8, 32, 64, split_k=2))
    case("gemv_m2_strided", 3, 40, 80, 2, Tiles(2, 16, 32, split_k=2), stride=2)
    # The adapters' own tables at small scale: wo_a-like groups (NARROW) and an LM head (WIDE).
    wo_a = weight(4, 64, 512)
    for rows in (1, 6, 24, 48, 100):
        case(f"narrow_default_{rows}", 4, 64, 512, rows, None, blocks=wo_a)
    head = weight(1, 1000, 320)
    for most, tiles in fp8_gemm.WIDE:
        case(f"wide_table_{min(most, 64)}", 1, 1000, 320, min(most, 64) - 3, tiles, blocks=head)
    for rows in (5, 20):
        case(f"head_default_{rows}", 1, 1000, 320, rows, None, blocks=head)
    result = {"max_rel_vs_float32": cases}

    # The bf16 output (the adapters' dtype), and the same bits on a second call (fixed split order).
    x = act(6, 4, 512)
    y = fp8_gemm.triton_w8a16(x, wo_a, tiles=Tiles(16, 32, 64, split_k=4))
    again = fp8_gemm.triton_w8a16(x, wo_a, tiles=Tiles(16, 32, 64, split_k=4))
    result["bf16_out"] = {"dtype": str(y.dtype), "shape": list(y.shape),
                          "max_rel": max_rel(y, fp8_blocks.reference_matmul(x.float(), wo_a)),
                          "deterministic": bool(torch.equal(y.view(torch.int16), again.view(torch.int16)))}
    one = weight(1, 64, 512)
    hidden = act(5, 1, 512)[:, 0]
    result["linear_cpu_is_reference"] = bool(torch.equal(
        fp8_gemm.linear_w8a16(hidden, one), fp8_blocks.reference_matmul(hidden.unsqueeze(1), one).squeeze(1)))
    result["empty_rows"] = list(fp8_gemm.triton_w8a16(act(0, 4, 512), wo_a).shape)

    # Launch configurations: the tables, the shape classes, what tiles_for picks, what is refused.
    result["classes"] = {"wo_a": fp8_gemm.shape_class(1024, 4), "head": fp8_gemm.shape_class(43136, 1)}
    result["tiles_for"] = {f"{name}_{rows}": fp8_gemm.tiles_for(rows, n, k, g).label()
                           for name, (g, n, k) in (("wo_a", (4, 1024, 4096)), ("head", (1, 43136, 5120)))
                           for rows in (1, 6, 16, 17, 32, 64, 192, 768)}
    result["tables"] = {name: [[most, tiles.label()] for most, tiles in table]
                        for name, table in (("narrow", fp8_gemm.NARROW), ("wide", fp8_gemm.WIDE))}
    result["split_range"] = {f"{k}_{bk}_{s}": list(fp8_gemm.split_range(k, bk, s))
                             for k, bk, s in ((4096, 128, 8), (4096, 128, 16), (256, 64, 3), (200, 128, 2),
                                              (5120, 128, 1), (256, 128, 8))}
    refused = {}
    for label, make in (("block_m_3", lambda: Tiles(3, 32, 64)), ("dot_block_n_8", lambda: Tiles(16, 8, 64)),
                        ("split_0", lambda: Tiles(16, 32, 64, split_k=0)),
                        ("wrong_k", lambda: fp8_gemm.triton_w8a16(act(2, 4, 256), wo_a))):
        try:
            make()
            refused[label] = None
        except ValueError as e:
            refused[label] = str(e)
    result["refused"] = refused

    # The Triton dequantisation: the same values as fp8_blocks.dequantize, whole and partial tiles.
    same = {}
    for shape in ((2, 64, 256), (3, 40, 80), (1, 96, 320)):
        blocks = weight(*shape)
        for dtype in (torch.float32, torch.bfloat16):
            got = fp8_gemm.triton_dequantize(blocks, dtype)
            want = fp8_blocks.dequantize(blocks, dtype)
            same[f"{'x'.join(map(str, shape))}_{str(dtype)[6:]}"] = bool(
                got.dtype == want.dtype and torch.equal(got.float(), want.float()))
    # And fp8_blocks.dequantize (whole tiles in the output dtype) against the float32 route.
    blocks = weight(2, 64, 256)
    float_route = (blocks.weight.float().view(2, 2, 32, 8, 32) * blocks.scale[:, :, None, :, None]).view(2, 64, 256)
    same["torch_whole_tiles_bf16"] = bool(torch.equal(fp8_blocks.dequantize(blocks).view(torch.int16),
                                                      float_route.to(torch.bfloat16).view(torch.int16)))
    same["cpu_dispatch_is_torch"] = bool(torch.equal(fp8_gemm.dequantize(blocks), fp8_blocks.dequantize(blocks)))
    result["dequant_same"] = same
    emit(result)


if __name__ == "__main__":
    main()
