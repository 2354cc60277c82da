"""The row reader an SGLang rank uses: its own packed shard on local disk, one positioned read
a row.

Rows are addressed by global id. Ids outside the rank's range come back as zeros: every rank looks
up every id and the partial embeddings are summed by the TP all-reduce, so exactly one rank
contributes each row. Misses are read through a pool of threads (the drive only reaches its IOPS
at a deep queue); an optional set-associative cache sits in front. Stdlib only.

Given a native library (adapter/engram/native.py), the store reads through its native reader
instead: the same rows, cache and statistics, on native threads and without the GIL. The Python
path stays the reference the native one is tested against, and what serves when no compiler is
there to build the library.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from array import array
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from adapter.engram.cache import RowCache
from adapter.engram.settings import StoreSettings
from adapter.engram.stats import RowStats
from dsv41 import engram_format as fmt

if TYPE_CHECKING:
    from adapter.engram.native import Library, NativeReader

_ZERO_ROW = bytes(fmt.ROW_BYTES)
# Queue depth comes from the WILLNEED hints each task issues for all its rows before reading them;
# threads only overlap the Python work between syscalls, and the GIL makes more than a few busy
# ones cost more in switching than they gain (measured: bench/row_store). A batch of up to this
# many rows is read on the caller's thread; larger ones are split into tasks of about this size.
_ROWS_PER_TASK = 512
# Rows per read while loading the resident scales: one sequential pass over the shard.
_SCAN_ROWS = 32768
_log = logging.getLogger("dsv41.engram")


class StoreError(RuntimeError):
    """A packed shard that cannot serve this rank (the message names the fix)."""


def validate_file(fd: int, path: str | Path, *, layer: int, rank: int, tp: int,
                  total_rows: int | None = None) -> fmt.Header:
    """Check header and size of an open shard against the range this rank needs.

    Without ``total_rows`` the header's own row count is trusted, and the range is still checked.
    """
    try:
        found = fmt.decode_header(os.pread(fd, fmt.HEADER_BYTES, 0))
    except fmt.HeaderError as e:
        raise StoreError(f"{path}: not a complete packed Engram shard ({e}); "
                         f"{fmt.REPACK_HINT}") from None
    expected = fmt.expected_header(layer, found.total_rows if total_rows is None else total_rows,
                                   rank, tp)
    why = fmt.mismatch(found, expected)
    if why:
        raise StoreError(f"{path}: {why}; {fmt.REPACK_HINT}")
    size = os.fstat(fd).st_size
    if size != found.file_bytes:
        raise StoreError(f"{path}: size is {size} bytes, {found.describe()} needs "
                         f"{found.file_bytes}; {fmt.REPACK_HINT}")
    return found


class RowStore:
    def __init__(self, path: str | Path, *, layer: int, rank: int, tp: int,
                 total_rows: int | None = None, settings: StoreSettings = StoreSettings(),
                 clock: Callable[[], float] = time.monotonic,
                 log: Callable[[str], None] = _log.info, native: Library | None = None) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        self.native: NativeReader | None = None
        try:
            self.header = validate_file(self._fd, self.path, layer=layer, rank=rank, tp=tp,
                                        total_rows=total_rows)
            # Misses are random: readahead would only drag in neighbours nobody asked for.
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
            # The native reader keeps a cache of its own: this one would only double the memory.
            self._cache = RowCache(settings.cache_bytes, settings.cache_ways) \
                if settings.cache_bytes > 0 and native is None else None
            self._scales = self._load_scales() if settings.resident_scales else None
            if native is not None:
                self.native = native.open(self._fd, self.path, self.header, scales=self._scales_address(),
                                          cache_bytes=settings.cache_bytes, cache_ways=settings.cache_ways,
                                          threads=settings.io_threads if settings.io_threads > 1 else 0)
        except BaseException:
            os.close(self._fd)
            raise
        self.settings = settings
        self._pool = ThreadPoolExecutor(settings.io_threads,
                                        thread_name_prefix=f"engram-l{layer}-io") \
            if settings.io_threads > 1 and self.native is None else None
        self.stats = RowStats(f"engram layer {layer} rank {rank}/{tp}", settings.stats_seconds,
                              clock, log, cache_enabled=settings.cache_bytes > 0)
        if self.native is not None:
            self.stats.attach(self.native.take_stats)

    @property
    def reader(self) -> str:
        """Which path reads the rows: "native" or "python"."""
        return "native" if self.native is not None else "python"

    def _scales_address(self) -> int | None:
        if self._scales is None:
            return None
        return ctypes.addressof(ctypes.c_char.from_buffer(self._scales_bytes))

    @classmethod
    def open_rank(cls, packed_dir: str | Path, *, layer: int, rank: int, tp: int,
                  total_rows: int | None = None, settings: StoreSettings | None = None,
                  **kwargs: object) -> RowStore:
        """Open ``engram-l{layer}-r{rank}of{tp}.bin`` in ``packed_dir`` (DSV41_PACKED_DIR)."""
        path = Path(packed_dir) / fmt.file_name(layer, rank, tp)
        if not path.exists():
            raise StoreError(f"{path}: no packed Engram shard for layer {layer}, rank {rank} of "
                             f"tp {tp}; {fmt.REPACK_HINT}")
        return cls(path, layer=layer, rank=rank, tp=tp, total_rows=total_rows,
                   settings=settings or StoreSettings.from_env(), **kwargs)

    def read_rows(self, ids: Sequence[int]) -> bytearray:
        """``len(ids)`` packed rows of 264 bytes, zeros for ids this rank does not own."""
        out = bytearray(len(ids) * fmt.ROW_BYTES)
        self.read_rows_into(ids, memoryview(out), zeroed=True)
        return out

    def read_rows_into(self, ids: Sequence[int], out: memoryview, zeroed: bool = False) -> None:
        """Fill a writable buffer of ``len(ids) * 264`` bytes (e.g. a pinned host tensor)."""
        if out.nbytes != len(ids) * fmt.ROW_BYTES:
            raise ValueError(f"buffer is {out.nbytes} bytes, {len(ids)} rows need "
                             f"{len(ids) * fmt.ROW_BYTES}")
        out = out.cast("B") if out.format != "B" else out
        if self.native is not None:
            self._read_native(ids, out)
            return
        started = time.perf_counter_ns()
        lo, hi = self.header.row_lo, self.header.row_hi
        wanted: dict[int, list[int]] = {}  # row -> positions; a repeated id is read once
        for pos, row in enumerate(ids):
            if lo <= row < hi:
                wanted.setdefault(row, []).append(pos)
            elif not zeroed:
                out[pos * fmt.ROW_BYTES:(pos + 1) * fmt.ROW_BYTES] = _ZERO_ROW
        rows = list(wanted)
        first = [wanted[r][0] for r in rows]
        hits = 0
        if self._cache is not None and rows:
            missed = self._cache.get_into(rows, out, first)
            hits = len(rows) - len(missed)
            rows = [rows[k] for k in missed]
            first = [first[k] for k in missed]
        latencies = self._read(rows, first, out)
        if self._cache is not None and rows:
            self._cache.put_from(rows, out, first)
        for positions in wanted.values():
            if len(positions) > 1:
                src = positions[0] * fmt.ROW_BYTES
                for pos in positions[1:]:
                    out[pos * fmt.ROW_BYTES:(pos + 1) * fmt.ROW_BYTES] = \
                        out[src:src + fmt.ROW_BYTES]
        self.stats.record(len(ids), hits, len(rows), latencies,
                          time.perf_counter_ns() - started)

    def _read_native(self, ids: Sequence[int], out: memoryview) -> None:
        if out.readonly:
            raise ValueError("the rows need a writable buffer")
        try:
            packed = array("q", ids)
        except OverflowError:  # beyond int64: no rank owns it, as -1
            packed = array("q", (i if -2**63 <= i < 2**63 else -1 for i in ids))
        target = ctypes.addressof((ctypes.c_char * out.nbytes).from_buffer(out)) if packed else 0
        self.native.read(packed.buffer_info()[0] if packed else 0, len(packed), target)
        self.stats.poll()

    def _read(self, rows: list[int], positions: list[int], out: memoryview) -> list[int]:
        if not rows:
            return []
        if self._pool is None or len(rows) <= _ROWS_PER_TASK:
            return self._read_some(rows, positions, out)
        k = min(self.settings.io_threads, -(-len(rows) // _ROWS_PER_TASK))
        futures = [self._pool.submit(self._read_some, rows[i::k], positions[i::k], out)
                   for i in range(k)]
        latencies: list[int] = []
        for f in futures:
            latencies.extend(f.result())
        return latencies

    def _read_some(self, rows: list[int], positions: list[int], out: memoryview) -> list[int]:
        fd, lo, size = self._fd, self.header.row_lo, fmt.ROW_BYTES
        base = fmt.HEADER_BYTES - lo * size
        scales = self._scales
        length = fmt.WEIGHT_BYTES if scales is not None else size  # resident: weights only
        if len(rows) > 1:
            # Queue every row's page read first (asynchronous readahead of exactly that range),
            # so the drive sees the whole batch at once instead of one read per thread.
            try:
                for row in rows:
                    os.posix_fadvise(fd, base + row * size, length, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass  # only a hint: the reads below report what is wrong
        latencies = []
        clock = time.perf_counter_ns
        for row, pos in zip(rows, positions):
            at = pos * size
            t0 = clock()
            try:
                n = os.preadv(fd, [out[at:at + length]], base + row * size)
            except OSError as e:
                raise StoreError(f"{self.path}: reading row {row} failed: {e.strerror} "
                                 f"(errno {e.errno})") from e
            latencies.append(clock() - t0)
            if n != length:
                raise StoreError(f"{self.path}: short read of row {row} ({n} of {length} bytes): "
                                 f"the file changed under the rank; {fmt.REPACK_HINT}")
            if scales is not None:
                k = (row - lo) * fmt.SCALE_BYTES
                out[at + length:at + size] = scales[k:k + fmt.SCALE_BYTES]
        return latencies

    def _load_scales(self) -> memoryview:
        """The 8 scale bytes of every owned row, in row order, from one sequential pass."""
        rows = self.header.rows
        scales = bytearray(rows * fmt.SCALE_BYTES)
        buf = bytearray(min(rows, _SCAN_ROWS) * fmt.ROW_BYTES)
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        for first in range(0, rows, _SCAN_ROWS):
            count = min(_SCAN_ROWS, rows - first)
            view = memoryview(buf)[:count * fmt.ROW_BYTES]
            n = os.preadv(self._fd, [view], fmt.HEADER_BYTES + first * fmt.ROW_BYTES)
            if n != len(view):
                raise StoreError(f"{self.path}: short read at row {self.header.row_lo + first} "
                                 f"while loading the resident scales; {fmt.REPACK_HINT}")
            at = first * fmt.SCALE_BYTES
            for k in range(fmt.SCALE_BYTES):  # strided copies: byte k of every row's scales
                scales[at + k:at + count * fmt.SCALE_BYTES:fmt.SCALE_BYTES] = \
                    buf[fmt.WEIGHT_BYTES + k:count * fmt.ROW_BYTES:fmt.ROW_BYTES]
        # The pass must not leave the whole shard in the page cache, nor readahead switched on.
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
        self._scales_bytes = scales  # the native reader reads them at this address
        return memoryview(scales)

    def close(self) -> None:
        if self.native is not None:
            self.native.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._cache is not None:
            self._cache.close()
        os.close(self._fd)

    def __enter__(self) -> RowStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

