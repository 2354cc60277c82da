"""verify_cap: DSpark verifies the fixed block, but accepts at most k drafts per request, k from the
draft's confidence (DSV41_VERIFY_CAP=conf:<T>).

The target verify keeps SGLang's static [bs, block + 1] rectangle (anchor + 5 drafts at
DSPARK_BLOCK_SIZE=5). Per request, k is the number of leading drafts whose running product of the
draft confidence head's survival estimates stays >= T (at least 1). The head's estimate for draft i
is computed from the drafts before i only, so the cut is a stopping rule: it never looks at a token
it drops, and a capped verify commits exactly what a verify of k drafts would. The live length is
1 + k rows; the dead rows (k+1..5) are never committed, and live rows attend only to earlier rows.
The saving: the dead rows' router inputs are replaced by their anchor row's, so they add no experts
to the set each MoE layer streams (MoE is bandwidth-bound at decode). Hooks, SGLang 0.5.23:

- AROUND deepseek_v4_dspark.build_dspark_v4_confidence_head: SGLang builds the confidence head
  only in its ragged-verify modes; the cap builds it in the static mode too (the checkpoint's
  confidence_head weights then load, and SGLang refuses a checkpoint without them).
- AFTER dspark_verify.TargetVerifyExecutor.__init__: the live-length buffer ([rows] int64, filled
  with block + 1), before any CUDA graph is captured; CUDA graphs read it by address.
- AFTER dspark_draft.DraftBlockProposer.propose: k from the proposal's confidence into the buffer,
  then rank 0's buffer to every rank (the confidence comes from all-reduced activations that may
  differ in the last bits; ranks must agree on what they accept and route).
- AROUND dspark_verify.accept_draft_tokens and DsparkVerifyEpilogue._accept (the eager accept, the
  sampling-accept region and the greedy accept folded into the verify graph): the buffer as SGLang's
  own cutoff (CapCorrectLen: accepted drafts capped at k, the bonus token from row k).
- AROUND DsparkVerifyEpilogue._serves_accept_tail: False, since the fused static accept tail never
  caps; the folded greedy accept then runs _accept.
- AFTER dspark_verify._draft_probs: draft probabilities of dead rows set to 0, so a sampled accept,
  token by token or by block verification (DSV41_BLOCK_VERIFY), treats the block as k drafts long
  (q = 0 rejects; the bonus is sampled from the target at row k).
- AROUND DeepseekV4ForCausalLM.forward (target verify forwards only) with AFTER
  deepseek_v2.MoEGate.forward and BEFORE hash_topk.HashTopK.forward: dead rows take their anchor's
  router logits (and, in hash-routed layers, its token id), so they route to the anchor's experts.
  Only when the MoE sees all verify rows of the step (no sequence-parallel split).

Requires SGLANG_RAGGED_VERIFY_MODE=static (SGLang's default): the ragged modes schedule verify
lengths themselves. The adapter is fail_closed: a rank without it would accept and route differently.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from adapter.patching import AFTER, AROUND, BEFORE, ON_IMPORT, AdapterSpec, Patch, Refused, refusing
from dsv41 import rankadapters
from dsv41.adapterlog import AdapterLog
from dsv41.ranksettings import SettingError

NAME = "verify_cap"
KEY = rankadapters.DSV41_VERIFY_CAP.name
MODE_KEY = rankadapters.SGLANG_RAGGED_VERIFY_MODE.name
# The variables build() reads: dsv41ctl config check reports any other adapter key as no effect.
ENV_KEYS = rankadapters.BY_NAME[NAME].keys  # every variable build() reads, declared in dsv41
MODEL = "sglang.srt.models.deepseek_v4"
DRAFT_MODEL = "sglang.srt.models.deepseek_v4_dspark"
V2 = "sglang.srt.models.deepseek_v2"
HASH_TOPK = "sglang.srt.layers.moe.hash_topk"
VERIFY = "sglang.srt.speculative.dspark_components.dspark_verify"
DRAFT = "sglang.srt.speculative.dspark_components.dspark_draft"
MIN_DRAFTS = 1  # the first draft is always verified
LIVE_ROWS = 4096  # requests the live-length buffer holds (32 KiB)


def parse_cap(raw: str) -> float | None:
    """The confidence threshold T of `conf:<T>`, or None for 0 / empty (off)."""
    text = raw.strip()
    if text in ("", "0"):
        return None
    if text.startswith("conf:"):
        try:
            value = float(text[5:])
        except ValueError:
            value = -1.0
        if 0.0 < value <= 1.0:
            return value
    raise SettingError(f"{KEY}={raw!r}: expected 0 (off) or conf:<T> with 0 < T <= 1, e.g. conf:0.1")


def live_drafts(confidence: Sequence[float], threshold: float, minimum: int = MIN_DRAFTS) -> int:
    """k for one request: leading drafts whose running product of confidences is >= threshold,
    clamped to [minimum, len(confidence)]. The vectorised form is verify_cap_torch.live_lengths."""
    product, k = 1.0, 0
    for c in confidence:
        product *= min(max(float(c), 0.0), 1.0)
        if product < threshold:
            break
        k += 1
    return max(min(k, len(confidence)), min(minimum, len(confidence)))


@dataclass(frozen=True)
class Cutoff:
    """The one field of a RaggedVerifyLayout that accept_draft_tokens reads (verify_lens)."""

    verify_lens: Any


@dataclass(frozen=True)
class Routing:
    """A target verify forward in progress: its row count and each row's router source row."""

    rows: int
    sources: Any


