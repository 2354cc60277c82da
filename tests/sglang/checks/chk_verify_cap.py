"""verify_cap on SGLang's real DSpark verify, draft and MoE routing modules (CPU torch).

argv: scratch directory, TP size (1 or 3: ranks over gloo). Every rank builds SGLang's own
DsparkVerifyEpilogue and TargetVerifyExecutor (the executor's target worker is a stand-in: it reads
only the model type from it, and a real one needs a GPU), then hands the adapter constructed draft
confidences the way DraftBlockProposer.propose returns them; ranks see confidences that differ in
the last bits, as all-reduced activations can. At TP 1 also:

- the DSpark draft model's confidence head in SGLang's static verify mode;
- the greedy accept, eager (accept_draft_tokens) and folded into the verify graph (the epilogue's
  run_static with its fused accept tail enabled), on constructed candidates and target logits;
- the sampled accept's draft distributions (_draft_probs);
- SGLang's router (MoEGate), hash routing (HashTopK) and grouped top-k (TopK) inside a target
  verify forward, against the same modules outside one.

Rank 0 prints the JSON summary with every rank's facts.
"""

import os
import sys
from types import SimpleNamespace

os.environ.setdefault("SGLANG_OPT_USE_FUSED_HASH_TOPK", "0")  # the CUDA JIT hash top-k; torch's on CPU
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit, installer, marked  # noqa: E402
from rankenv import dspark_config, end_rank, free_port, start_rank, v41_config  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

THRESHOLD = 0.1
GAMMA, STRIDE, VOCAB = 5, 6, 16
# Per request: k = 5, 3, 2 (0.5 x 0.2 = 0.1 on rank 0, just under T elsewhere), 1.
CONFIDENCE = [[0.9] * 5, [0.5] * 5, [0.5, 0.2, 0.9, 0.9, 0.9], [0.05, 0.9, 0.9, 0.9, 0.9]]


def marks():
    import sglang.srt.layers.moe.hash_topk as hash_topk
    import sglang.srt.models.deepseek_v2 as v2
    import sglang.srt.models.deepseek_v4 as dsv4
    import sglang.srt.models.deepseek_v4_dspark as v4_dspark
    from sglang.srt.speculative.dspark_components import dspark_draft, dspark_verify as dv

    return {
        "confidence_head": marked(v4_dspark.build_dspark_v4_confidence_head),
        "executor_init": marked(dv.TargetVerifyExecutor.__init__),
        "propose": marked(dspark_draft.DraftBlockProposer.propose),
        "accept_draft_tokens": marked(dv.accept_draft_tokens),
        "epilogue_accept": marked(dv.DsparkVerifyEpilogue._accept),
        "accept_tail": marked(dv.DsparkVerifyEpilogue._serves_accept_tail),
        "draft_probs": marked(dv._draft_probs),
        "target_forward": marked(dsv4.DeepseekV4ForCausalLM.forward),
        "gate": marked(v2.MoEGate.forward),
        "hash_topk": marked(hash_topk.HashTopK.forward),
    }


def executor_and_epilogue(fused_tail):
    from sglang.srt.distributed import get_tp_group
    from sglang.srt.speculative.dspark_components.dspark_verify import DsparkVerifyEpilogue, TargetVerifyExecutor
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync

    tp_sync = SpecTpSync(get_tp_group())
    epilogue = DsparkVerifyEpilogue(max_bs=8, verify_num_draft_tokens=STRIDE, device="cpu", tp_sync=tp_sync,
                                    fused_argmax=False, fused_accept_tail=fused_tail)
    target = SimpleNamespace(model_runner=SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=SimpleNamespace(model_type="deepseek_v41"))))
    executor = TargetVerifyExecutor(target_worker=target, gamma=GAMMA, verify_num_draft_tokens=STRIDE,
                                    model_runner=SimpleNamespace(device=torch.device("cpu")), kv_injector=None,
                                    tp_sync=tp_sync, verify_epilogue=epilogue)
    return executor, epilogue


def proposal(confidence):
    from sglang.srt.speculative.dspark_components.dspark_draft import DraftBlockResult, DraftProposal

    bs = confidence.shape[0]
    block = DraftBlockResult(draft_tokens=torch.zeros(bs, GAMMA, dtype=torch.int64), corrected_logits=None,
                             greedy_mask=torch.ones(bs, dtype=torch.bool), temperatures=torch.ones(bs),
                             greedy_draft=True)
    return DraftProposal(draft_block_ids=torch.zeros(bs, GAMMA, dtype=torch.int64), draft_block=block,
                         confidence=confidence)


