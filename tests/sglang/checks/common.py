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


def marks(func: Any) -> list:
    """Every adapter's mark on a target, outermost first (hooks on one target chain by __wrapped__)."""
    found = []
    while func is not None and len(found) < 32:
        if getattr(func, "__dsv41_adapter__", None):
            found.append(func.__dsv41_adapter__)
        func = getattr(func, "__wrapped__", None)
    return found


async def asgi_get(app: Any, path: str, headers: list[tuple[bytes, bytes]] | None = None) -> tuple[int, str]:
    """One HTTP GET through an ASGI app, as uvicorn would send it: (status, body text)."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"host", b"localhost"), *(headers or [])], "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8888),
    }
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], body.decode()


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


class Anything:
    """A scheduler stand-in: every attribute is a no-op callable (or `fixed`), so an SGLang method
    runs through on it."""

    def __init__(self, **fixed: Any) -> None:
        self.__dict__.update(fixed)

    def __getattr__(self, name: str) -> "Anything":
        return Anything()

    def __call__(self, *args: Any, **kwargs: Any) -> "Anything":
        return Anything()

    def __bool__(self) -> bool:
        return False
