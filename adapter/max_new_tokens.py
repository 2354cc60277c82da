"""max_new_tokens: a default and a ceiling for chat completions' output length.

Without max_tokens / max_completion_tokens SGLang lets a chat request generate up to the rest of
the context (1M tokens on TP4): one looping request then runs for hours. Before SGLang turns the
chat request into its internal request (`OpenAIServingChat._convert_to_internal_request`), a
missing limit is filled with DSV41_MAX_NEW_TOKENS and larger client values are clamped to it.
DSV41_MAX_NEW_TOKENS=0 restores SGLang's behaviour. (SGLANG_MAX_NEW_TOKENS_LIMIT, SGLang's own
cap, only clamps in the scheduler; it does not fill a missing value.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from adapter.patching import BEFORE, AdapterSpec, Patch
from dsv41 import rankadapters

NAME = "max_new_tokens"
# The variables build() reads: dsv41ctl config check reports any other adapter key as no effect.
ENV_KEYS = rankadapters.BY_NAME[NAME].keys  # every variable build() reads, declared in dsv41
MODULE = "sglang.srt.entrypoints.openai.serving_chat"
SETTING = rankadapters.DSV41_MAX_NEW_TOKENS
DEFAULT = int(SETTING.default)
MAXIMUM = int(SETTING.high)


def limit_output(
    max_completion_tokens: int | None, max_tokens: int | None, limit: int
) -> tuple[int | None, int | None]:
    """(max_completion_tokens, max_tokens) after filling and clamping to `limit` (0: unchanged).

    SGLang reads max_completion_tokens first and falls back to max_tokens, so a missing pair is
    filled through max_completion_tokens and each value that is present is clamped.
    """
    if limit <= 0:
        return max_completion_tokens, max_tokens
    if max_completion_tokens is None and max_tokens is None:
        return limit, None
    mct = None if max_completion_tokens is None else min(max_completion_tokens, limit)
    mt = None if max_tokens is None else min(max_tokens, limit)
    return mct, mt


class MaxNewTokens:
    def __init__(self, limit: int) -> None:
        self.limit = limit

    def before_convert(self, _serving: Any, request: Any, *_args: Any, **_kwargs: Any) -> None:
        mct, mt = limit_output(
            getattr(request, "max_completion_tokens", None), getattr(request, "max_tokens", None), self.limit
        )
        if mct != request.max_completion_tokens:
            request.max_completion_tokens = mct
        if mt != request.max_tokens:
            request.max_tokens = mt
        return None


def build(env: Mapping[str, str]) -> AdapterSpec | None:
    limit = SETTING.read(env)
    if limit == 0:
        return None
    adapter = MaxNewTokens(limit)
    return AdapterSpec(
        name=NAME,
        state=adapter,
        detail=f"chat max_tokens default and ceiling {limit}",
        patches=(
            Patch(
                MODULE,
                "OpenAIServingChat._convert_to_internal_request",
                BEFORE,
                adapter.before_convert,
                params=("self", "request"),
            ),
        ),
    )
