"""block_verify: DSpark's sampled rows accepted by block verification (DSV41_BLOCK_VERIFY=1).

SGLang 0.5.23 implements block verification (arXiv 2403.10444, Algorithm 2) in its chain rejection
kernel (reject_sampling.py, BLOCK_VERIFICATION) and switches it on for every speculative algorithm
with --speculative-use-block-verification. The adapter turns it on for DSpark only, where the
recipe measured it, without changing the server arguments every process shares:

- BEFORE dspark_verify.TargetVerifyExecutor.__init__ and
  dspark_sampling_accept_graph.DsparkSamplingAcceptGraph.__init__: block_verification=True. The
  eager sampled accept and the sampling-accept region then run AcceptSampling with block
  verification (SGLang's block-wise rejection kernel, which is token by token, is not used).

Lossless like token-wise rejection (the output sequence has the target's distribution) and accepts at
least as much. With the verify cap (DSV41_VERIFY_CAP) the dead drafts' probabilities are zero, so the
block is verified as k drafts long. Greedy rows are unaffected. fail_closed: a rank verifying
token by token would accept other lengths than its peers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from adapter.patching import BEFORE, ON_IMPORT, AdapterSpec, Patch, Refused, refusing
from dsv41 import rankadapters
from dsv41.adapterlog import AdapterLog
from dsv41.ranksettings import SettingError

NAME = "block_verify"
KEY = rankadapters.DSV41_BLOCK_VERIFY.name
# The variables build() reads: dsv41ctl config check reports any other adapter key as no effect.
ENV_KEYS = rankadapters.BY_NAME[NAME].keys  # every variable build() reads, declared in dsv41
VERIFY = "sglang.srt.speculative.dspark_components.dspark_verify"
SAMPLING_GRAPH = "sglang.srt.speculative.dspark_components.dspark_sampling_accept_graph"

Args = tuple[tuple[Any, ...], dict[str, Any]]


class BlockVerify:
    def __init__(self) -> None:
        self.switched = 0  # constructors given block_verification=True

    def check_platform(self, module: Any) -> None:
        if getattr(module, "_is_npu", False):
            raise Refused(f"{NAME}: {KEY}=1: the NPU rejection sampler has no block verification")

    def before_init(self, obj: Any, *args: Any, **kwargs: Any) -> Args:
        self.switched += 1
        return (obj, *args), {**kwargs, "block_verification": True}


def build(env: Mapping[str, str], log: AdapterLog) -> AdapterSpec | None:
    try:
        on = rankadapters.DSV41_BLOCK_VERIFY.read(env)
    except SettingError as e:
        return refusing(NAME, VERIFY, str(e))
    if not on:
        return None
    adapter = BlockVerify()
    return AdapterSpec(
        name=NAME, state=adapter, fail_closed=True,
        detail="DSpark's sampled rows accepted by SGLang's block verification",
        patches=(
            Patch(VERIFY, "", ON_IMPORT, adapter.check_platform),
            Patch(VERIFY, "TargetVerifyExecutor.__init__", BEFORE, adapter.before_init,
                  params=("self", "block_verification")),
            Patch(SAMPLING_GRAPH, "DsparkSamplingAcceptGraph.__init__", BEFORE, adapter.before_init,
                  params=("self", "block_verification")),
        ),
    )

