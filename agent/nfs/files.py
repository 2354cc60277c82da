"""Small file effects: replace a file atomically, so a reader (exportfs, nfs-ganesha, the agent
after a crash) sees the old content or the new one, never half of it."""

from __future__ import annotations

import os


def read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return None


def write_atomic(path: str, text: str, mode: int = 0o644) -> bool:
    """Writes `text` to `path` through a temporary file in the same directory, fsync and rename.
    Returns False (and writes nothing) when the file already has exactly this content."""
    if read_text(path) == text:
        return False
    directory = os.path.dirname(path) or "."
    # Not tempfile: it imports shutil, bz2, lzma and random into the long-lived agent for one name.
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.{os.urandom(6).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a power cut
    finally:
        os.close(dir_fd)
    return True


def remove(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