class VerifyCap:
    def __init__(self, threshold: float, log: AdapterLog) -> None:
        self.threshold = threshold
        self._log = log
        self.stride: int | None = None
        self.live: Any = None  # int64 [LIVE_ROWS]: 1 + k per request of the step
        self._routing: contextvars.ContextVar[Routing | None] = contextvars.ContextVar(f"{NAME}_routing",
                                                                                        default=None)
        self._draft_module: Any = None
        self._missing_logged = False
        self.capped_steps = 0
        self.remapped_gates = 0

    def patches(self) -> tuple[Patch, ...]:
        return (
            Patch(DRAFT_MODEL, "", ON_IMPORT, self.bind_draft_module),
            Patch(DRAFT_MODEL, "build_dspark_v4_confidence_head", AROUND, self.around_confidence_head,
                  params=("config", "markov_rank")),
            Patch(VERIFY, "TargetVerifyExecutor.__init__", AFTER, self.after_executor_init,
                  params=("self", "verify_num_draft_tokens", "model_runner")),
            Patch(DRAFT, "DraftBlockProposer.propose", AFTER, self.after_propose, params=("self", "bs")),
            Patch(VERIFY, "accept_draft_tokens", AROUND, self.around_accept_draft_tokens,
                  params=("candidates", "cutoff_layout")),
            Patch(VERIFY, "DsparkVerifyEpilogue._accept", AROUND, self.around_epilogue_accept,
                  params=("self", "candidates", "cutoff_verify_lens")),
            Patch(VERIFY, "DsparkVerifyEpilogue._serves_accept_tail", AROUND, self.around_serves_accept_tail,
                  params=("self", "bs")),
            Patch(VERIFY, "_draft_probs", AFTER, self.after_draft_probs, params=("draft_block", "vocab")),
            Patch(MODEL, "DeepseekV4ForCausalLM.forward", AROUND, self.around_target_forward,
                  params=("self", "input_ids", "positions", "forward_batch")),
            Patch(V2, "MoEGate.forward", AFTER, self.after_gate, params=("self", "hidden_states")),
            Patch(HASH_TOPK, "HashTopK.forward", BEFORE, self.before_hash_topk,
                  params=("self", "hidden_states", "router_logits", "input_ids")),
        )

    # ----- the confidence head in static mode -----

    def bind_draft_module(self, module: Any) -> None:
        self._draft_module = module

    def around_confidence_head(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        from sglang.srt.speculative.ragged_verify import RaggedVerifyMode

        module = self._draft_module
        mode = module.read_ragged_verify_mode()
        if mode is not RaggedVerifyMode.STATIC:
            raise Refused(f"{NAME}: SGLANG_RAGGED_VERIFY_MODE={mode.value} schedules verify lengths itself; "
                          f"{KEY} caps the static verify: unset {MODE_KEY} or set {KEY}=0")
        reader = module.read_ragged_verify_mode
        # SGLang's builder returns None in static mode before reading the config; everything else
        # about the head (markov features, sizes) stays SGLang's.
        module.read_ragged_verify_mode = lambda: RaggedVerifyMode.CAP_ACCEPT
        try:
            head = original(*args, **kwargs)
        finally:
            module.read_ragged_verify_mode = reader
        self._log.line(f"{NAME}: built the draft's confidence head in the static verify mode "
                       f"({'present' if head is not None else 'none: the config disables it'})")
        return head

    # ----- live lengths -----

    def after_executor_init(self, _result: Any, executor: Any, *_a: Any, **_k: Any) -> None:
        import torch

        self.stride = int(executor.verify_num_draft_tokens)
        device = getattr(executor.model_runner, "device", "cpu")
        self.live = torch.full((LIVE_ROWS,), self.stride, dtype=torch.int64, device=device)
        return None

    def after_propose(self, proposal: Any, _proposer: Any, *_a: Any, bs: int | None = None, **_k: Any) -> None:
        if self.live is None:
            raise Refused(f"{NAME}: a DSpark proposal before the verify executor existed")
        rows = int(bs) if bs is not None else int(proposal.draft_block.draft_tokens.shape[0])
        if rows > self.live.shape[0]:
            raise Refused(f"{NAME}: {rows} requests in one step; the live-length buffer holds {self.live.shape[0]}")
        confidence = getattr(proposal, "confidence", None)
        if confidence is None:
            if not self._missing_logged:
                self._missing_logged = True
                self._log.line(f"{NAME}: a proposal carried no confidence; such steps verify every draft")
            self.live[:rows].fill_(self.stride)
        else:
            from adapter.verify_cap_torch import live_lengths

            self.live[:rows].copy_(live_lengths(confidence[:rows], self.threshold, MIN_DRAFTS))
            self.capped_steps += 1
        _tp_broadcast(self.live[:rows])
        return None

    def cutoff(self, bs: int) -> Any:
        if self.live is None:
            raise Refused(f"{NAME}: a DSpark accept before the verify executor existed")
        return self.live[:bs]

    def around_accept_draft_tokens(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("cutoff_layout") is None:
            kwargs["cutoff_layout"] = Cutoff(self.cutoff(int(kwargs["candidates"].shape[0])))
        return original(*args, **kwargs)

    def around_epilogue_accept(self, original: Callable[..., Any], epilogue: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("cutoff_verify_lens") is None:
            kwargs["cutoff_verify_lens"] = self.cutoff(int(kwargs["candidates"].shape[0]))
        return original(epilogue, *args, **kwargs)

    def around_serves_accept_tail(self, _original: Callable[..., Any], *_a: Any, **_k: Any) -> bool:
        return False

    def after_draft_probs(self, probs: Any, draft_block: Any, *_a: Any, **_k: Any) -> Any:
        from adapter.verify_cap_torch import zero_dead_drafts

        return zero_dead_drafts(probs, self.cutoff(int(probs.shape[0])))

    # ----- dead rows route like their anchor -----

    def around_target_forward(self, original: Callable[..., Any], model: Any, input_ids: Any, positions: Any,
                              forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
        mode = getattr(forward_batch, "forward_mode", None)
        routing = None
        if (self.live is not None and self.stride and mode is not None and mode.is_target_verify()
                and input_ids is not None and type(model).__name__ == "DeepseekV4ForCausalLM"):
            rows = int(input_ids.shape[0])
            if rows and rows % self.stride == 0 and rows // self.stride <= self.live.shape[0]:
                from adapter.verify_cap_torch import dead_row_sources

                routing = Routing(rows, dead_row_sources(self.live, rows, self.stride))
        token = self._routing.set(routing)
        try:
            return original(model, input_ids, positions, forward_batch, *args, **kwargs)
        finally:
            self._routing.reset(token)

    def routing(self) -> Routing | None:
        return self._routing.get()

    def after_gate(self, logits: Any, _gate: Any, *_a: Any, **_k: Any) -> Any:
        routing = self._routing.get()
        if routing is None or getattr(logits, "dim", lambda: 0)() != 2 or int(logits.shape[0]) != routing.rows:
            return None
        self.remapped_gates += 1
        return logits.index_select(0, routing.sources)

    def before_hash_topk(self, topk: Any, hidden_states: Any, router_logits: Any, input_ids: Any, *args: Any,
                         **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        routing = self._routing.get()
        if routing is None or input_ids is None or int(input_ids.shape[0]) != routing.rows:
            return None
        return (topk, hidden_states, router_logits, input_ids.index_select(0, routing.sources), *args), kwargs


def _tp_broadcast(values: Any) -> None:
    from sglang.srt.distributed import get_tp_group

    group = get_tp_group()
    if group.world_size > 1:
        group.broadcast(values, src=0)


def build(env: Mapping[str, str], log: AdapterLog) -> AdapterSpec | None:
    try:
        threshold = parse_cap(rankadapters.DSV41_VERIFY_CAP.read(env))
    except SettingError as e:
        return refusing(NAME, VERIFY, str(e))
    mode = rankadapters.SGLANG_RAGGED_VERIFY_MODE.read(env)
    if threshold is None:
        return None
    if mode not in ("", "static"):
        return refusing(NAME, VERIFY, f"{MODE_KEY}={mode} schedules verify lengths itself; {KEY} caps the "
                        f"static verify: unset {MODE_KEY} or set {KEY}=0")
    adapter = VerifyCap(threshold, log)
    return AdapterSpec(name=NAME, state=adapter, fail_closed=True, patches=adapter.patches(),
                       detail=f"confidence cap {threshold:g}: at least {MIN_DRAFTS} draft, dead verify rows route "
                              "like their anchor")