def greedy_case():
    """Candidates and target logits: the target's argmax agrees with every draft of requests 0, 2
    and 3 and with the first draft only of request 1; each row's argmax is a distinct token."""
    g = torch.Generator().manual_seed(5)
    bs = len(CONFIDENCE)
    drafts = torch.randint(0, VOCAB, (bs, GAMMA), generator=g)
    candidates = torch.cat([torch.full((bs, 1), 3), drafts], dim=1)
    predict = torch.randint(0, VOCAB, (bs, STRIDE), generator=g)
    predict[:, :GAMMA] = drafts
    predict[1, 1] = (drafts[1, 1] + 1) % VOCAB
    logits = torch.randn(bs * STRIDE, VOCAB, generator=g)
    logits[torch.arange(bs * STRIDE), predict.view(-1)] = 50.0
    return candidates, logits, predict


def routing_case(state):
    import sglang.srt.models.deepseek_v4 as dsv4
    import sglang.srt.models.deepseek_v4_dspark as v4_dspark
    from sglang.srt.layers.moe.hash_topk import HashTopK
    from sglang.srt.layers.moe.topk import TopK
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.models.deepseek_v2 import MoEGate

    cfg = v41_config()
    torch.manual_seed(9)
    gate = MoEGate(cfg, None, prefix="layers.3.mlp.gate", is_deepseek_v4=True)
    with torch.no_grad():
        gate.weight.normal_(0, 0.5)
        gate.e_score_correction_bias.normal_(0, 0.1)
    hashed = HashTopK(topk=3, num_experts=cfg.n_routed_experts, vocab_size=cfg.vocab_size,
                      scoring_func="sqrtsoftplus", routed_scaling_factor=1.5,
                      apply_routed_scaling_factor_on_output=False, layer_id=0)
    grouped = TopK(top_k=3, layer_id=3, renormalize=True, use_grouped_topk=True, num_expert_group=1, topk_group=1,
                   scoring_func="sqrtsoftplus", correction_bias=gate.e_score_correction_bias, routed_scaling_factor=1.5)
    bs = len(CONFIDENCE)
    hidden = torch.randn(bs * STRIDE, cfg.hidden_size)
    input_ids = torch.randint(0, cfg.vocab_size, (bs * STRIDE,))

    def forward(_model, ids, _positions, _batch, rows=None):  # what every MoE layer of the target runs
        rows = rows or int(ids.shape[0])
        h, ids = hidden[:rows], ids[:rows]
        logits = gate(h)
        return {"hash": hashed(h, logits, ids).topk_ids.tolist(), "grouped": grouped(h, logits).topk_ids.tolist()}

    def split(*args):  # the MoE of a sequence-parallel split sees fewer rows than the step has
        return forward(*args, rows=3 * STRIDE)

    outside = forward(None, input_ids, None, None)
    out = {"outside": outside}
    if state is not None:
        target = dsv4.DeepseekV4ForCausalLM.__new__(dsv4.DeepseekV4ForCausalLM)
        draft = v4_dspark.DeepseekV4ForCausalLMDSpark.__new__(v4_dspark.DeepseekV4ForCausalLMDSpark)
        verify = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY)
        decode = SimpleNamespace(forward_mode=ForwardMode.DECODE)
        out["verify"] = state.around_target_forward(forward, target, input_ids, None, verify)
        out["decode"] = state.around_target_forward(forward, target, input_ids, None, decode)
        out["draft_verify"] = state.around_target_forward(forward, draft, input_ids, None, verify)
        out["verify_split_rows"] = state.around_target_forward(split, target, input_ids, None, verify)
        out["verify_odd_rows"] = state.around_target_forward(forward, target, input_ids[:-1], None, verify)
        out["remapped_gates"] = state.remapped_gates
        out["after_forward"] = state.routing() is None
    return out


