"""Engram rows of a packed shard as torch tensors, exactly as SGLang's EngramEmbedding returns them.

The engram_offload adapter uses this inside the rank, bench/engram_lookup on a GPU without SGLang:
it needs torch, numpy and the row store (adapter.engram), nothing of SGLang.

A lookup turns global row ids into [..., 256] bfloat16 rows. Rows this rank owns are read from its
shard and dequantised as SGLang's own torch path does (the float32 product of the E4M3 weight and
its E8M0 block scale, rounded once to bfloat16); every other row is +0.0, so the TP all-reduce
reassembles each row from the one rank that owns it (the store already zero-fills those rows, and
an all-zero packed row dequantises to +0.0).

On a CUDA device nothing waits on the CPU: the ids are copied to pinned memory, a host function the
stream runs when it gets there (cuLaunchHostFunc) reads the rows into pinned memory, and the rows
are copied back and dequantised, all in stream order, so a CUDA graph captures a lookup as memcpy
and host nodes. `prefetch` issues the same on a side stream as soon as the ids exist and `take`
joins it where the rows are needed; `stage` is the scheduler's variant for batches whose ids it
knows before their forward (rows read on the calling thread, copied on a copy stream). On the CPU
every step runs at once on the calling thread.

With the store's native reader (adapter/engram/native.py) the host function is the reader's own C
function and its argument a fixed record of the buffers and the row count: the driver's thread
runs no Python and never waits for the GIL, and the synchronous and staged reads release the GIL
for the whole batch. Without it (no compiler), the host function is a Python function.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from adapter.engram.native import NativeReader
from adapter.engram.store import RowStore, StoreError
from dsv41 import engram_format as fmt

DIM = fmt.WEIGHT_BYTES  # values per row
# Buffers of the synchronous and prefetch paths come in power-of-two classes of at least this many
# rows (decode: up to 4 requests x 6 tokens x 24 columns = 576); the smallest class exists from
# the start, so a CUDA graph captured before any eager lookup finds it.
MIN_CLASS_ROWS = 4096


def dequantize(packed: torch.Tensor) -> torch.Tensor:
    """[n, 264] uint8 packed rows -> [n, 256] bfloat16, SGLang's formula bit for bit."""
    weight = packed[:, :fmt.WEIGHT_BYTES].view(torch.float8_e4m3fn).float()
    scale = packed[:, fmt.WEIGHT_BYTES:].view(torch.float8_e8m0fnu).float()
    values = weight.unflatten(-1, (fmt.SCALE_BYTES, fmt.VALUES_PER_SCALE)) * scale.unsqueeze(-1)
    return values.flatten(-2).to(torch.bfloat16)


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row, whether two bfloat16 results are the same bits (NaN payloads included)."""
    return (a.reshape(-1, DIM).view(torch.int16) == b.reshape(-1, DIM).view(torch.int16)).all(-1)


_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class HostFunctions:
    """The driver's cuLaunchHostFunc: a function (by address) the stream calls when it reaches it.

    The driver calls it on its own thread; it must not call CUDA (it only reads files into pinned
    memory). A Python function takes the GIL there, the native reader's does not. Functions and
    arguments are kept for the life of the process, since a captured CUDA graph may call them
    again at any replay."""

    def __init__(self) -> None:
        self._driver = ctypes.CDLL("libcuda.so.1")
        self._launch = self._driver.cuLaunchHostFunc
        self._launch.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
        self._launch.restype = ctypes.c_int

    def launch(self, stream: torch.cuda.Stream, fn: int, arg: int) -> None:
        rc = self._launch(ctypes.c_void_p(stream.cuda_stream), ctypes.c_void_p(fn), ctypes.c_void_p(arg))
        if rc:
            raise RuntimeError(f"cuLaunchHostFunc failed with CUresult {rc}")


class _Buffers:
    """Fixed pinned and device buffers of one size class (CUDA graphs keep their addresses), and
    the host function that fills them: the native reader's, with one launch record per row count,
    or a Python function taking the row count as its argument."""

    def __init__(self, rows: int, device: torch.device, native: NativeReader | None,
                 fill: Callable[[_Buffers, int], None]) -> None:
        self.rows = rows
        self.ids = torch.empty(rows, dtype=torch.int64, pin_memory=True)
        self.ids_np = self.ids.numpy()
        self.host = torch.empty(rows, fmt.ROW_BYTES, dtype=torch.uint8, pin_memory=True)
        self.host_bytes = memoryview(self.host.numpy().reshape(-1))
        self.device = torch.empty(rows, fmt.ROW_BYTES, dtype=torch.uint8, device=device)
        self._native = native
        if native is not None:
            self.callback = None
            self.fn = native.host_fn
            self._launches = native.launches(self.ids.data_ptr(), self.host.data_ptr(), rows)
        else:
            self.callback = _HOST_FN(lambda arg: fill(self, int(arg or 0)))
            self.fn = ctypes.cast(self.callback, ctypes.c_void_p).value

    def arg(self, n: int) -> int:
        """The host function's argument that reads the first ``n`` ids."""
        if not 0 <= n <= self.rows:
            raise ValueError(f"{n} rows do not fit buffers of {self.rows}")
        return self._native.launch_arg(self._launches, n) if self._native is not None else n


