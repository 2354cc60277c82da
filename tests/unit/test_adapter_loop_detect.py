"""Loop detection over output ids: real-looking loops are cut, repetitive but legitimate text is not."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapter.loop_detect import LoopDetector, LoopRules, TokenKind, tail_repeats

pytestmark = pytest.mark.unit

RULES = LoopRules()  # the example configuration: 4 x >= 32-token block, 64 tokens, 8 lines


class WordTokenizer:
    """Toy tokenizer: one id per whitespace-separated word, newlines as their own ids."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.words: list[str] = []

    def _id(self, word: str) -> int:
        if word not in self.ids:
            self.ids[word] = len(self.words)
            self.words.append(word)
        return self.ids[word]

    def encode(self, text: str) -> list[int]:
        out = []
        for line in text.split("\n")[:-1] if text.endswith("\n") else text.split("\n"):
            out.extend(self._id(w + " ") for w in line.split(" ") if w)
            out.append(self._id("\n"))
        if not text.endswith("\n") and out:
            out.pop()
        return out

    def kind(self, tok: int) -> TokenKind:
        text = self.words[tok]
        return TokenKind(newline="\n" in text, blank=text.strip() == "")


def first_verdict(ids: list[int], tok: WordTokenizer | None = None, rules: LoopRules = RULES):
    det = LoopDetector(rules, tok.kind if tok else None)
    for n in range(1, len(ids) + 1):
        verdict = det.feed(ids[:n])
        if verdict is not None:
            return verdict
    return None


def prose(rng: random.Random, words: int) -> str:
    vocab = [f"w{i}" for i in range(400)]
    lines, line = [], []
    for _ in range(words):
        line.append(rng.choice(vocab))
        if len(line) >= rng.randint(6, 14):
            lines.append(" ".join(line))
            line = []
    return "\n".join(lines) + "\n"


def test_repeated_paragraph_is_cut_at_the_fourth_copy() -> None:
    tok = WordTokenizer()
    para = (
        "Let me double check the calculation once more . The total is 42 because 19 plus 23 "
        "equals 42 and nothing else changes the result so the final answer stays 42 . "
    )
    block = tok.encode(para)
    assert len(block) >= 32
    ids = tok.encode("Sure , here is my reasoning . ") + block * 6
    verdict = first_verdict(ids, tok)
    assert verdict is not None and verdict.rule == "ngram"
    # Recognised at the first token where the output ends in four copies (the prefix's final
    # "." starts a rotation of the block one token early), which is no later than the fourth copy.
    first = next(n for n in range(1, len(ids) + 1) if tail_repeats(ids[:n], RULES))
    assert verdict.length == first
    assert len(ids) - 3 * len(block) - 1 <= first <= len(ids) - 2 * len(block)


def test_racing_animation_html_loop_is_cut() -> None:
    tok = WordTokenizer()
    frame = "\n".join(f'<div class="car" style="left: {x}px ; top: 10px"> </div>' for x in range(0, 100, 10)) + "\n"
    ids = tok.encode("<html> <body>\n") + tok.encode(frame) * 5
    verdict = first_verdict(ids, tok)
    assert verdict is not None and verdict.rule == "ngram"
    assert verdict.length <= len(tok.encode("<html> <body>\n")) + 4 * len(tok.encode(frame))


def test_short_period_chant_is_cut_once_it_spans_four_blocks() -> None:
    ids = [5, 6, 7] * 60  # "ha ha ha": period 3, blocks of 33 tokens
    verdict = first_verdict(ids)
    assert verdict is not None and verdict.rule == "ngram"
    assert verdict.length == 4 * 33


def test_sixty_four_identical_tokens() -> None:
    ids = [1, 2, 3] + [9] * 100
    verdict = first_verdict(ids)
    assert verdict is not None and verdict.rule == "same_token"
    assert verdict.length == 3 + 64


def test_eight_identical_lines() -> None:
    tok = WordTokenizer()
    ids = tok.encode("Intro text here\n") + tok.encode("I apologize for the confusion\n") * 10
    verdict = first_verdict(ids, tok)
    assert verdict is not None and verdict.rule == "lines"
    assert verdict.length == len(tok.encode("Intro text here\n")) + 8 * len(tok.encode("I apologize for the confusion\n"))


