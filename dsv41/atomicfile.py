"""Replacing a file atomically: a reader (exportfs, nfs-ganesha, an agent or coordinator after a
crash, a rank reading its key) sees the old content or the new one, never half of it, and the new
one survives a power cut once this returns."""

from __future__ import annotations

import os


def replace_file(path: str, data: bytes, mode: int, owner: tuple[int, int] | None = None) -> None:
    """Writes `data` to a temporary file beside `path` (mode and owner set before anything is in
    it), fsyncs it, renames it over `path` and fsyncs the directory."""
    directory = os.path.dirname(path) or "."
    # Not tempfile: it imports shutil, bz2, lzma and random into the long-lived agent for one name.
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.{os.urandom(6).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            if owner is not None:
                os.fchown(f.fileno(), *owner)
            os.fchmod(f.fileno(), mode)  # whatever the umask was
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
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
