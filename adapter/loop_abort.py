"""loop_abort: finish a decoding request as stopped when its output has fallen into a loop.

SGLang's watchdog only fires when a step hangs; a live token stream that repeats itself (one
request once streamed 714k tokens of the same HTML) looks healthy to it. After SGLang's own
finish checks, `Req.update_finish_state` is followed by LoopDetector over `req.output_ids`; a loop
finishes the request with FINISH_MATCHED_STR (OpenAI finish_reason "stop"), its matched text
naming the rule. The decision uses output ids only, so all TP ranks (each runs this hook on its
own copy of the request) finish the request at the same step. Requests sent with ignore_eos
(benchmarks that want an exact output length) are left alone.

Settings: DSV41_LOOP_ABORT (1; 0 disables), DSV41_LOOP_NGRAM (32), DSV41_LOOP_REPEATS (4),
DSV41_LOOP_LINE_REPEATS (8); 64 identical tokens always count as a loop.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from typing import Any

from adapter.loop_detect import LoopDetector, LoopRules, TokenKind
from adapter.patching import AFTER, ON_IMPORT, AdapterSpec, Patch, PatchError
from dsv41 import rankadapters

NAME = "loop_abort"
# The variables build() reads: dsv41ctl config check reports any other adapter key as no effect.
ENV_KEYS = rankadapters.BY_NAME[NAME].keys  # every variable build() reads, declared in dsv41
MODULE = "sglang.srt.managers.schedule_batch"
DETECTOR_ATTR = "_dsv41_loop_detector"
SAME_TOKENS = 64


def rules_from_env(env: Mapping[str, str]) -> LoopRules | None:
    """The rules, or None when DSV41_LOOP_ABORT switches the adapter off."""
    if not rankadapters.DSV41_LOOP_ABORT.read(env):
        return None
    return LoopRules(
        ngram=rankadapters.DSV41_LOOP_NGRAM.read(env),
        repeats=rankadapters.DSV41_LOOP_REPEATS.read(env),
        same_tokens=SAME_TOKENS,
        line_repeats=rankadapters.DSV41_LOOP_LINE_REPEATS.read(env),
    )


class TokenKinds:
    """Newline / blank classification of token ids, decoded once per id and cached."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._cache: dict[int, TokenKind] = {}

    def __call__(self, tok: int) -> TokenKind:
        kind = self._cache.get(tok)
        if kind is None:
            text = self._decode([tok])
            kind = TokenKind(newline="\n" in text, blank=text.strip() == "")
            self._cache[tok] = kind
        return kind


class LoopAbort:
    def __init__(self, rules: LoopRules) -> None:
        self.rules = rules
        self._finish_cls: Callable[..., Any] | None = None
        self._kinds: dict[int, tuple[Any, TokenKinds]] = {}

    def bind(self, module: types.ModuleType) -> None:
        """Take SGLang's finish-reason class from schedule_batch (fails if it is gone)."""
        finish = getattr(module, "FINISH_MATCHED_STR", None)
        if finish is None:
            raise PatchError(f"{module.__name__} has no FINISH_MATCHED_STR")
        self._finish_cls = finish

    def kinds_for(self, tokenizer: Any) -> TokenKinds | None:
        if tokenizer is None or not hasattr(tokenizer, "decode"):
            return None
        entry = self._kinds.get(id(tokenizer))
        if entry is None or entry[0] is not tokenizer:
            entry = (tokenizer, TokenKinds(tokenizer.decode))
            self._kinds[id(tokenizer)] = entry
        return entry[1]

    def after_update_finish_state(self, _result: Any, req: Any, *_args: Any, **_kwargs: Any) -> None:
        if req.finished():
            return None
        sampling = getattr(req, "sampling_params", None)
        if sampling is not None and getattr(sampling, "ignore_eos", False):
            return None
        detector = getattr(req, DETECTOR_ATTR, None)
        if detector is None:
            detector = LoopDetector(self.rules, self.kinds_for(getattr(req, "tokenizer", None)))
            setattr(req, DETECTOR_ATTR, detector)
        verdict = detector.feed(req.output_ids)
        if verdict is not None and self._finish_cls is not None:
            req.finished_reason = self._finish_cls(matched=verdict.reason())
        return None


def build(env: Mapping[str, str]) -> AdapterSpec | None:
    rules = rules_from_env(env)
    if rules is None:
        return None
    adapter = LoopAbort(rules)
    return AdapterSpec(
        name=NAME,
        state=adapter,
        detail=(
            f"{rules.repeats}x >= {rules.ngram}-token block, {rules.same_tokens} identical tokens, "
            f"{rules.line_repeats} identical lines"
        ),
        patches=(
            Patch(MODULE, "", ON_IMPORT, adapter.bind),
            Patch(
                MODULE,
                "Req.update_finish_state",
                AFTER,
                adapter.after_update_finish_state,
                params=("self", "new_accepted_len"),
            ),
        ),
    )
