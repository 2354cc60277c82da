"""Real memory held by a request's prefill: one anonymous mmap per chunk, every page touched, so
the kernel, the cgroup and MemAvailable all see it; munmap gives it straight back to the OS
(a Python list or bytearray would be kept by the allocator)."""

from __future__ import annotations

import mmap
import threading

PAGE = mmap.PAGESIZE


class ChunkMemory:
    """The chunks of one request. Thread-safe; release() is idempotent."""

    def __init__(self) -> None:
        self._maps: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self._bytes = 0

    def grow(self, nbytes: int) -> None:
        """Map and touch nbytes more. Raises MemoryError/OSError when the kernel refuses."""
        if nbytes <= 0:
            return
        size = -(-nbytes // PAGE) * PAGE
        region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region[::PAGE] = b"\x01" * (size // PAGE)  # one write per page makes it resident
        with self._lock:
            self._maps.append(region)
            self._bytes += size

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._bytes

    def release(self) -> None:
        with self._lock:
            maps, self._maps, self._bytes = self._maps, [], 0
        for region in maps:
            region.close()
