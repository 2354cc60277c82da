"""draft_head_fp8 on SGLang's real DSpark draft (CPU torch, TP 1).

argv: a scratch directory. Builds SGLang's DeepseekV4ForCausalLMDSpark at small sizes, a bf16
ParallelLMHead and embedding as the target's, and hands them to the draft the way the DSpark worker
does (attach_shared_modules). Then the draft's logits (compute_base_logits, the function its sampler
and proposer call) with the adapter against the same logits through SGLang's own projection (the
wrapped original), and the head's weight before and after.
"""

import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit, installer, marked  # noqa: E402
from rankenv import dspark_config, start_rank  # noqa: E402

import torch  # noqa: E402

ROWS = (5, 10, 20)


def main():
    start_rank(sys.argv[1])
    import sglang.srt.models.deepseek_v4_dspark as v4_dspark
    import sglang.srt.models.dspark as dspark
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    cfg = dspark_config()
    torch.manual_seed(3)
    model = v4_dspark.DeepseekV4ForCausalLMDSpark(cfg, None, "")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn_like(p) * 0.05)
    head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, params_dtype=torch.bfloat16, prefix="lm_head")
    embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, params_dtype=torch.bfloat16, prefix="embed")
    with torch.no_grad():
        head.weight.copy_((torch.randn(head.weight.shape) * 0.05).to(torch.bfloat16))
    before = head.weight.detach().clone()
    pointer = head.weight.data_ptr()
    model.attach_shared_modules(embed_tokens=embed, lm_head=head)

    spec = installer().spec("draft_head_fp8") if installer() else None
    adapter = spec.state if spec is not None else None
    result = {"marked_project": marked(dspark.project_through_lm_head),
              "marked_attach": marked(v4_dspark.DeepseekV4ForCausalLMDSpark.attach_shared_modules),
              "draft_calls_the_hooked_function": v4_dspark.project_through_lm_head is dspark.project_through_lm_head,
              "head_shape": list(head.weight.shape),
              "copy": None if adapter is None or adapter.copy_of(head) is None else {
                  "shape": list(adapter.copy_of(head).weight.shape), "bytes": adapter.copy_of(head).nbytes,
                  "dtype": str(adapter.copy_of(head).weight.dtype)}}
    original = getattr(dspark.project_through_lm_head, "__wrapped__", dspark.project_through_lm_head)
    logits = {}
    torch.set_grad_enabled(False)
    for rows in ROWS:
        x = torch.randn(rows, model.hc_mult, cfg.hidden_size).to(torch.bfloat16)
        calls = adapter.fp8_calls if adapter else 0
        got, x_post_hc = model.compute_base_logits(x)
        # SGLang's own draft logits from the same activations: the last stage's norm, the bf16 head.
        normed = model.stages[-1].norm(x_post_hc)
        want = original(normed, head)
        if not model._opt_markov_w2_tp_shard:  # SGLang gathers and crops unless the Markov w2 is sharded
            want = dspark.gather_and_crop_vocab(want, head)
        ref = torch.matmul(normed.float(), head.weight.float().T)[..., : want.shape[-1]]
        logits[str(rows)] = {
            "fp8": bool(adapter and adapter.fp8_calls > calls), "shape": list(got.shape),
            "same_as_sglang": bool(torch.equal(got.view(torch.int16), want.view(torch.int16))),
            "rel_vs_float32": float((got.float() - ref).norm() / ref.norm()),
            "sglang_rel_vs_float32": float((want.float() - ref).norm() / ref.norm()),
            "argmax_agrees": float((got.float().argmax(-1) == want.float().argmax(-1)).float().mean()),
        }
    result["logits"] = logits
    if adapter is not None and adapter.copy_of(head) is not None:
        # A kernel that fails (a stand-in for a Triton build error on some GPU): the bf16 head serves.
        from adapter import fp8_gemm

        def broken(*_a, **_k):
            raise RuntimeError("stand-in kernel failure")

        fp8_gemm.linear_w8a16 = broken
        x = torch.randn(5, model.hc_mult, cfg.hidden_size).to(torch.bfloat16)
        got, x_post_hc = model.compute_base_logits(x)
        want = original(model.stages[-1].norm(x_post_hc), head)
        if not model._opt_markov_w2_tp_shard:
            want = dspark.gather_and_crop_vocab(want, head)
        result["after_kernel_failure"] = {"same_as_sglang": bool(torch.equal(got.view(torch.int16), want.view(torch.int16))),
                                          "kernel_failed": adapter.kernel_failed}
    result["head_unchanged"] = bool(torch.equal(head.weight.view(torch.int16), before.view(torch.int16))) \
        and head.weight.data_ptr() == pointer
    emit(result)


if __name__ == "__main__":
    main()
