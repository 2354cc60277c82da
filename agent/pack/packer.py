"""The pack job: copy this rank's Engram rows from the checkpoint into packed shards on local disk.

Per layer: rows [lo, hi) of the weight tensor ([N, 256]) and the scale tensor ([N, 8]) are read
sequentially (the checkpoint is on NFS for workers) with scattering reads (preadv) that land each
row's weight and scale bytes side by side in a block buffer, so the kernel's copy is the interleave
and no Python loop touches the bytes. Blocks are written sequentially to
``engram-l{L}-r{R}of{TP}.bin.partial`` while the next block is read on a second thread.

Crash safety: the partial file carries its own header (another magic, so it never passes for a
shard) with ``rows_done``, which is raised only after the rows before it were fsync'ed. A pack
killed at any point (SIGKILL, power loss) resumes from ``rows_done``, after checking sampled rows
before it against the checkpoint. Only a fully written, fsync'ed and sample-verified file gets the
real header and is renamed to its final name. Space is checked up front and reserved with
posix_fallocate, so a full disk fails before any existing file is touched.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dsv41 import engram_format as fmt
from agent.pack.checkpoint import EngramTable, SourceRows, engram_tables
from agent.pack.state import Status, layer_state
from agent.pack.verify import first_mismatch, sample_rows
from dsv41.sdnotify import SdNotify

MiB = 2**20
GiB = 2**30
_BUFFERS = 3  # block buffers: the reader may run two blocks ahead of the writer
_IOV_ROWS = 1024  # rows per preadv call: IOV_MAX is 1024 on Linux, one iovec a row and tensor
_RESUME_SAMPLE_ROWS = 8


class PackError(RuntimeError):
    """The pack cannot proceed; the message says why and what to do."""


@dataclass(frozen=True)
class PackJob:
    model_dir: Path
    out_dir: Path
    rank: int
    tp: int
    layers: tuple[int, ...] = fmt.LAYERS
    block_bytes: int = 8 * MiB  # per read and write; buffers hold two blocks plus their iovecs
    checkpoint_bytes: int = 1 * GiB
    verify_rows: int = 64
    max_bytes_per_s: float | None = None  # throttle (e.g. to spare a shared NFS link)

    def __post_init__(self) -> None:
        fmt.check_rank(self.rank, self.tp)
        for layer in self.layers:
            fmt.check_layer(layer)
        if not self.layers or len(set(self.layers)) != len(self.layers):
            raise ValueError(f"layers must be distinct and not empty, got {self.layers}")
        if self.block_bytes < fmt.ROW_BYTES or self.checkpoint_bytes < fmt.ROW_BYTES:
            raise ValueError(f"block and checkpoint sizes must be at least one row "
                             f"({fmt.ROW_BYTES} bytes)")
        if self.verify_rows < 0:
            raise ValueError(f"verify_rows must be >= 0, got {self.verify_rows}")
        if self.max_bytes_per_s is not None and not self.max_bytes_per_s > 0:
            raise ValueError(f"max_bytes_per_s must be > 0, got {self.max_bytes_per_s}")


def status_line(layer: int, done: int, total: int, rate_bps: float) -> str:
    """The STATUS= text while packing, e.g. 'layer 14: 41.2/63.0 GiB, 812 MB/s, ETA 27 s'."""
    eta = f"ETA {max(total - done, 0) / rate_bps:.0f} s" if rate_bps > 0 else "ETA unknown"
    return (f"layer {layer}: {done / GiB:.1f}/{total / GiB:.1f} GiB, {rate_bps / 1e6:.0f} MB/s, "
            f"{eta}")


def disk_free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class _ScatterBlock:
    """A block buffer of 264-byte rows with, per row, an iovec for its weight and one for its
    scale, built once and reused for every block."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.buf = bytearray(rows * fmt.ROW_BYTES)
        view = memoryview(self.buf)
        at = [r * fmt.ROW_BYTES for r in range(rows)]
        self._weights = [view[a:a + fmt.WEIGHT_BYTES] for a in at]
        self._scales = [view[a + fmt.WEIGHT_BYTES:a + fmt.ROW_BYTES] for a in at]

    def read(self, n: int, wfd: int, woff: int, sfd: int, soff: int, what: str) -> memoryview:
        """Fill the first ``n`` rows from weight bytes at ``woff`` and scale bytes at ``soff``."""
        for r0 in range(0, n, _IOV_ROWS):
            r1 = min(n, r0 + _IOV_ROWS)
            _preadv_all(wfd, self._weights[r0:r1], woff + r0 * fmt.WEIGHT_BYTES, what)
            _preadv_all(sfd, self._scales[r0:r1], soff + r0 * fmt.SCALE_BYTES, what)
        return memoryview(self.buf)[:n * fmt.ROW_BYTES]


