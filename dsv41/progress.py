"""A rank's forward-step counter, shared with its node's agent through a small file in /dev/shm.

The rank (the adapter's hook in SGLang's scheduler loop, or the stand-in engine) bumps the counter
at the start of every forward step: a store into a shared mapping, no system call, nothing that
talks to the agent. The agent reads the file when it sends a heartbeat, so the coordinator sees
which rank stopped stepping first when a TP group hangs (the hung rank never starts the step its
peers wait in).

Layout (little-endian u64 words, one 4096-byte page): magic "DSV41PR1", seqlock word (odd while a
write is under way), forward count, CLOCK_MONOTONIC ns of the last step (0 before the first),
CLOCK_MONOTONIC ns when the counter was created, pid of the writer, TP rank. CLOCK_MONOTONIC is one
clock per node (the rank and the agent share the kernel), so the agent can tell the step's age.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
import time
from dataclasses import dataclass

DIRECTORY = "/dev/shm"
PREFIX = "dsv41-progress-tp"
MAGIC = int.from_bytes(b"DSV41PR1", "little")
SIZE = 4096
_WORDS = struct.Struct("<7Q")  # magic, seq, count, last_ns, created_ns, pid, tp_rank
_SEQ_OFFSET, _COUNT_OFFSET, _LAST_OFFSET = 8, 16, 24
_U64 = struct.Struct("<Q")


def path_for(tp_rank: int, directory: str = DIRECTORY) -> str:
    return os.path.join(directory, f"{PREFIX}{tp_rank}")


def create_shared(path: str, size: int, initialise) -> mmap.mmap:
    """A new shared-memory file of `size` bytes at `path`, replacing a previous one, its header
    written by `initialise(map)` before it appears: a reader never sees a half-made file."""
    temporary = f"{path}.{os.getpid()}"
    fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.ftruncate(fd, size)
        mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    initialise(mapped)
    os.replace(temporary, path)
    return mapped


class ProgressWriter:
    """The rank's side: create the file for this TP rank (replacing a previous run's), then step()."""

    def __init__(self, tp_rank: int, directory: str = DIRECTORY, clock_ns=time.monotonic_ns):
        self.path = path_for(tp_rank, directory)
        self.pid = os.getpid()
        self._clock_ns = clock_ns
        self._count = 0
        self._seq = 0
        self._map = create_shared(self.path, SIZE,
                                  lambda m: _WORDS.pack_into(m, 0, MAGIC, 0, 0, 0, clock_ns(), os.getpid(), tp_rank))

    @property
    def count(self) -> int:
        return self._count

    def step(self) -> None:
        self._count += 1
        self._seq += 1
        _U64.pack_into(self._map, _SEQ_OFFSET, self._seq * 2 - 1)
        _U64.pack_into(self._map, _COUNT_OFFSET, self._count)
        _U64.pack_into(self._map, _LAST_OFFSET, self._clock_ns())
        _U64.pack_into(self._map, _SEQ_OFFSET, self._seq * 2)

    def close(self) -> None:
        self._map.close()


@dataclass(frozen=True)
class Progress:
    tp_rank: int
    count: int  # forward steps since the rank started
    last_step_age_s: float  # since its last step, or since it started when it has made none
    pid: int
    problem: str = ""  # why the file could not be trusted or read ("" when fine)


def read(path: str, now_ns: int | None = None, allowed_uids: tuple[int, ...] = (0,)) -> Progress | None:
    """The counter in `path`; None when there is no file. A file not owned by an allowed user, or
    writable by group or other (anyone could fake a rank's progress), is reported with its problem."""
    now = time.monotonic_ns() if now_ns is None else now_ns
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return Progress(-1, 0, 0.0, 0, f"{path}: {exc.strerror or exc}")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return Progress(-1, 0, 0.0, 0, f"{path}: not a regular file")
        if st.st_uid not in allowed_uids or st.st_mode & 0o022:
            return Progress(-1, 0, 0.0, 0, f"{path}: owned by uid {st.st_uid} with mode {st.st_mode & 0o777:04o}; "
                                           "only root may write a rank's progress")
        data = os.pread(fd, _WORDS.size, 0)
        for _ in range(100):
            if len(data) < _WORDS.size:
                return Progress(-1, 0, 0.0, 0, f"{path}: {len(data)} bytes, not a progress file")
            magic, seq, count, last_ns, created_ns, pid, tp_rank = _WORDS.unpack(data)
            if magic != MAGIC:
                return Progress(-1, 0, 0.0, 0, f"{path}: not a progress file")
            if seq % 2 == 0:
                again = os.pread(fd, _WORDS.size, 0)
                if again == data:
                    since = last_ns or created_ns
                    return Progress(tp_rank, count, max(0.0, (now - since) / 1e9), pid)
                data = again
            else:
                data = os.pread(fd, _WORDS.size, 0)
        return Progress(-1, 0, 0.0, 0, f"{path}: always being written")
    finally:
        os.close(fd)


def read_all(directory: str = DIRECTORY, now_ns: int | None = None,
             allowed_uids: tuple[int, ...] = (0,)) -> list[Progress]:
    """Every rank's counter on this node, by TP rank (a stale file of a dead writer included: the
    agent tells by the pid)."""
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith(PREFIX) and n[len(PREFIX):].isdigit())
    except OSError:
        return []
    out = []
    for name in names:
        found = read(os.path.join(directory, name), now_ns, allowed_uids)
        if found is not None:
            out.append(found)
    return out
