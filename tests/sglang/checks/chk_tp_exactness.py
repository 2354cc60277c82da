"""Exactness of the TP padding: a layer stack shaped like DeepSeek-V4.1-Flash's, computed unpadded
in one process and padded + sharded over `tp` processes (torch.distributed, gloo, CPU).

argv: tp, scratch directory, and optionally "leaky" (a negative control: the padded rows of wo_a
and the padded columns of wo_b get 0.1 instead of 0, which must show up in the outputs; either
zero block alone already cuts the padded heads off).

The stack: block-FP8 query projection by heads (64 heads of 8 per output group), single-KV
attention with per-head sinks, grouped output projection wo_a (column-parallel by group), wo_b
(row-parallel), the 129,280-token vocab projection (vocab-parallel, gathered), and a router over
the 128 draft experts (expert-parallel, top-6, selection bias). Padding uses the adapter's own
plan and tensor functions (adapter.tp_padding, adapter.tp_padding_torch), the same ones the
loader hooks apply to checkpoint tensors.
"""

import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from adapter.tp_padding import ModelDims, plan_padding  # noqa: E402
from adapter.tp_padding_torch import dequant_block, fill_for, pad_dim, shard  # noqa: E402

HEADS, GROUPS, VOCAB, EXPERTS, TOPK = 64, 8, 129_280, 128, 6
HIDDEN, Q_LORA, HEAD_DIM, O_LORA, KV_LEN, TOKENS, BLOCK = 64, 32, 16, 8, 7, 5, 16
DTYPE = torch.float64