@dataclass
class Pending:
    """Rows being fetched for one lookup (prefetch), until `take`."""

    rows: torch.Tensor  # [n, 264] uint8 on the lookup's device
    done: torch.cuda.Event | None
    shape: tuple[int, ...]  # the ids' shape
    source: tuple[int, tuple[int, ...], tuple[int, ...]]  # (data_ptr, shape, stride) of the ids

    def matches(self, indices: torch.Tensor) -> bool:
        return self.source == _identity(indices)


@dataclass
class Staged:
    """One layer's rows staged by the scheduler for an extend batch."""

    rows: torch.Tensor  # [n, 264] uint8 on the device
    ids: torch.Tensor  # [n] int64 on the host, for the prefetch check
    done: torch.cuda.Event | None


class StagedRows(list):
    """The engram_staged_rows of a batch staged from packed shards: one Staged per Engram layer.

    A list, as SGLang's own StagedRows, so code that only tests it for None or copies the
    reference treats it alike; the adapter's hooks tell it apart by type."""


def _identity(t: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    return t.data_ptr(), tuple(t.shape), tuple(t.stride())


def _class_rows(n: int) -> int:
    return max(MIN_CLASS_ROWS, 1 << max(0, n - 1).bit_length())


class PackedTable:
    """One Engram layer's rows of this rank: lookups, prefetches and staged rows from its shard."""

    def __init__(self, store: RowStore, *, on_read: Callable[[], None] = lambda: None,
                 on_error: Callable[[BaseException], None] = lambda _error: None,
                 exit_line: str | None = None, host_functions: HostFunctions | None = None) -> None:
        self.store = store
        self.native = store.native  # None: the Python path reads
        self.layer = store.header.layer
        self.lo, self.hi = store.header.row_lo, store.header.row_hi
        # After every read on a Python thread, and after every native launch (statistics).
        self._on_read = on_read
        # A read that fails on the driver's thread cannot raise into the forward, so the adapter
        # stops the process rather than let it use unread rows: the Python path calls on_error
        # there; the native reader, which cannot call Python, writes exit_line + the error to
        # stderr and exits itself. Either way the first failure is also kept and raised by the
        # next lookup on a Python thread.
        self._on_error = on_error
        if self.native is not None and exit_line is not None:
            self.native.exit_on_failure(exit_line)
        self.failed: BaseException | None = None
        self._host_functions = host_functions
        self._classes: dict[tuple[str, torch.device, int], _Buffers] = {}
        self.checked = None  # prefetch check counters (tensors on the lookup's device)
        self.mismatched = None

    # ----- the three ways rows arrive -----

    def lookup(self, indices: torch.Tensor) -> torch.Tensor:
        """[..., 256] bfloat16 rows of ``indices`` on their device, in the current stream's order."""
        self._raise_failed()
        flat = indices.reshape(-1)
        if flat.numel() == 0:
            return torch.zeros(*indices.shape, DIM, dtype=torch.bfloat16, device=indices.device)
        if indices.device.type == "cuda":
            packed = self._fetch(flat, "sync", torch.cuda.current_stream(indices.device))
        else:
            packed = self._read(flat)
        return dequantize(packed).view(*indices.shape, DIM)

    def prefetch(self, indices: torch.Tensor, side: torch.cuda.Stream | None) -> Pending:
        """Start fetching the rows of ``indices`` (on ``side``, after the work queued so far)."""
        self._raise_failed()
        if indices.device.type != "cuda":
            return Pending(self._read(indices.reshape(-1)), None, tuple(indices.shape), _identity(indices))
        assert side is not None, "a CUDA prefetch needs a side stream"
        side.wait_stream(torch.cuda.current_stream(indices.device))
        with torch.cuda.stream(side):
            rows = self._fetch(indices.reshape(-1), "prefetch", side)
            done = torch.cuda.Event()
            done.record(side)
        return Pending(rows, done, tuple(indices.shape), _identity(indices))

    def take(self, pending: Pending) -> torch.Tensor:
        """The prefetched rows, once the current stream has waited for them."""
        self._raise_failed()
        self.join(pending)
        if pending.rows.shape[0] == 0:
            return torch.zeros(*pending.shape, DIM, dtype=torch.bfloat16, device=pending.rows.device)
        return dequantize(pending.rows).view(*pending.shape, DIM)

    def join(self, pending: Pending) -> None:
        if pending.done is not None:
            torch.cuda.current_stream(pending.rows.device).wait_event(pending.done)

    def stage(self, ids: torch.Tensor, device: torch.device, copy_stream: torch.cuda.Stream | None) -> Staged:
        """Rows of host ``ids`` read now on this thread; on CUDA copied on ``copy_stream``."""
        ids = ids.reshape(-1).to("cpu", torch.int64).contiguous()
        if device.type != "cuda":
            return Staged(self._read(ids), ids, None)
        host = torch.empty(ids.numel(), fmt.ROW_BYTES, dtype=torch.uint8, pin_memory=True)
        self._read_into(ids, host)
        with torch.cuda.stream(copy_stream):
            rows = host.to(device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(copy_stream)
        return Staged(rows, ids, done)

    def take_staged(self, staged: Staged, hash_shape: tuple[int, ...]) -> torch.Tensor:
        """The staged rows as [*hash_shape, 256]; rows past the staged ones (graph padding) are 0."""
        rows = staged.rows
        if staged.done is not None:
            stream = torch.cuda.current_stream(rows.device)
            stream.wait_event(staged.done)
            rows.record_stream(stream)
        out = torch.zeros(*hash_shape, DIM, dtype=torch.bfloat16, device=rows.device)
        flat = out.view(-1, DIM)
        assert rows.shape[0] <= flat.shape[0], (tuple(rows.shape), tuple(flat.shape))
        if rows.shape[0]:
            flat[:rows.shape[0]] = dequantize(rows)
        return out

    # ----- the prefetch check -----

    def check(self, got: torch.Tensor, want: torch.Tensor) -> None:
        """Count rows where a prefetched result differs from the synchronous one (on the device,
        so that it also counts inside a CUDA graph); `check_counts` reads the counters."""
        same = bit_equal(got, want)
        if self.checked is None or self.checked.device != same.device:
            self.checked = torch.zeros((), dtype=torch.int64, device=same.device)
            self.mismatched = torch.zeros((), dtype=torch.int64, device=same.device)
        self.checked += same.numel()
        self.mismatched += (~same).sum()

    def check_counts(self) -> tuple[int, int]:
        """(rows checked, rows that differed) since the last call; a host sync."""
        if self.checked is None:
            return 0, 0
        counts = int(self.checked.item()), int(self.mismatched.item())
        self.checked.zero_()
        self.mismatched.zero_()
        return counts

    # ----- reading -----

    @property
    def reader(self) -> str:
        """Which path reads the rows: "native" or "python"."""
        return self.store.reader

    def _read(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.reshape(-1).to("cpu", torch.int64).contiguous()
        out = torch.empty(ids.numel(), fmt.ROW_BYTES, dtype=torch.uint8)
        self._read_into(ids, out)
        return out

    def _read_into(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        """[n] int64 CPU ids into [n, 264] uint8 CPU rows, on this thread."""
        if self.native is not None:
            self.native.read(ids.data_ptr(), ids.numel(), out.data_ptr())  # the GIL released
        else:
            self.store.read_rows_into(ids.tolist(), memoryview(out.numpy().reshape(-1)))
        self._on_read()

    def buffers(self, kind: str, device: torch.device, n: int) -> _Buffers:
        key = (kind, device, _class_rows(n))
        bufs = self._classes.get(key)
        if bufs is None:
            bufs = self._classes[key] = _Buffers(key[2], device, self.native, self._fill)
        return bufs

    def _fetch(self, flat: torch.Tensor, kind: str, stream: torch.cuda.Stream) -> torch.Tensor:
        """Stream-ordered: ids to pinned memory, the host function reads, rows to the device."""
        if self._host_functions is None:
            self._host_functions = HostFunctions()
        n = flat.numel()
        bufs = self.buffers(kind, flat.device, n)
        bufs.ids[:n].copy_(flat, non_blocking=True)
        self._host_functions.launch(stream, bufs.fn, bufs.arg(n))
        rows = bufs.device[:n]
        rows.copy_(bufs.host[:n], non_blocking=True)
        if self.native is not None:
            self._on_read()  # its reads run no Python: the statistics are looked at here
        return rows

    def _fill(self, bufs: _Buffers, n: int) -> None:
        # The Python host function, on the driver's thread: no CUDA calls, no exception may escape.
        try:
            self.store.read_rows_into(bufs.ids_np[:n].tolist(), bufs.host_bytes[:n * fmt.ROW_BYTES])
            self._on_read()
        except BaseException as e:  # noqa: BLE001 - see on_error
            if self.failed is None:
                self.failed = e
            self._on_error(e)

    def _raise_failed(self) -> None:
        if self.failed is None and self.native is not None:
            why = self.native.failure()
            if why is not None:
                self.failed = StoreError(why)
        if self.failed is not None:
            raise RuntimeError(f"reading Engram rows of layer {self.layer} failed on the CUDA driver's thread: "
                               f"{type(self.failed).__name__}: {self.failed}") from self.failed

    def close(self) -> None:
        self.store.close()

