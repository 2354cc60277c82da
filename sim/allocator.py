"""The stand-in's model of PyTorch's native CUDA caching allocator (expandable_segments:False, what
the rank runs), enough of it to give memory back the way the real engine does.

What it keeps from c10/cuda/CUDACachingAllocator.cpp (checked against torch's own allocator on
a GPU, operation by operation, by bench/allocator_fidelity):
- a request is rounded up to 512 bytes; requests of up to 1 MiB are served from the small pool,
  whose segments are 2 MiB, larger ones from the large pool, whose new segment is 20 MiB for
  requests under 10 MiB and the request rounded up to 2 MiB otherwise; a segment is resident at
  once (cudaMalloc on GB10's unified memory takes physical pages);
- a request is served from the smallest cached free block of its pool that fits (best fit),
  split when 512 bytes or more (small pool) or more than 1 MiB (large pool) would be left over;
- a freed block goes back to the cache, merged with free neighbours of its own segment only:
  the process keeps the memory, and the next request that fits reuses it;
- empty_cache() returns every segment that is wholly free to the OS, and nothing else.
So a chunked prefill whose buffers grow with the prefix needs a new segment every chunk (no cached
block is big enough), and an aborted request's memory stays with the process until an
empty_cache() (the prefill_empty_cache adapter's hook, between a long prompt's chunks).

The bookkeeping is pure; segments come from a `Backing` (real anonymous memory in the stand-in, a
counter in tests and benchmarks).
"""

from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass, field
from typing import Protocol

MiB = 1 << 20
ROUND = 512
SMALL = 1 * MiB          # kSmallSize: the largest small-pool request; the most a large split may leave unsplit
SMALL_BUFFER = 2 * MiB   # kSmallBuffer: the small pool's segment
MIN_LARGE_ALLOC = 10 * MiB
LARGE_BUFFER = 20 * MiB  # the segment for requests under MIN_LARGE_ALLOC
ROUND_LARGE = 2 * MiB
_MADV_POPULATE_WRITE = 23  # Linux 5.14; mmap does not name it before Python 3.13


def round_size(nbytes: int) -> int:
    return max(ROUND, -(-nbytes // ROUND) * ROUND)


def segment_size(nbytes: int) -> int:
    """What cudaMalloc is asked for when no cached block fits a request of `nbytes` (rounded)."""
    if nbytes <= SMALL:
        return SMALL_BUFFER
    if nbytes < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-nbytes // ROUND_LARGE) * ROUND_LARGE


class Backing(Protocol):
    def map(self, nbytes: int) -> object:
        """Resident memory of nbytes; raises MemoryError/OSError when the system refuses."""

    def unmap(self, handle: object) -> None: ...


class AnonymousMemory:
    """Real memory: an anonymous mapping with every page written, so the kernel, the cgroup and
    MemAvailable see it; unmapped, it goes straight back to the OS."""

    def map(self, nbytes: int) -> object:
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            region.madvise(_MADV_POPULATE_WRITE)  # the kernel faults it in, far faster than a write per page
        except OSError:
            region[::mmap.PAGESIZE] = b"\x01" * (nbytes // mmap.PAGESIZE)
        return region

    def unmap(self, handle: object) -> None:
        handle.close()  # type: ignore[attr-defined]


class CountedMemory:
    """No memory, only the count: for tests and benchmarks of the bookkeeping."""

    def __init__(self) -> None:
        self.mapped = 0

    def map(self, nbytes: int) -> object:
        self.mapped += nbytes
        return nbytes

    def unmap(self, handle: object) -> None:
        self.mapped -= int(handle)  # type: ignore[arg-type]


@dataclass(eq=False)
class Block:
    segment: "Segment"
    offset: int
    size: int
    free: bool = True


@dataclass(eq=False)
class Segment:
    size: int
    handle: object = None
    blocks: list[Block] = field(default_factory=list)
    small: bool = False  # of the small pool: serves requests of up to SMALL alone

    def wholly_free(self) -> bool:
        return len(self.blocks) == 1 and self.blocks[0].free


@dataclass(frozen=True)
class AllocatorStats:
    reserved: int     # what the process holds from the OS (torch.cuda.memory_reserved)
    allocated: int    # what live tensors use (torch.cuda.memory_allocated)
    peak_reserved: int
    segments: int


class CachingAllocator:
    """Thread-safe: the scheduler allocates while request threads free what their request held."""

    def __init__(self, backing: Backing) -> None:
        self._backing = backing
        self._segments: list[Segment] = []
        self._lock = threading.Lock()
        self._allocated = 0
        self._reserved = 0
        self._peak = 0

    def malloc(self, nbytes: int) -> Block | None:
        """A block of at least nbytes (None for 0). MemoryError/OSError when a new segment is refused."""
        if nbytes <= 0:
            return None
        size = round_size(nbytes)
        with self._lock:
            block = self._best_fit(size)
            if block is None:
                segment = Segment(segment_size(size), small=size <= SMALL)
                segment.handle = self._backing.map(segment.size)  # the OOM-prone step, as cudaMalloc is
                block = Block(segment, 0, segment.size)
                segment.blocks.append(block)
                self._segments.append(segment)
                self._reserved += segment.size
                self._peak = max(self._peak, self._reserved)
            left = block.size - size
            if left >= ROUND if block.segment.small else left > SMALL:
                rest = Block(block.segment, block.offset + size, block.size - size)
                blocks = block.segment.blocks
                blocks.insert(blocks.index(block) + 1, rest)
                block.size = size
            block.free = False
            self._allocated += block.size
            return block

    def free(self, block: Block | None) -> None:
        """Back to the cache (never to the OS); freeing a block twice is a no-op."""
        if block is None:
            return
        with self._lock:
            if block.free:
                return
            block.free = True
            self._allocated -= block.size
            blocks = block.segment.blocks
            i = blocks.index(block)
            if i + 1 < len(blocks) and blocks[i + 1].free:
                block.size += blocks.pop(i + 1).size
            if i > 0 and blocks[i - 1].free:
                blocks[i - 1].size += blocks.pop(i).size

    def empty_cache(self) -> int:
        """Returns every wholly free segment to the OS; the bytes returned."""
        with self._lock:
            free = [s for s in self._segments if s.wholly_free()]
            self._segments = [s for s in self._segments if not s.wholly_free()]
            released = sum(s.size for s in free)
            self._reserved -= released
        for segment in free:
            self._backing.unmap(segment.handle)
        return released

    def stats(self) -> AllocatorStats:
        with self._lock:
            return AllocatorStats(self._reserved, self._allocated, self._peak, len(self._segments))

    def _best_fit(self, size: int) -> Block | None:
        best = None
        small = size <= SMALL
        for segment in self._segments:
            if segment.small != small:
                continue
            for block in segment.blocks:
                if block.free and block.size >= size and (best is None or block.size < best.size):
                    best = block
        return best
