"""Decode-loop detection over output token ids (pure; no torch, no SGLang).

A request is looping when its output, after the newest token, ends with

- `repeats` consecutive copies of one block of `ngram` or more tokens (the block may itself be a
  short period repeated, so "ha ha ha ..." is caught once it spans repeats x ngram tokens), or
- `same_tokens` identical tokens in a row, or
- `line_repeats` identical non-blank lines in a row (blank lines between them are ignored);
  lines are split at tokens whose text contains a newline and compared by their token ids.

Only consecutive repetition counts: a phrase, table row or code line that recurs with other text
in between never triggers. The decision depends on nothing but the ids (and, for lines, a fixed
per-token classification from the tokenizer), so every TP rank reaches the same verdict at the
same step.

Cost: each new token does O(1) hashing plus one check per earlier occurrence of the current
`ngram`-token window that could start a long-enough repeat, which is bounded by the output
length (linear per step) and is a handful in ordinary text. The block check is exact: a rolling
hash only proposes candidates, which are confirmed token by token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

_MOD = (1 << 61) - 1  # Mersenne prime modulus for the rolling hash
_BASE = 1_000_003  # fixed so every rank hashes alike (no per-process randomisation)


@dataclass(frozen=True)
class LoopRules:
    ngram: int = 32
    repeats: int = 4
    same_tokens: int = 64
    line_repeats: int = 8

    def __post_init__(self) -> None:
        if self.ngram < 2:
            raise ValueError(f"ngram must be >= 2, got {self.ngram}")
        if self.repeats < 2:
            raise ValueError(f"repeats must be >= 2, got {self.repeats}")
        if self.same_tokens < 2:
            raise ValueError(f"same_tokens must be >= 2, got {self.same_tokens}")
        if self.line_repeats < 2:
            raise ValueError(f"line_repeats must be >= 2, got {self.line_repeats}")


class TokenKind(NamedTuple):
    newline: bool  # the token's text contains a line break: it ends a line
    blank: bool  # the token's text is whitespace only


@dataclass(frozen=True)
class LoopVerdict:
    rule: str  # "ngram", "same_token" or "lines"
    detail: str
    length: int  # output length (tokens) when the loop was recognised

    def reason(self) -> str:
        return f"loop abort ({self.rule}: {self.detail})"


class LoopDetector:
    """Incremental detector for one request; feed() it the whole output after every step."""

    def __init__(self, rules: LoopRules, token_kind: Callable[[int], TokenKind] | None = None) -> None:
        self.rules = rules
        self._kind = token_kind
        self._reset()
        self.checks = 0  # candidate checks made so far (exposed so tests can bound the work)

    def _reset(self) -> None:
        n = self.rules.ngram
        self._toks: list[int] = []
        self._gram: list[int] = []  # hash of the n-token window ending at each position (or -1)
        self._occ: dict[int, list[int]] = {}
        self._hash = 0
        self._drop = pow(_BASE, n, _MOD)  # weight of the token leaving the window
        self._run_tok: int | None = None
        self._run_len = 0
        self._line: list[int] = []
        self._line_blank = True
        self._last_line: tuple[int, ...] | None = None
        self._line_count = 0

    def feed(self, ids: Sequence[int]) -> LoopVerdict | None:
        """Consume the tokens not seen yet; the first verdict among them, or None."""
        if len(ids) < len(self._toks) or (self._toks and ids[len(self._toks) - 1] != self._toks[-1]):
            # Output was rewritten (retraction): start over rather than trust stale state.
            self._reset()
        for tok in ids[len(self._toks) :]:
            verdict = self.push(int(tok))
            if verdict is not None:
                return verdict
        return None

    def push(self, tok: int) -> LoopVerdict | None:
        i = len(self._toks)
        self._toks.append(tok)
        verdict = self._same_token(tok, i)
        block = self._block(tok, i)
        lines = self._lines(tok, i) if self._kind is not None else None
        return verdict or block or lines

    def _same_token(self, tok: int, i: int) -> LoopVerdict | None:
        if tok == self._run_tok:
            self._run_len += 1
        else:
            self._run_tok, self._run_len = tok, 1
        if self._run_len == self.rules.same_tokens:
            return LoopVerdict("same_token", f"token {tok} x{self._run_len}", i + 1)
        return None

    def _block(self, tok: int, i: int) -> LoopVerdict | None:
        n, reps = self.rules.ngram, self.rules.repeats
        h = (self._hash * _BASE + tok + 1) % _MOD
        if i >= n:
            h = (h - (self._toks[i - n] + 1) * self._drop) % _MOD
        self._hash = h
        if i < n - 1:
            self._gram.append(-1)
            return None
        self._gram.append(h)
        seen = self._occ.setdefault(h, [])
        found: LoopVerdict | None = None
        # Newest occurrence first: the distance d grows, and a repeat needs reps * d <= i + 1.
        for j in reversed(seen):
            d = i - j
            if d * reps > i + 1:
                break
            if d < n:
                continue
            self.checks += 1
            if all(self._gram[i - k * d] == h for k in range(2, reps)) and self._confirm(i, d):
                found = LoopVerdict("ngram", f"{d}-token block x{reps}", i + 1)
                break
        seen.append(i)
        return found

    def _confirm(self, i: int, d: int) -> bool:
        toks = self._toks
        start = i - (self.rules.repeats - 1) * d + 1
        return all(toks[q] == toks[q - d] for q in range(start, i + 1))

    def _lines(self, tok: int, i: int) -> LoopVerdict | None:
        assert self._kind is not None
        kind = self._kind(tok)
        self._line.append(tok)
        self._line_blank = self._line_blank and kind.blank
        if not kind.newline:
            return None
        line, blank = tuple(self._line), self._line_blank
        self._line, self._line_blank = [], True
        if blank:
            return None  # blank lines neither count nor break a run
        if line == self._last_line:
            self._line_count += 1
        else:
            self._last_line, self._line_count = line, 1
        if self._line_count == self.rules.line_repeats:
            return LoopVerdict("lines", f"{len(line)}-token line x{self._line_count}", i + 1)
        return None


def tail_repeats(ids: Sequence[int], rules: LoopRules) -> bool:
    """Reference check of the block and same-token rules on the whole sequence (quadratic).

    True when the sequence ends with `repeats` copies of a block of at least `ngram` tokens, or
    with `same_tokens` equal tokens. Used by the tests to cross-check LoopDetector.
    """
    size = len(ids)
    if size >= rules.same_tokens and len(set(ids[size - rules.same_tokens :])) == 1:
        return True
    for d in range(rules.ngram, size // rules.repeats + 1):
        tail = ids[size - rules.repeats * d :]
        if all(tail[q] == tail[q - d] for q in range(d, len(tail))):
            return True
    return False