def test_blank_lines_between_repeats_neither_count_nor_reset() -> None:
    tok = WordTokenizer()
    ids = tok.encode("I apologize for the confusion\n\n") * 8
    verdict = first_verdict(ids, tok)
    assert verdict is not None and verdict.rule == "lines"


def test_seven_identical_lines_stay() -> None:
    tok = WordTokenizer()
    matrix = "zeros = [\n" + "  [0, 0, 0, 0],\n" * 7 + "]\nprint ( zeros )\n"
    assert first_verdict(tok.encode(matrix), tok) is None


def test_markdown_table_is_not_cut() -> None:
    tok = WordTokenizer()
    rows = "| name | count | ok |\n| --- | --- | --- |\n"
    rows += "".join(f"| item{i} | {i * 3} | yes |\n" for i in range(60))
    assert first_verdict(tok.encode(rows), tok) is None


def test_repetitive_code_is_not_cut() -> None:
    tok = WordTokenizer()
    code = "class TestSquares ( unittest.TestCase ) :\n"
    for i in range(40):
        code += f"    def test_square_{i} ( self ) :\n        self.assertEqual ( square ( {i} ) , {i * i} )\n\n"
    code += "if __name__ == '__main__' :\n    unittest.main ( )\n"
    ids = tok.encode(code)
    assert len(ids) > 600
    assert first_verdict(ids, tok) is None


def test_recurring_phrase_with_text_between_is_not_cut() -> None:
    tok = WordTokenizer()
    rng = random.Random(7)
    boiler = "Copyright 2026 the authors . Licensed under the Apache License , Version 2.0 ; see LICENSE . " * 2
    text = "".join(boiler + "\n" + prose(rng, 30) for _ in range(8))
    assert first_verdict(tok.encode(text), tok) is None


def test_long_prose_is_not_cut() -> None:
    tok = WordTokenizer()
    ids = tok.encode(prose(random.Random(1), 6000))
    assert first_verdict(ids, tok) is None


def test_retraction_rewinds_the_state() -> None:
    det = LoopDetector(LoopRules(ngram=2, repeats=2, same_tokens=50, line_repeats=50))
    assert det.feed([1, 2, 3, 4]) is None
    # The scheduler retracted the request and it regenerated different tokens.
    assert det.feed([1, 2, 9, 9, 8, 7, 8, 7]) is not None


def test_work_per_step_is_bounded_by_the_output_length() -> None:
    # Worst case for the candidate scan: one n-gram recurring all the time with different text
    # in between, so every occurrence is a candidate that never confirms.
    rules = LoopRules(ngram=4, repeats=3, same_tokens=64, line_repeats=8)
    rng = random.Random(3)
    det = LoopDetector(rules)
    ids: list[int] = []
    for _ in range(400):
        ids.extend([1, 2, 3, 4])
        ids.extend(rng.randrange(10, 10_000) for _ in range(rng.randint(1, 3)))
    before = 0
    for n in range(1, len(ids) + 1):
        assert det.feed(ids[:n]) is None
        assert det.checks - before <= n  # no step does more candidate checks than tokens seen
        before = det.checks
    assert det.checks > len(ids) // 4  # the scan really ran on recurring n-grams
    assert det.checks < len(ids) * len(ids) // 50  # far from quadratic overall


@settings(max_examples=300, deadline=None)
@given(
    seed=st.lists(st.integers(0, 3), min_size=0, max_size=40),
    block=st.lists(st.integers(0, 3), min_size=1, max_size=9),
    copies=st.integers(0, 5),
    tail=st.lists(st.integers(0, 3), min_size=0, max_size=12),
)
def test_detector_agrees_with_the_quadratic_reference(seed, block, copies, tail) -> None:
    rules = LoopRules(ngram=3, repeats=3, same_tokens=7, line_repeats=50)
    ids = seed + block * copies + tail
    det = LoopDetector(rules)
    for n in range(1, len(ids) + 1):
        expected = tail_repeats(ids[:n], rules)
        got = det.feed(ids[:n]) is not None
        assert got == expected, (ids[:n], n)
        if got:
            break


def test_rules_reject_degenerate_values() -> None:
    with pytest.raises(ValueError, match="repeats"):
        LoopRules(repeats=1)
    with pytest.raises(ValueError, match="ngram"):
        LoopRules(ngram=1)
