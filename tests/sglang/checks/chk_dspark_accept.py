"""block_verify, draft_tau and folded_fence on SGLang's real DSpark verify and draft modules (CPU
torch, TP 1; the rejection kernel in Triton's interpreter).

argv: a scratch directory. Builds SGLang's own DsparkVerifyEpilogue, TargetVerifyExecutor and
DsparkSamplingAcceptGraph as the DSpark worker does (block_verification from SGLang's server
argument, False by default; the executor's target worker is a stand-in that answers the model type),
then:

- block_verify: the flag each constructor kept, and a sampled eager accept through the executor
  against accept_draft_tokens with block verification on and off (same random draws);
- draft_tau: SGLang's resolve_draft_params (eager tensors and the draft graph's staged buffers), the
  sampled accept's draft distributions (_draft_probs) and the block-wise rejection kernel's draft
  temperatures;
- folded_fence: the folded accept (accept_and_finalize with folded_accept) after the greedy accept
  ran into the epilogue's buffers, before and after the next step overwrites them.
"""

import os
import sys
from types import SimpleNamespace

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit, installer, marked  # noqa: E402
from rankenv import start_rank  # noqa: E402

import torch  # noqa: E402

GAMMA, STRIDE, VOCAB = 5, 6, 8


def state_of(name):
    spec = installer().spec(name) if installer() else None
    return None if spec is None else spec.state


def build():
    from sglang.srt.distributed import get_tp_group
    from sglang.srt.speculative.dspark_components.dspark_sampling_accept_graph import DsparkSamplingAcceptGraph
    from sglang.srt.speculative.dspark_components.dspark_verify import DsparkVerifyEpilogue, TargetVerifyExecutor
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync

    tp_sync = SpecTpSync(get_tp_group())
    epilogue = DsparkVerifyEpilogue(max_bs=8, verify_num_draft_tokens=STRIDE, device="cpu", tp_sync=tp_sync)
    target = SimpleNamespace(model_runner=SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=SimpleNamespace(model_type="deepseek_v41"))))
    executor = TargetVerifyExecutor(target_worker=target, gamma=GAMMA, verify_num_draft_tokens=STRIDE,
                                    model_runner=SimpleNamespace(device=torch.device("cpu")), kv_injector=None,
                                    tp_sync=tp_sync, verify_epilogue=epilogue, block_verification=False)
    region = DsparkSamplingAcceptGraph(epilogue=epilogue, resolve_draft_sampler=lambda: None, tp_sync=tp_sync,
                                       fused_argmax=False, block_verification=False, device="cpu")
    return executor, epilogue, region


def sampled_batch(bs, seed):
    from sglang.srt.speculative.dspark_components.dspark_draft import DraftBlockResult

    g = torch.Generator().manual_seed(seed)
    corrected = torch.randn(bs, GAMMA, VOCAB, generator=g)
    drafts = torch.multinomial(torch.softmax(corrected, -1).view(-1, VOCAB), 1, generator=g).view(bs, GAMMA)
    candidates = torch.cat([torch.zeros(bs, 1, dtype=torch.int64), drafts], dim=1)
    # The target agrees with the draft up to noise, and has a row for the bonus token.
    target = torch.cat([corrected, torch.randn(bs, 1, VOCAB, generator=g)], dim=1)
    logits = (target + 0.7 * torch.randn(bs, STRIDE, VOCAB, generator=g)).reshape(bs * STRIDE, VOCAB)
    block = DraftBlockResult(draft_tokens=drafts, corrected_logits=corrected,
                             greedy_mask=torch.zeros(bs, dtype=torch.bool), temperatures=torch.full((bs,), 0.8),
                             greedy_draft=False)
    return candidates, logits, block


def block_verify(executor, region):
    from sglang.srt.speculative.dspark_components import dspark_verify as dv
    from sglang.srt.speculative.dspark_components.dspark_sampling_accept_graph import GraphSamplingInfo

    out = {"executor": executor._block_verification, "region": region._block_verification,
           "marked_executor": marked(dv.TargetVerifyExecutor.__init__)}
    bs = 48
    candidates, logits, block = sampled_batch(bs, 1)
    info = GraphSamplingInfo(temperatures=torch.full((bs,), 0.8))
    runs = {}
    for name in ("executor", "block", "token"):
        torch.manual_seed(42)  # the kernel's uniform draws
        if name == "executor":
            accept = executor.accept_and_finalize(
                folded_accept=False, bs=bs, verify_ids_2d=candidates, target_logits=logits, draft_block=block,
                sampling_info=info, draft_input=None, layout=None, prefix_lens=torch.full((bs,), 10),
                draft_tokens=candidates[:, 1:])
            runs[name] = accept.correct_len.tolist()
        else:
            correct, _, _ = dv.accept_draft_tokens(candidates=candidates, target_logits=logits, draft_block=block,
                                                   sampling_info=info, draft_input=None, gamma=GAMMA,
                                                   verify_num_draft_tokens=STRIDE, block_verification=name == "block")
            runs[name] = correct.tolist()
    out["executor_equals_block"] = runs["executor"] == runs["block"]
    out["executor_equals_token"] = runs["executor"] == runs["token"]
    out["block_differs_from_token"] = runs["block"] != runs["token"]
    out["mean_accepted"] = {k: sum(v) / len(v) for k, v in runs.items()}
    return out


