"""reasoning_effort: DeepSeek-V4.1 reasoning budgets on the publisher's scale.

V4.1 renders a thinking budget ("Reasoning Effort: N", N in 1..100) in thinking-mode prompts.
Older SGLang encoders map the named tiers low/high/xhigh/max to 25/50/75/100 with default
"high" = 50; the publisher's encoding/encoding.py uses low=50, high=75, max=100 with default 75.
This adapter turns a named tier into the publisher's number before SGLang's V4.1 chat encoder
(`DeepSeekRecipeChatEncodingAdapter._encode`) sees it, and makes the server default the number
from SGLANG_DSV41_REASONING_EFFORT (integer 1-100 or a tier; 75 when unset).

Per request, all of these reach the same place: OpenAI `reasoning_effort` as a tier or a float
0-0.99 (budget/100, SGLang converts it), and `chat_template_kwargs: {"reasoning_effort": N}`
(SGLang moves it to `reasoning_effort`). "xhigh" is not in the publisher's table; it keeps its
place between high and max (88). Other tier names (minimal, medium, ultra, none) pass through.
DSV41_REASONING_EFFORT_REMAP=0 switches the adapter off.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from adapter.patching import AFTER, BEFORE, AdapterSpec, Patch
from dsv41 import rankadapters
from dsv41.ranksettings import SettingError

NAME = "reasoning_effort"
# The variables build() reads: dsv41ctl config check reports any other adapter key as no effect.
ENV_KEYS = rankadapters.BY_NAME[NAME].keys  # every variable build() reads, declared in dsv41
MODULE = "sglang.srt.entrypoints.openai.serving_deepseek_recipe"
SPEC = "dsv41"  # SGLang's chat encoding spec name for V4.1; V4 ("dsv4") takes only tiers
PUBLISHER_TIERS = {"low": 50, "high": 75, "xhigh": 88, "max": 100}
PUBLISHER_DEFAULT = 75

Effort = str | int | float | None


def remap_effort(effort: Effort) -> Effort:
    """A named tier as the publisher's budget; numbers, numeric strings and others unchanged."""
    if isinstance(effort, str):
        tier = effort.strip().lower()
        if tier in PUBLISHER_TIERS:
            return PUBLISHER_TIERS[tier]
    return effort


def default_budget(raw: str | None) -> int:
    """The server default from SGLANG_DSV41_REASONING_EFFORT: an integer 1-100 or a tier name."""
    if raw is None or not raw.strip():
        return PUBLISHER_DEFAULT
    text = raw.strip().lower()
    if text in PUBLISHER_TIERS:
        return PUBLISHER_TIERS[text]
    if re.fullmatch(r"\d+", text) and 1 <= int(text) <= 100:
        return int(text)
    raise SettingError(
        f"SGLANG_DSV41_REASONING_EFFORT={raw!r}: expected an integer 1-100 or one of "
        f"{', '.join(PUBLISHER_TIERS)}"
    )


class ReasoningEffort:
    def __init__(self, default: int) -> None:
        self.default = default

    def after_init(self, _result: Any, encoder: Any, *_args: Any, **_kwargs: Any) -> None:
        if getattr(encoder, "_spec", None) == SPEC:
            encoder._default_effort = self.default
        return None

    def before_encode(self, encoder: Any, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if getattr(encoder, "_spec", None) != SPEC or "effort" not in kwargs:
            return None
        kwargs["effort"] = remap_effort(kwargs["effort"])
        return (encoder, *args), kwargs


def build(env: Mapping[str, str]) -> AdapterSpec | None:
    if not rankadapters.DSV41_REASONING_EFFORT_REMAP.read(env):
        return None
    adapter = ReasoningEffort(default_budget(rankadapters.SGLANG_DSV41_REASONING_EFFORT.read(env)))
    tiers = ", ".join(f"{k}={v}" for k, v in PUBLISHER_TIERS.items())
    return AdapterSpec(
        name=NAME,
        state=adapter,
        detail=f"{tiers}; default {adapter.default}",
        patches=(
            Patch(MODULE, "DeepSeekRecipeChatEncodingAdapter.__init__", AFTER, adapter.after_init, params=("self",)),
            Patch(
                MODULE,
                "DeepSeekRecipeChatEncodingAdapter._encode",
                BEFORE,
                adapter.before_encode,
                params=("self", "body", "effort"),
            ),
        ),
    )
