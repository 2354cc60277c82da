"""Small file effects: replace a file atomically, so a reader (exportfs, nfs-ganesha, the agent
after a crash) sees the old content or the new one, never half of it."""

from __future__ import annotations

import os

from dsv41.atomicfile import replace_file


def read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return None


def write_atomic(path: str, text: str, mode: int = 0o644) -> bool:
    """Replaces `path` with `text` atomically (dsv41.atomicfile). Returns False (and writes nothing)
    when the file already has exactly this content."""
    if read_text(path) == text:
        return False
    replace_file(path, text.encode("utf-8"), mode)
    return True


def remove(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