def draft_tau():
    from sglang.kernels.ops.speculative.dspark import blockwise_rejection as br
    from sglang.srt.speculative.dspark_components import dspark_draft, dspark_verify as dv
    from sglang.srt.speculative.dspark_components.dspark_draft import DraftParams

    temps = torch.tensor([0.7, 1.0, 0.5, 0.9])
    info = SimpleNamespace(temperatures=temps.view(-1, 1), top_ks=torch.tensor([50, 1, 20, 1]))
    eager = dspark_draft.resolve_draft_params(sampling_info=info, bs=4, device=torch.device("cpu"))
    staged = DraftParams(torch.ones(8), torch.ones(8, dtype=torch.bool), torch.zeros(8))
    dspark_draft.resolve_draft_params(sampling_info=info, bs=4, out=staged)
    out = {"marked_resolve": marked(dspark_draft.resolve_draft_params),
           "eager_step": eager.step_temperatures.tolist(), "eager_temperatures": eager.temperatures.tolist(),
           "staged_step": staged.step_temperatures[:4].tolist(), "staged_temperatures": staged.temperatures[:4].tolist()}
    bs = 4
    candidates, logits, block = sampled_batch(bs, 2)
    probs = dv._draft_probs(block, VOCAB, torch.device("cpu"))
    out["draft_probs_temperature"] = [
        t for t in (0.8, 0.4, 0.8 * 0.7) if torch.allclose(probs, torch.softmax(block.corrected_logits / t, -1), atol=1e-6)]
    noise = br.make_rejection_noise(7, torch.device("cpu"))
    common = dict(candidates=candidates, target_logits=logits, draft_logits=block.corrected_logits,
                  target_temperatures=torch.full((bs,), 0.8))
    got = br.BlockwiseRejection.execute(**common, draft_temperatures=block.temperatures, noise=noise)
    at = {}
    for t in (0.8, 0.4):
        twin = br.make_rejection_noise(7, torch.device("cpu"))
        want = br.blockwise_rejection_torch(**common, draft_temperatures=torch.full((bs,), t), noise=twin)
        at[str(t)] = all(bool(torch.equal(a, b)) for a, b in zip(got, want))
    out["blockwise_equals_draft_temperature"] = at
    return out


def fence(executor, epilogue):
    from sglang.srt.speculative.dspark_components import dspark_verify as dv

    out = {"marked_accept": marked(dv.TargetVerifyExecutor.accept_and_finalize)}
    bs = 3

    def step(accept_all, cutoff):
        gg = torch.Generator().manual_seed(1)
        candidates = torch.randint(0, VOCAB, (bs, STRIDE), generator=gg)
        logits = torch.randn(bs * STRIDE, VOCAB, generator=gg)
        wanted = candidates.roll(-1, 1) if accept_all else (candidates.roll(-1, 1) + 1) % VOCAB
        logits[torch.arange(bs * STRIDE), wanted.view(-1)] += 100  # the target's argmax
        epilogue._accept(candidates=candidates, logits=logits, draft_tokens=candidates[:, 1:].contiguous(),
                         seq_lens=torch.full((bs,), 20), cutoff_verify_lens=cutoff)

    def folded():
        return executor.accept_and_finalize(
            folded_accept=True, bs=bs, verify_ids_2d=None, target_logits=None, draft_block=None, sampling_info=None,
            draft_input=None, layout=None, prefix_lens=None, draft_tokens=None)

    step(True, torch.full((bs,), 3))  # every draft right, capped at 2: trimmed
    first = folded()
    buffers = epilogue.read_accept(bs)
    fields = first.__struct_fields__
    out["fields"] = list(fields)
    out["equal_to_buffers"] = all(bool(torch.equal(getattr(first, f), getattr(buffers, f))) for f in fields)
    out["own_memory"] = [getattr(first, f).data_ptr() != getattr(buffers, f).data_ptr() for f in fields]
    kept = {f: getattr(first, f).clone() for f in fields}
    step(False, None)  # the next step's replay writes the same buffers: nothing accepted
    out["changed_by_next_step"] = [not torch.equal(kept[f], getattr(epilogue.read_accept(bs), f)) for f in fields]
    out["kept_after_next_step"] = [bool(torch.equal(kept[f], getattr(first, f))) for f in fields]
    return out


def main():
    start_rank(sys.argv[1])
    executor, epilogue, region = build()
    emit({"block_verify": block_verify(executor, region), "draft_tau": draft_tau(), "fence": fence(executor, epilogue),
          "states": {n: state_of(n) is not None for n in ("block_verify", "draft_tau", "folded_fence")}})


if __name__ == "__main__":
    main()
