"""SGLang's command line as SGLang's parser reads it: every flag in its canonical spelling.

SGLang parses its argv with argparse and allow_abbrev left on, so `--node-ra=2` is `--node-rank=2`,
`--tp-s 4` is `--tp-size 4`, `--model` is `--model-path` and `--api-ke=K` is `--api-key=K`. A check
that compares spellings (the config check's owned and secret flags, argcheck) must first spell
every flag as SGLang will understand it. This module applies argparse's rules (Python 3.11/3.12
`ArgumentParser._parse_optional`) over the option table of SGLang 0.5.23
(coordinator/sglang_options.py, generated from the real parser; the sglang tier checks both).
Pure functions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from .sglang_options import OPTIONS, SGLANG_VERSION

_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")  # argparse's _negative_number_matcher


def _canonical(strings: tuple[str, ...]) -> str:
    return next((s for s in strings if s.startswith("--")), strings[0])


CANONICAL: dict[str, str] = {s: _canonical(strings) for strings in OPTIONS for s in strings}


@dataclass(frozen=True)
class Word:
    text: str  # the word as SGLang will see it: a flag in its canonical spelling (with =value kept)
    flag: str | None  # the canonical flag this word names; None for a value
    error: str | None = None  # why SGLang would refuse it (ambiguous, unknown); never holds a value


def resolve(word: str) -> Word:
    """How argparse classifies one argv word, and which option it names."""
    if not word or word[0] != "-":
        return Word(word, None)
    if word in CANONICAL:
        return Word(CANONICAL[word], CANONICAL[word])
    if len(word) == 1:
        return Word(word, None)
    name, sep, value = word.partition("=")
    if sep and name in CANONICAL:
        return Word(CANONICAL[name] + "=" + value, CANONICAL[name])
    matches = _prefix_matches(word)
    if len({CANONICAL[m] for m, _ in matches}) > 1:
        shown = name if word.startswith("--") else word[:2]
        return Word(word, None, f"{shown} is ambiguous to SGLang's parser: it could mean "
                    f"{', '.join(sorted({CANONICAL[m] for m, _ in matches}))}; spell the flag in full")
    if matches:
        option, explicit = matches[0]
        canonical = CANONICAL[option]
        return Word(canonical if explicit is None else f"{canonical}={explicit}", canonical)
    if _NEGATIVE_NUMBER.match(word) or " " in word:
        return Word(word, None)  # a value
    return Word(word, None, f"{name} is not a flag of SGLang {SGLANG_VERSION} (it would stop with "
                f"'unrecognized arguments')")


def _prefix_matches(word: str) -> list[tuple[str, str | None]]:
    """argparse's _get_option_tuples: (option string, explicit value) for every option the word
    abbreviates."""
    out: list[tuple[str, str | None]] = []
    if word.startswith("--"):
        prefix, sep, explicit = word.partition("=")
        for option in CANONICAL:
            if option.startswith(prefix):
                out.append((option, explicit if sep else None))
    elif word[0] == "-" and word[1] != "-":
        short, attached = word[:2], word[2:]
        for option in CANONICAL:
            if option == short:
                out.append((option, attached or None))
            elif option.startswith(word):
                out.append((option, None))
    return out


def canonicalize(words: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the words with every flag spelled as SGLang reads it, what SGLang would refuse)."""
    out, errors = [], []
    for i, word in enumerate(words):
        if word == "--":
            errors.append("-- ends SGLang's flags, and SGLang takes no other arguments")
            out.extend(words[i:])
            break
        resolved = resolve(word)
        out.append(resolved.text)
        if resolved.error:
            errors.append(resolved.error)
    return out, errors