def _preadv_all(fd: int, iovs: list[memoryview], offset: int, what: str) -> None:
    want = sum(v.nbytes for v in iovs)
    got = os.preadv(fd, iovs, offset)
    while got < want:  # short read: continue after the bytes that arrived
        skip = got
        rest = []
        for v in iovs:
            if skip >= v.nbytes:
                skip -= v.nbytes
            else:
                rest.append(v[skip:])
                skip = 0
        n = os.preadv(fd, rest, offset + got)
        if n == 0:
            raise PackError(f"{what}: the checkpoint file ends early at byte {offset + got}")
        got += n


def _pwrite_full(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done:], offset + done)


@dataclass
class _Layer:
    table: EngramTable
    target: fmt.Header
    path: Path
    partial: Path


class Packer:
    def __init__(self, job: PackJob, notify: SdNotify, *,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 free_bytes: Callable[[Path], int] = disk_free,
                 log: Callable[[str], None] | None = None) -> None:
        self.job = job
        self.notify = notify
        self._clock = clock
        self._sleep = sleep
        self._free_bytes = free_bytes
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))

    def run(self) -> list[Path]:
        """Pack every layer that is not already complete; returns the shard paths."""
        job = self.job
        tables = engram_tables(job.model_dir, job.layers)
        try:
            job.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise PackError(f"cannot create output directory {job.out_dir}: {e.strerror}") from None
        with SourceRows(tables) as source:
            todo = self._plan(tables, source)
            self._check_space(todo)
            names = ", ".join(str(x.target.layer) for x in todo) or "none"
            self.notify.ready(f"packing layers: {names}")
            for layer in todo:
                self._pack_layer(layer, source)
        self.notify.status("complete: " + ", ".join(
            f"layer {layer}" for layer in job.layers))
        return [job.out_dir / fmt.file_name(layer, job.rank, job.tp) for layer in job.layers]

    def _plan(self, tables: dict[int, EngramTable], source: SourceRows) -> list[_Layer]:
        job, todo = self.job, []
        for layer in job.layers:
            state = layer_state(job.out_dir, layer, job.rank, job.tp, tables[layer], source,
                                sample=job.verify_rows)
            partial = job.out_dir / fmt.partial_name(layer, job.rank, job.tp)
            if state.status is Status.COMPLETE:
                self._log(f"layer {layer}: {state.detail}; skipped")
                if partial.exists():  # left from an attempt the complete file supersedes
                    partial.unlink()
                    self._log(f"layer {layer}: removed leftover {partial.name}")
                continue
            self._log(f"layer {layer}: {state.status.value}: {state.detail}")
            todo.append(_Layer(tables[layer],
                               fmt.expected_header(layer, tables[layer].rows, job.rank, job.tp),
                               state.path, partial))
        return todo

    def _check_space(self, todo: list[_Layer]) -> None:
        need = 0
        for layer in todo:
            try:
                have = layer.partial.stat().st_size  # reserved earlier: a resume needs no more
            except FileNotFoundError:
                have = 0
            need += max(layer.target.file_bytes - have, 0)
        free = self._free_bytes(self.job.out_dir)
        if need > free:
            raise PackError(f"disk full: packing needs {need / GiB:.2f} GiB in {self.job.out_dir} "
                            f"but {free / GiB:.2f} GiB are free; free space there or point "
                            f"DSV41_PACKED_DIR at a larger disk (nothing was changed)")

    def _pack_layer(self, layer: _Layer, source: SourceRows) -> None:
        target = layer.target
        fd = os.open(layer.partial, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            existed_bytes = os.fstat(fd).st_size
            done = self._resume_rows(fd, target, source)
            if done is None:
                os.ftruncate(fd, 0)
                self._write_progress(fd, target, 0)
                done = 0
            else:
                self._log(f"layer {target.layer}: resuming at row {target.row_lo + done} "
                          f"({done} of {target.rows} rows already written)")
            self._reserve(fd, layer, existed_bytes)
            self._copy(fd, layer, done)
            self._verify(fd, layer, source)
            _pwrite_full(fd, memoryview(fmt.encode_header(target)), 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(layer.partial, layer.path)
        _fsync_dir(layer.path.parent)
        self._log(f"layer {target.layer}: wrote {layer.path} ({target.describe()}, "
                  f"{target.file_bytes / GiB:.2f} GiB)")
        self.notify.status(f"layer {target.layer}: complete, {target.file_bytes / GiB:.1f} GiB")

    def _resume_rows(self, fd: int, target: fmt.Header, source: SourceRows) -> int | None:
        """Rows of a previous attempt that can be kept, or None to start over."""
        try:
            ph = fmt.decode_partial(os.pread(fd, fmt.HEADER_BYTES, 0))
        except fmt.HeaderError:
            return None
        if ph.target != target or \
                os.fstat(fd).st_size < fmt.HEADER_BYTES + ph.rows_done * fmt.ROW_BYTES:
            return None
        rows = sample_rows(target.row_lo, target.row_lo + ph.rows_done, _RESUME_SAMPLE_ROWS)
        bad = first_mismatch(fd, target, source, rows)
        if bad is not None:
            self._log(f"layer {target.layer}: partial file row {bad} differs from the checkpoint; "
                      "starting over")
            return None
        return ph.rows_done

    def _reserve(self, fd: int, layer: _Layer, existed_bytes: int) -> None:
        try:
            os.posix_fallocate(fd, 0, layer.target.file_bytes)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                return  # no reservation on this file system; a write hitting ENOSPC still says so
            if existed_bytes == 0:
                layer.partial.unlink(missing_ok=True)
            else:
                os.ftruncate(fd, min(os.fstat(fd).st_size, existed_bytes))
            if e.errno == errno.ENOSPC:
                raise PackError(f"disk full: cannot reserve {layer.target.file_bytes / GiB:.2f} "
                                f"GiB for {layer.path.name} in {layer.path.parent}; free space "
                                "there and run the pack again") from None
            raise

    def _copy(self, fd: int, layer: _Layer, done: int) -> None:
        job, t, table = self.job, layer.target, layer.table
        rows_per_block = max(1, min(job.block_bytes // fmt.ROW_BYTES, t.rows - done))
        ckpt_rows = max(1, job.checkpoint_bytes // fmt.ROW_BYTES)
        blocks = [(r, min(rows_per_block, t.row_hi - r))
                  for r in range(t.row_lo + done, t.row_hi, rows_per_block)]
        buffers = [_ScatterBlock(rows_per_block) for _ in range(min(_BUFFERS, len(blocks)))]
        wfd = os.open(table.weight.path, os.O_RDONLY | os.O_CLOEXEC)
        sfd = os.open(table.scale.path, os.O_RDONLY | os.O_CLOEXEC)
        for src in (wfd, sfd):
            os.posix_fadvise(src, 0, 0, os.POSIX_FADV_SEQUENTIAL)

        def read(k: int) -> memoryview:
            start, n = blocks[k]
            return buffers[k % len(buffers)].read(n, wfd, table.weight_offset(start), sfd,
                                                  table.scale_offset(start), f"layer {t.layer}")

        progress = _Progress(t, done, self.notify, self._clock, self._sleep, self._log,
                             job.max_bytes_per_s)
        synced = done
        try:
            # Blocks are written here, in order, while the reader thread fills the other buffers.
            with ThreadPoolExecutor(1, thread_name_prefix="pack-read") as pool:
                pending = deque(pool.submit(read, k) for k in range(len(buffers)))
                for k, (start, n) in enumerate(blocks):
                    out = pending.popleft().result()
                    if (start - t.row_lo) - synced >= ckpt_rows:
                        synced = self._checkpoint(fd, t, start - t.row_lo)
                    self._write_rows(fd, layer, out, start)
                    if k + len(buffers) < len(blocks):  # its buffer is free again
                        pending.append(pool.submit(read, k + len(buffers)))
                    if k:  # start writeback of the previous block now, not in one burst at fsync
                        prev = fmt.row_offset(t, blocks[k - 1][0])
                        os.posix_fadvise(fd, prev, blocks[k - 1][1] * fmt.ROW_BYTES,
                                         os.POSIX_FADV_DONTNEED)
                    progress.advance(start + n - t.row_lo)
        finally:
            os.close(wfd)
            os.close(sfd)
        self._checkpoint(fd, t, t.rows)
        progress.finish()

    def _write_rows(self, fd: int, layer: _Layer, rows: memoryview, start: int) -> None:
        try:
            _pwrite_full(fd, rows, fmt.row_offset(layer.target, start))
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise PackError(f"disk full while writing {layer.partial}; the rows written so "
                                "far are kept and a new pack resumes after space is "
                                "freed") from None
            raise

    def _checkpoint(self, fd: int, target: fmt.Header, rows_done: int) -> int:
        # Rows first, then the header that vouches for them: a crash in between loses progress,
        # never correctness.
        os.fsync(fd)
        self._write_progress(fd, target, rows_done)
        # The written rows are not read again here; on GB10 page cache is GPU memory.
        os.posix_fadvise(fd, fmt.HEADER_BYTES, rows_done * fmt.ROW_BYTES, os.POSIX_FADV_DONTNEED)
        return rows_done

    def _write_progress(self, fd: int, target: fmt.Header, rows_done: int) -> None:
        header = fmt.encode_partial(fmt.PartialHeader(target, rows_done))
        _pwrite_full(fd, memoryview(header), 0)

    def _verify(self, fd: int, layer: _Layer, source: SourceRows) -> None:
        t = layer.target
        rows = sample_rows(t.row_lo, t.row_hi, self.job.verify_rows)
        self.notify.status(f"layer {t.layer}: verifying {len(rows)} sampled rows")
        size = os.fstat(fd).st_size
        if size != t.file_bytes:
            raise PackError(f"{layer.partial}: size {size} after packing, expected "
                            f"{t.file_bytes}; it is kept for inspection, remove it to start over")
        bad = first_mismatch(fd, t, source, rows)
        if bad is not None:
            raise PackError(f"{layer.partial}: row {bad} differs from the checkpoint after "
                            "packing (was the checkpoint changed meanwhile?); the next pack "
                            "starts this layer over")


class _Progress:
    """STATUS= updates (at most once a second), a log line every 30 s, and the optional throttle."""

    def __init__(self, target: fmt.Header, done_rows: int, notify: SdNotify,
                 clock: Callable[[], float], sleep: Callable[[float], None],
                 log: Callable[[str], None], max_bytes_per_s: float | None) -> None:
        self._t = target
        self._start_rows = done_rows
        self._notify, self._clock, self._sleep, self._log = notify, clock, sleep, log
        self._limit = max_bytes_per_s
        self._start = self._last_status = self._last_log = clock()
        notify.status(status_line(target.layer, done_rows * fmt.ROW_BYTES,
                                  target.rows * fmt.ROW_BYTES, 0.0))

    def _rate(self, rows: int, now: float) -> float:
        return (rows - self._start_rows) * fmt.ROW_BYTES / max(now - self._start, 1e-9)

    def advance(self, rows: int) -> None:
        now = self._clock()
        if self._limit:
            ahead = (rows - self._start_rows) * fmt.ROW_BYTES / self._limit - (now - self._start)
            if ahead > 0:
                self._sleep(ahead)
                now = self._clock()
        if now - self._last_status >= 1.0:
            self._last_status = now
            line = status_line(self._t.layer, rows * fmt.ROW_BYTES, self._t.rows * fmt.ROW_BYTES,
                               self._rate(rows, now))
            self._notify.status(line)
            if now - self._last_log >= 30.0:
                self._last_log = now
                self._log(line)

    def finish(self) -> None:
        now = self._clock()
        self._log(f"layer {self._t.layer}: copied {self._t.rows - self._start_rows} rows in "
                  f"{now - self._start:.1f} s, {self._rate(self._t.rows, now) / 1e6:.0f} MB/s")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
