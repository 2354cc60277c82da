"""SGLang's sampled DSpark accept (dspark_verify.accept_draft_tokens -> AcceptSampling -> the chain
rejection kernel, run by Triton's interpreter) on constructed distributions, for the losslessness of
block verification and of the verify cap's sampled rows.

argv: scratch directory, then runs as NAME:MODE:CUT:TAU, MODE block or token, CUT none (every draft
verified), adapter (the verify cap's own cutoff: the adapter must be armed with conf:0.2, which the
confidences below turn into k = 2 for every request) or native (SGLang's cutoff at k = 2 passed
without the adapter); TAU the factor the drafts were sampled at (q_i at temperature TAU; the accept
is told the request's temperature 1, as SGLang tells it: draft_tau must scale it).

Every request drafts GAMMA = 5 tokens, each from a fixed draft distribution q_i over 3 tokens; the
target's distribution at position i is a fixed p_i (a target whose conditionals do not depend on the
prefix: its sequences are independent tokens). Under a cut the target rows of the dead positions are
garbage (one-hot on the drafted token), as after the verify cap's expert remap. The run emits, per
request, the first three tokens of the output sequence (accepted drafts, the bonus token, then fresh
target draws for positions the step did not reach) and the chi-square statistic of their joint
against p_0 x p_1 x p_2.
"""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # SGLang's rejection kernel on CPU tensors
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit, installer  # noqa: E402
from rankenv import start_rank  # noqa: E402

import torch  # noqa: E402

GAMMA, STRIDE, VOCAB, K, TRIALS = 5, 6, 3, 2, 900
P = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.7, 0.2, 0.1], [0.3, 0.3, 0.4], [0.1, 0.6, 0.3],
                  [0.4, 0.4, 0.2]])
Q = torch.tensor([[0.5, 0.3, 0.2], [0.3, 0.4, 0.3], [0.1, 0.2, 0.7], [0.3, 0.4, 0.3], [0.2, 0.5, 0.3]])


def chi_square(tokens):
    """Pearson's statistic of the (Y1, Y2, Y3) counts against p_0 x p_1 x p_2 (26 degrees of freedom)."""
    want = (P[0][:, None, None] * P[1][None, :, None] * P[2][None, None, :]).flatten() * tokens.shape[0]
    cells = tokens[:, 0] * VOCAB * VOCAB + tokens[:, 1] * VOCAB + tokens[:, 2]
    got = torch.bincount(cells, minlength=VOCAB**3).float()
    return float(((got - want) ** 2 / want).sum())


def run(mode, cut, tau, state, seed):
    from sglang.srt.speculative.dspark_components import dspark_verify as dv
    from sglang.srt.speculative.dspark_components.dspark_draft import DraftBlockResult, DraftProposal
    from sglang.srt.speculative.dspark_components.dspark_sampling_accept_graph import GraphSamplingInfo
    from sglang.srt.speculative.ragged_verify import RaggedVerifyLayout

    torch.manual_seed(seed)
    n = TRIALS
    sampled_from = torch.softmax(Q.log() / tau, dim=-1)
    drafts = torch.stack([torch.multinomial(sampled_from[i], n, replacement=True) for i in range(GAMMA)], dim=1)
    candidates = torch.cat([torch.zeros(n, 1, dtype=torch.int64), drafts], dim=1)
    target = P.log().repeat(n, 1, 1)  # [n, 6, V]
    if cut != "none":
        # Dead rows K+1..5 hold garbage: all mass on the draft that row verifies (row j verifies
        # drafts[:, j]; row 5 only samples the bonus).
        for row in range(K + 1, STRIDE):
            garbage = torch.full((n, VOCAB), -30.0)
            garbage[torch.arange(n), drafts[:, row] if row < GAMMA else 0] = 0.0
            target[:, row] = garbage
    block = DraftBlockResult(draft_tokens=drafts, corrected_logits=Q.log().repeat(n, 1, 1),
                             greedy_mask=torch.zeros(n, dtype=torch.bool), temperatures=torch.ones(n),
                             greedy_draft=False)
    layout = None
    if cut == "adapter":
        state.after_propose(DraftProposal(draft_block_ids=candidates[:, :GAMMA], draft_block=block,
                                          confidence=torch.full((n, GAMMA), 0.5)), None, bs=n)
    elif cut == "native":
        layout = RaggedVerifyLayout.from_verify_lens_device(verify_lens=torch.full((n,), K + 1, dtype=torch.int32),
                                                            graph_num_tokens=n * (K + 1))
    correct, bonus, trim = dv.accept_draft_tokens(
        candidates=candidates, target_logits=target.view(n * STRIDE, VOCAB), draft_block=block,
        sampling_info=GraphSamplingInfo(temperatures=torch.ones(n)), draft_input=None, gamma=GAMMA,
        verify_num_draft_tokens=STRIDE, cutoff_layout=layout, block_verification=mode == "block")
    fresh = torch.stack([torch.multinomial(P[i], n, replacement=True) for i in range(3)], dim=1)
    tokens = fresh.clone()
    for r in range(n):
        emitted = drafts[r, : int(correct[r])].tolist() + [int(bonus[r])]
        for i, t in enumerate(emitted[:3]):
            tokens[r, i] = t
    return {"chi_square": chi_square(tokens), "lengths": torch.bincount(correct.long(), minlength=STRIDE).tolist(),
            "cap_trimmed": int((trim > 0).sum())}


def main():
    start_rank(sys.argv[1])
    spec = installer().spec("verify_cap") if installer() else None
    state = spec.state if spec is not None else None
    if state is not None:
        from types import SimpleNamespace

        # The buffer the adapter allocates when SGLang builds the executor, for TRIALS requests.
        state.after_executor_init(None, SimpleNamespace(verify_num_draft_tokens=STRIDE,
                                                        model_runner=SimpleNamespace(device=torch.device("cpu"))))
    out = {}
    for index, item in enumerate(sys.argv[2:]):
        name, mode, cut, tau = item.split(":")
        out[name] = run(mode, cut, float(tau), state, seed=100 + index)
    emit(out)


if __name__ == "__main__":
    main()
