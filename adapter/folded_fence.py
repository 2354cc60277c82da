"""folded_fence: folded DSpark accept results copied off the verify graph's persistent buffers
(DSV41_FOLDED_FENCE=1).

On the folded path (an all-greedy step whose accept ran inside the static verify graph) SGLang's
TargetVerifyExecutor.accept_and_finalize returns views of DsparkVerifyEpilogue's buffers
(correct_len_buf, commit_lens_buf, out_tokens_buf, ...), and the sampling-accept region
(DsparkSamplingAcceptGraph.run) returns the same views. Under overlap scheduling the scheduler copies
them to the host on its copy stream while the next step is already queued, and the next replay can
overwrite them first (sglang#40919). Hooks:

- AFTER dspark_verify.TargetVerifyExecutor.accept_and_finalize, when folded_accept;
- AFTER dspark_sampling_accept_graph.DsparkSamplingAcceptGraph.run, when it served the step:

the six AcceptOuts tensors cloned on the forward stream right after the graph, before anything else
is queued: the copy reads its own memory, which no replay writes. bs x 6 int64 at most (under 1 KiB
at 4 requests). The eager accept allocates fresh tensors already and is left alone. fail_closed: a
rank whose host copy is overwritten commits other lengths than its peers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from adapter.patching import AFTER, ON_IMPORT, AdapterSpec, Patch, Refused, refusing
from dsv41 import rankadapters
from dsv41.adapterlog import AdapterLog
from dsv41.ranksettings import SettingError

NAME = "folded_fence"
KEY = rankadapters.DSV41_FOLDED_FENCE.name
# The variables build() reads: dsv41ctl config check reports any other adapter key as no effect.
ENV_KEYS = rankadapters.BY_NAME[NAME].keys  # every variable build() reads, declared in dsv41
VERIFY = "sglang.srt.speculative.dspark_components.dspark_verify"
SAMPLING_GRAPH = "sglang.srt.speculative.dspark_components.dspark_sampling_accept_graph"


def detached(outs: Any) -> Any:
    """The same AcceptOuts with every tensor cloned (same values, own memory)."""
    fields = outs.__struct_fields__
    return type(outs)(**{f: getattr(outs, f).clone() for f in fields})


class FoldedFence:
    def __init__(self) -> None:
        self.fenced = 0

    def after_accept(self, outs: Any, _executor: Any, *_a: Any, **kwargs: Any) -> Any:
        if not kwargs.get("folded_accept", False):
            return None
        self.fenced += 1
        return detached(outs)

    def after_region(self, outs: Any, *_a: Any, **_k: Any) -> Any:
        if outs is None:
            return None
        self.fenced += 1
        return detached(outs)

    def check_outs(self, module: Any) -> None:
        fields = getattr(getattr(module, "AcceptOuts", None), "__struct_fields__", None)
        if not fields:
            raise Refused(f"{NAME}: {module.__name__}.AcceptOuts is gone or not a msgspec struct")


def build(env: Mapping[str, str], log: AdapterLog) -> AdapterSpec | None:
    try:
        on = rankadapters.DSV41_FOLDED_FENCE.read(env)
    except SettingError as e:
        return refusing(NAME, VERIFY, str(e))
    if not on:
        return None
    adapter = FoldedFence()
    return AdapterSpec(
        name=NAME, state=adapter, fail_closed=True,
        detail="folded DSpark accept results cloned off the verify graph's persistent buffers",
        patches=(
            Patch(VERIFY, "", ON_IMPORT, adapter.check_outs),
            Patch(VERIFY, "TargetVerifyExecutor.accept_and_finalize", AFTER, adapter.after_accept,
                  params=("self", "folded_accept", "bs")),
            Patch(SAMPLING_GRAPH, "DsparkSamplingAcceptGraph.run", AFTER, adapter.after_region,
                  params=("self", "bs", "target_logits")),
        ),
    )

