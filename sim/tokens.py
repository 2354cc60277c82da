"""Token counting of the stand-in: deterministic and cheap, close enough to a BPE tokenizer on
English prose (about four bytes a token) for memory and load figures to be realistic."""

from __future__ import annotations

import json
import re
from typing import Any, Iterable

BYTES_PER_TOKEN = 4
_PIECE = re.compile(r"\S+\s*|\s+")


def count_tokens(text: str) -> int:
    """ceil(UTF-8 bytes / 4); 0 for an empty text."""
    return -(-len(text.encode("utf-8")) // BYTES_PER_TOKEN)


def content_text(content: Any) -> str:
    """The text of an OpenAI message content: a string, or a list of parts of which text parts count."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(part.get("text", "")) for part in content
                         if isinstance(part, dict) and part.get("type") == "text")
    raise ValueError("message content must be a string, a list of parts or null")


def prompt_text(messages: Iterable[dict]) -> str:
    """What the stand-in counts as the prompt: the messages' texts (and the arguments of earlier
    tool calls) joined by newlines. The chat template's own tokens are not counted."""
    parts = []
    for message in messages:
        parts.append(content_text(message.get("content")))
        for call in message.get("tool_calls") or ():
            function = call.get("function") or {}
            arguments = function.get("arguments", "")
            parts.append(arguments if isinstance(arguments, str) else json.dumps(arguments))
    return "\n".join(parts)


def output_pieces(text: str) -> list[str]:
    """An answer split into output tokens: a word with the whitespace after it is one token.
    The pieces join back to the text exactly."""
    return _PIECE.findall(text)
