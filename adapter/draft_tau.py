"""draft_tau: DSpark's sampled drafts proposed at tau x the request's temperature (DSV41_DRAFT_TAU).

A sharper draft (tau < 1) proposes its likelier tokens more often. Rejection sampling stays
lossless as long as the accept uses the distribution the drafts were drawn from, so the adapter
changes both, and never the target's temperature:

- AFTER dspark_draft.resolve_draft_params: step_temperatures (what the draft samples each step at,
  0 on greedy rows) times tau. It fills the draft graph's staged buffers as well as the eager
  path's, so folded and eager proposals both sample at tau x T.
- AROUND dspark_verify._draft_probs and BEFORE blockwise_rejection.BlockwiseRejection.execute: the
  draft temperature of the accept times tau. `temperatures` itself stays the request's: the
  sampling-accept region uses it as the target's temperature.

1 (the default) leaves the adapter out; (0, 1) is allowed. The recipe measured 0.8 at +1.2 % on
sampled chat, inside noise. fail_closed: ranks drafting at different temperatures disagree on
what they accept.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from adapter.patching import AFTER, AROUND, BEFORE, AdapterSpec, Patch, Refused, refusing
from dsv41 import rankadapters
from dsv41.adapterlog import AdapterLog
from dsv41.ranksettings import SettingError

NAME = "draft_tau"
KEY = rankadapters.DSV41_DRAFT_TAU.name
# The variables build() reads: dsv41ctl config check reports any other adapter key as no effect.
ENV_KEYS = rankadapters.BY_NAME[NAME].keys  # every variable build() reads, declared in dsv41
DRAFT = "sglang.srt.speculative.dspark_components.dspark_draft"
VERIFY = "sglang.srt.speculative.dspark_components.dspark_verify"
BLOCKWISE = "sglang.kernels.ops.speculative.dspark.blockwise_rejection"


def parse_tau(raw: str) -> float | None:
    """tau in (0, 1); None for 1 or empty (off)."""
    text = raw.strip()
    if text == "":
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 < value <= 1.0:
        raise SettingError(f"{KEY}={raw!r}: expected a factor in (0, 1], e.g. 0.8; 1 is off")
    return None if value == 1.0 else value


class DraftTau:
    def __init__(self, tau: float) -> None:
        self.tau = tau

    def after_resolve(self, params: Any, *_a: Any, **_k: Any) -> None:
        params.step_temperatures.mul_(self.tau)  # in place: the draft graph reads these buffers
        return None

    def around_draft_probs(self, original: Callable[..., Any], draft_block: Any, *args: Any, **kwargs: Any) -> Any:
        import msgspec

        scaled = msgspec.structs.replace(draft_block, temperatures=draft_block.temperatures * self.tau)
        return original(scaled, *args, **kwargs)

    def before_blockwise(self, cls: Any, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if kwargs.get("draft_temperatures") is None:
            raise Refused(f"{NAME}: BlockwiseRejection.execute was called without draft_temperatures by name")
        return (cls, *args), {**kwargs, "draft_temperatures": kwargs["draft_temperatures"] * self.tau}


def build(env: Mapping[str, str], log: AdapterLog) -> AdapterSpec | None:
    try:
        tau = parse_tau(env.get(KEY, "").strip() or rankadapters.DSV41_DRAFT_TAU.when_absent)
    except SettingError as e:
        return refusing(NAME, DRAFT, str(e))
    if tau is None:
        return None
    adapter = DraftTau(tau)
    return AdapterSpec(
        name=NAME, state=adapter, fail_closed=True,
        detail=f"sampled DSpark drafts at {tau:g} x the request's temperature, accepted against that distribution",
        patches=(
            Patch(DRAFT, "resolve_draft_params", AFTER, adapter.after_resolve, params=("sampling_info", "bs", "out")),
            Patch(VERIFY, "_draft_probs", AROUND, adapter.around_draft_probs, params=("draft_block", "vocab")),
            Patch(BLOCKWISE, "BlockwiseRejection.execute", BEFORE, adapter.before_blockwise),
        ),
    )

