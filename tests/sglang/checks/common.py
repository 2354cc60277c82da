"""Helpers shared by the check scripts (run by the venv's python, not by pytest)."""

from __future__ import annotations

import json
import sys
from typing import Any


def emit(result: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(result, sort_keys=True) + "\n")
    sys.stdout.flush()


def installer():
    from adapter.patching import armed_finder

    finder = armed_finder()
    return None if finder is None else finder.installer


def marked(func: Any) -> Any:
    return getattr(func, "__dsv41_adapter__", None)


class WordTokenizer:
    """Stands in for the HF tokenizer a scheduler's Req holds: decode() plus the EOS fields."""

    eos_token_id = None
    additional_stop_token_ids = None

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.words: list[str] = []

    def encode(self, text: str) -> list[int]:
        out = []
        for piece in text.replace("\n", " \n ").split(" "):
            if not piece:
                continue
            word = "\n" if piece == "\n" else piece + " "
            if word not in self.ids:
                self.ids[word] = len(self.words) + 1000
                self.words.append(word)
            out.append(self.ids[word])
        return out

    def decode(self, ids, **_kwargs) -> str:
        return "".join(self.words[i - 1000] for i in ids)