def worker(rank, tp, root, port):
    start_rank(root, rank, tp, port)
    from sglang.srt.distributed import get_tp_group

    spec = installer().spec("verify_cap") if installer() else None
    state = spec.state if spec is not None else None
    facts = {"rank": rank, "marks": marks(), "fail_closed": None if spec is None else spec.fail_closed}
    executor, epilogue = executor_and_epilogue(fused_tail=True)
    if state is not None:
        facts["stride"] = state.stride
        facts["live_after_init"] = state.live[:4].tolist()
    confidence = torch.tensor(CONFIDENCE)
    if rank:
        confidence[2, 1] = 0.1999  # the running product lands just under T on this rank only
    facts["own_rule"] = [1 + _k(row) for row in confidence.tolist()]
    if state is not None:
        state.after_propose(proposal(confidence), None, bs=len(CONFIDENCE))
        facts["live"] = state.live[: len(CONFIDENCE)].tolist()
    if tp == 1:
        facts.update(single_rank(state, epilogue))
    world = get_tp_group().cpu_group
    gathered = [None] * tp
    dist.all_gather_object(gathered, facts, group=world)
    if rank == 0:
        emit({"ranks": gathered})
    end_rank()


def _k(row):
    from adapter.verify_cap import live_drafts

    return live_drafts(row, THRESHOLD)


def single_rank(state, epilogue):
    import sglang.srt.models.deepseek_v4_dspark as v4_dspark
    from sglang.srt.speculative.dspark_components import dspark_verify as dv
    from sglang.srt.speculative.dspark_components.dspark_draft import DraftBlockResult

    out = {}
    model = v4_dspark.DeepseekV4ForCausalLMDSpark(dspark_config(), None, "")
    out["confidence_head"] = None if model.confidence_head is None else type(model.confidence_head).__name__
    candidates, logits, predict = greedy_case()
    bs = candidates.shape[0]
    greedy = DraftBlockResult(draft_tokens=candidates[:, 1:], corrected_logits=None,
                              greedy_mask=torch.ones(bs, dtype=torch.bool), temperatures=torch.ones(bs),
                              greedy_draft=True)
    correct, bonus, trim = dv.accept_draft_tokens(
        candidates=candidates, target_logits=logits, draft_block=greedy, sampling_info=None, draft_input=None,
        gamma=GAMMA, verify_num_draft_tokens=STRIDE, cutoff_layout=None)
    out["eager"] = {"correct_len": correct.tolist(), "bonus": bonus.tolist(), "cap_trim": trim.tolist(),
                    "predict": predict.tolist()}
    io = dv.StaticVerifyIO(candidates=candidates, logits=logits, hidden=torch.zeros(bs * STRIDE, 4),
                           seq_lens=torch.full((bs,), 100), req_pool_indices=torch.arange(bs),
                           out_cache_loc=torch.arange(bs * STRIDE), positions=torch.arange(bs * STRIDE))
    out["folded_serves_tail"] = epilogue._serves_accept_tail(bs)
    epilogue.begin_static_step(bs, True)
    epilogue.run_static(io, accept=epilogue._accept_static_greedy, gate=epilogue.inject_gate_buf)
    folded = epilogue.read_accept(bs)
    out["folded"] = {"correct_len": folded.correct_len.tolist(), "bonus": folded.bonus.tolist(),
                     "commit_lens": folded.commit_lens.tolist(), "out_tokens": folded.out_tokens.tolist()}
    corrected = torch.randn(bs, GAMMA, VOCAB)
    sampled = DraftBlockResult(draft_tokens=candidates[:, 1:], corrected_logits=corrected,
                               greedy_mask=torch.zeros(bs, dtype=torch.bool), temperatures=torch.full((bs,), 0.7),
                               greedy_draft=False)
    probs = dv._draft_probs(sampled, VOCAB, torch.device("cpu"))
    want = torch.softmax(corrected / 0.7, dim=-1)
    out["draft_probs"] = {"zero_rows": [[int(j) for j in range(GAMMA) if bool((probs[i, j] == 0).all())]
                                        for i in range(bs)],
                          "live_rows_max_diff": float(max(((probs[i, j] - want[i, j]).abs().max())
                                                          for i in range(bs) for j in range(GAMMA)
                                                          if not bool((probs[i, j] == 0).all())))}
    out["routing"] = routing_case(state)
    return out


def main():
    root, tp = sys.argv[1], int(sys.argv[2])
    port = free_port()
    if tp == 1:
        worker(0, 1, root, port)
    else:
        mp.spawn(worker, args=(tp, root, port), nprocs=tp)


if __name__ == "__main__":
    main()