def weights() -> dict:
    g = torch.Generator().manual_seed(1234)

    def rnd(*shape, scale=0.2):
        return torch.randn(*shape, generator=g, dtype=DTYPE) * scale

    # Block-FP8 query projection: fp8 values with one positive scale per 16x16 block.
    wq_b_scale = torch.rand(HEADS * HEAD_DIM // BLOCK, Q_LORA // BLOCK, generator=g, dtype=DTYPE) * 0.02 + 0.01
    wq_b_real = rnd(HEADS * HEAD_DIM, Q_LORA, scale=1.0)
    s_full = wq_b_scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    wq_b_fp8 = (wq_b_real * s_full.reciprocal() * 0.01).to(torch.float8_e4m3fn)
    return {
        "x": rnd(TOKENS, HIDDEN, scale=1.0),
        "wq_a": rnd(Q_LORA, HIDDEN),
        "wq_b_fp8": wq_b_fp8,
        "wq_b_scale": wq_b_scale,
        "sink": rnd(HEADS, scale=1.0),
        "k": rnd(KV_LEN, HEAD_DIM, scale=1.0),
        "v": rnd(KV_LEN, HEAD_DIM, scale=1.0),
        "wo_a": rnd(GROUPS * O_LORA, (HEADS // GROUPS) * HEAD_DIM),
        "wo_b": rnd(HIDDEN, GROUPS * O_LORA),
        "lm_head": rnd(VOCAB, HIDDEN),
        "gate": rnd(EXPERTS, HIDDEN),
        "bias": rnd(EXPERTS, scale=0.05),
        "experts": rnd(EXPERTS, HIDDEN, HIDDEN, scale=0.05),
    }


def attention(q_lora, wq_b, sink, k, v):
    """Per-head attention with a sink logit; heads are independent of each other."""
    q = (q_lora @ wq_b.t()).view(TOKENS, -1, HEAD_DIM)
    logits = torch.einsum("thd,sd->ths", q, k) * HEAD_DIM**-0.5
    logits = torch.cat([logits, sink.view(1, -1, 1).expand(TOKENS, -1, 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :KV_LEN]
    return torch.einsum("ths,sd->thd", probs, v)


def grouped_wo_a(o, wo_a):
    groups = wo_a.shape[0] // O_LORA
    og = o.reshape(TOKENS, groups, -1)
    return torch.einsum("tgi,goi->tgo", og, wo_a.view(groups, O_LORA, -1)).reshape(TOKENS, groups * O_LORA)


def route(h, gate, bias):
    scores = torch.sigmoid(h @ gate.t())
    chosen = torch.topk(scores + bias, TOPK, dim=-1).indices
    picked = torch.gather(scores, 1, chosen)
    return chosen, picked / picked.sum(dim=-1, keepdim=True)


def moe(h, chosen, weight, experts, first_expert):
    out = torch.zeros_like(h)
    for t in range(TOKENS):
        for slot in range(TOPK):
            e = int(chosen[t, slot]) - first_expert
            if 0 <= e < experts.shape[0]:
                out[t] += weight[t, slot] * (experts[e] @ h[t])
    return out


def reference(w: dict) -> dict:
    q_lora = w["x"] @ w["wq_a"].t()
    wq_b = dequant_block(w["wq_b_fp8"], w["wq_b_scale"], (BLOCK, BLOCK)).to(DTYPE)
    o = attention(q_lora, wq_b, w["sink"], w["k"], w["v"])
    attn = grouped_wo_a(o, w["wo_a"]) @ w["wo_b"].t()
    h = w["x"] + attn
    chosen, weight = route(h, w["gate"], w["bias"])
    return {"attn": attn, "logits": h @ w["lm_head"].t(), "moe": moe(h, chosen, weight, w["experts"], 0)}


def worker(rank: int, tp: int, port: int, scratch: str, leaky: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    w = torch.load(Path(scratch) / "weights.pt")
    plan = plan_padding(ModelDims(HEADS, GROUPS, VOCAB, EXPERTS), tp)
    hd = HEAD_DIM

    # Pad the checkpoint tensors along their sharded dimension, as the loader hooks do, then cut
    # out this rank's slice, as SGLang's loaders do.
    def padded(t, dim, size, kind, scale=False):
        return pad_dim(t, dim, size, fill_for(kind, scale, t.dim()))

    wq_b_fp8 = shard(padded(w["wq_b_fp8"], 0, plan.padded_heads * hd, "attention"), 0, rank, tp)
    wq_b_scale_full = padded(w["wq_b_scale"], 0, plan.padded_heads * hd // BLOCK, "attention", scale=True)
    wq_b_scale = shard(wq_b_scale_full, 0, rank, tp)
    sink = shard(padded(w["sink"], 0, plan.padded_heads, "attention"), 0, rank, tp)
    wo_a_full = padded(w["wo_a"], 0, plan.padded_groups * O_LORA, "attention")
    if leaky:
        wo_a_full = torch.cat([w["wo_a"], torch.full_like(wo_a_full[w["wo_a"].shape[0] :], 0.1)])
    wo_a = shard(wo_a_full, 0, rank, tp)
    wo_b_full = padded(w["wo_b"], 1, plan.padded_groups * O_LORA, "attention")
    if leaky:
        wo_b_full = torch.cat([w["wo_b"], torch.full_like(wo_b_full[:, w["wo_b"].shape[1] :], 0.1)], dim=1)
    wo_b = shard(wo_b_full, 1, rank, tp)
    lm_head = shard(padded(w["lm_head"], 0, plan.padded_vocab, "vocab"), 0, rank, tp)
    gate = padded(w["gate"], 0, plan.padded_draft_experts, "experts")
    bias = padded(w["bias"], 0, plan.padded_draft_experts, "experts")
    experts = shard(padded(w["experts"], 0, plan.padded_draft_experts, "experts"), 0, rank, tp)

    q_lora = w["x"] @ w["wq_a"].t()
    wq_b = dequant_block(wq_b_fp8, wq_b_scale, (BLOCK, BLOCK)).to(DTYPE)  # the kernel's view
    o = attention(q_lora, wq_b, sink, w["k"], w["v"])
    attn = grouped_wo_a(o, wo_a) @ wo_b.t()
    dist.all_reduce(attn)
    h = w["x"] + attn
    local_logits = h @ lm_head.t()
    parts = [torch.empty_like(local_logits) for _ in range(tp)]
    dist.all_gather(parts, local_logits)
    logits = torch.cat(parts, dim=1)[:, :VOCAB]
    chosen, weight = route(h, gate, bias)
    out = moe(h, chosen, weight, experts, rank * experts.shape[0])
    dist.all_reduce(out)

    local = plan.head_range(rank)
    pad_local = [i - local.start for i in local if i >= HEADS]
    info = {
        "local_heads": wq_b.shape[0] // hd,
        "padded_heads": len(pad_local),
        # Padded heads have q = 0, so they attend uniformly and output the mean of V, not zero:
        # their contribution vanishes only through the zero rows of wo_a.
        "padded_heads_attend": bool(o[:, pad_local].abs().sum() > 0) if pad_local else None,
        "scales_positive": bool((wq_b_scale_full > 0).all()),
        "padded_expert_chosen": bool((chosen >= EXPERTS).any()),
    }
    if rank == 0:
        torch.save({"attn": attn, "logits": logits, "moe": out}, Path(scratch) / "sharded.pt")
    torch.save(info, Path(scratch) / f"info{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    tp, scratch = int(sys.argv[1]), Path(sys.argv[2])
    leaky = len(sys.argv) > 3 and sys.argv[3] == "leaky"
    scratch.mkdir(parents=True, exist_ok=True)
    w = weights()
    torch.save(w, scratch / "weights.pt")
    ref = reference(w)
    mp.start_processes(worker, args=(tp, free_port(), str(scratch), leaky), nprocs=tp, start_method="spawn", join=True)
    got = torch.load(scratch / "sharded.pt")
    plan = plan_padding(ModelDims(HEADS, GROUPS, VOCAB, EXPERTS), tp)
    errors = {}
    for key in ("attn", "logits", "moe"):
        diff = float((got[key] - ref[key]).abs().max())
        errors[key] = {"max_abs": diff, "ref_max": float(ref[key].abs().max()), "shape": list(got[key].shape)}
    emit(
        {
            "tp": tp,
            "plan": plan.as_dict(),
            "errors": errors,
            "ranks": [torch.load(scratch / f"info{r}.pt") for r in range(tp)],
        }
    )


if __name__ == "__main__":
    main()
