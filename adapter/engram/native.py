"""The native row reader (reader.cpp): built at first use with torch's cpp_extension, called through
ctypes, which releases the GIL for every call.

``load`` builds the library once per build directory and source (a directory keyed by the digest
of the source, the compiler flags and the torch and Python versions, under TORCH_EXTENSIONS_DIR
or ~/.cache/torch_extensions) and returns a ``Library``, or None when it cannot be built (no
compiler, no ninja, no torch): the caller then reads through the Python store, and the reason is
logged once per process. ``Library.open`` makes a ``NativeReader`` over an open shard.

torch is imported only to build; nothing else here needs more than the standard library.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from dsv41 import engram_format as fmt

ABI = 1
SOURCE = Path(__file__).with_name("reader.cpp")
NAME = "dsv41_engram_reader"
CFLAGS = ("-O2", "-std=c++17", "-pthread", "-fvisibility=hidden")
LDFLAGS = ("-pthread",)
_ERR_BYTES = 4096
# A build per (directory, source digest) and process: the outcome is kept, so a second table, or a
# second caller, neither builds again nor logs again.
_BUILDS: dict[tuple[str, str], Library | str] = {}
_BUILDS_LOCK = threading.Lock()


class NativeError(RuntimeError):
    """The native library cannot be built or loaded (the message says why)."""


def default_root() -> Path:
    """Where torch keeps JIT extensions: TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions."""
    explicit = os.environ.get("TORCH_EXTENSIONS_DIR", "").strip()
    return Path(explicit) if explicit else Path.home() / ".cache" / "torch_extensions"


def build_key(source: str, torch_version: str) -> str:
    """The digest that names a build: what the library's bytes depend on."""
    h = hashlib.sha256()
    for part in (source, " ".join(CFLAGS), " ".join(LDFLAGS), torch_version, sys.version, str(ABI)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def load(root: str | Path | None = None, *, source: str | None = None,
         log: Callable[[str], None] = lambda _line: None) -> Library | None:
    """The built library, or None when it cannot be built; the first outcome per process is logged."""
    text = SOURCE.read_text() if source is None else source
    try:
        import torch
        torch_version = torch.__version__
    except ImportError as e:
        torch_version = f"missing: {e}"
    key = (str(Path(root) if root is not None else default_root()), build_key(text, torch_version))
    with _BUILDS_LOCK:
        known = _BUILDS.get(key)
        if known is None:
            started = time.monotonic()
            try:
                known = _build(Path(key[0]), key[1], text)
                log(f"native Engram row reader ready in {time.monotonic() - started:.1f} s "
                    f"({known.path}); rows are read without the GIL")
            except Exception as e:  # noqa: BLE001 - any failure means the Python path, logged
                known = f"{type(e).__name__}: {_first_line(str(e))}"
                log(f"native Engram row reader unavailable ({known}); rows are read by the Python "
                    "path, which needs the GIL")
            _BUILDS[key] = known
    return known if isinstance(known, Library) else None


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return "no message"
    # A compiler's "error:" line says more than the build tool's summary.
    for marker in ("error:", "error"):
        found = [line for line in lines if marker in line.lower()]
        if found:
            return found[0][:400]
    return lines[0][:400]


def _build(root: Path, digest: str, source: str) -> Library:
    try:
        import torch  # noqa: F401 - cpp_extension needs it imported
        from torch.utils import cpp_extension
    except ImportError as e:
        raise NativeError(f"torch is needed to build the reader: {e}") from None
    directory = root / f"{NAME}-{digest}"
    library = directory / f"{NAME}.so"
    directory.mkdir(parents=True, exist_ok=True)
    # Ranks sharing a host build once: an flock is released when its holder dies, unlike
    # cpp_extension's own lock file, which a build killed half way leaves behind for ever.
    with open(root / f"{NAME}-{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not library.exists():
            stale = directory / "lock"
            if stale.exists():
                stale.unlink()
            src = directory / f"{NAME}.cpp"
            if not src.exists() or src.read_text() != source:
                tmp = src.with_suffix(f".tmp{os.getpid()}")
                tmp.write_text(source)
                os.replace(tmp, src)
            with _compiler():
                path = cpp_extension.load(NAME, [str(src)], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                                          build_directory=str(directory), is_python_module=False, verbose=False)
            library = Path(path)
    return Library(library)


@contextlib.contextmanager
def _compiler() -> Iterator[None]:
    """cpp_extension compiles with $CXX or `c++`; a machine with only g++ or clang++ gets that one."""
    if os.environ.get("CXX") or shutil.which("c++"):
        yield
        return
    found = shutil.which("g++") or shutil.which("clang++")
    if found is None:
        raise NativeError("no C++ compiler (c++, g++ or clang++) on PATH, and CXX is not set")
    os.environ["CXX"] = found
    try:
        yield
    finally:
        del os.environ["CXX"]


class Library:
    """The loaded reader.cpp and its C functions."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))  # CDLL, not PyDLL: every call releases the GIL
        if lib.dsv41_engram_abi() != ABI:
            raise NativeError(f"{path}: ABI {lib.dsv41_engram_abi()}, expected {ABI}")
        vp, u64, i64, cp = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64, ctypes.c_char_p
        self._sig(lib.dsv41_engram_open, vp, ctypes.c_int, cp, cp, i64, i64, vp, u64, u64, ctypes.c_int, vp, u64)
        self._sig(lib.dsv41_engram_close, None, vp)
        self._sig(lib.dsv41_engram_fd, ctypes.c_int, vp)
        self._sig(lib.dsv41_engram_threads, ctypes.c_int, vp)
        self._sig(lib.dsv41_engram_read, ctypes.c_int, vp, vp, u64, vp, vp, u64)
        self._sig(lib.dsv41_engram_launches, vp, vp, vp, vp, u64)
        self._sig(lib.dsv41_engram_set_exit, None, vp, cp, ctypes.c_int)
        self._sig(lib.dsv41_engram_failure, ctypes.c_int, vp, vp, u64)
        self._sig(lib.dsv41_engram_take_stats, None, vp, vp)
        self._sig(lib.dsv41_engram_launch_bytes, u64)
        self._sig(lib.dsv41_engram_stats_words, u64)
        self.c = lib
        self.launch_bytes = int(lib.dsv41_engram_launch_bytes())
        self.stats_words = int(lib.dsv41_engram_stats_words())
        # The CUhostFn for cuLaunchHostFunc; a plain address, valid while the library is loaded.
        self.host_fn = ctypes.cast(lib.dsv41_engram_host_fn, ctypes.c_void_p).value

    @staticmethod
    def _sig(fn: object, restype: object, *argtypes: object) -> None:
        fn.restype = restype  # type: ignore[attr-defined]
        fn.argtypes = argtypes  # type: ignore[attr-defined]

    def open(self, fd: int, path: str | Path, header: fmt.Header, *, scales: int | None, cache_bytes: int,
             cache_ways: int, threads: int) -> NativeReader:
        """A reader of the shard open as ``fd`` (the reader reads from its own duplicate).
        ``scales``: the address of the resident scale bytes (8 a row, kept alive by the caller)."""
        sets = cache_bytes // (fmt.ROW_BYTES * cache_ways) if cache_bytes > 0 else 0
        if cache_bytes > 0 and sets < 1:
            raise ValueError(f"a cache of {cache_bytes} bytes cannot hold one set of {cache_ways} "
                             f"rows of {fmt.ROW_BYTES} bytes")
        err = ctypes.create_string_buffer(_ERR_BYTES)
        handle = self.c.dsv41_engram_open(fd, str(path).encode(), fmt.REPACK_HINT.encode(), header.row_lo,
                                          header.row_hi, scales, sets, cache_ways if sets else 0, threads,
                                          err, _ERR_BYTES)
        if not handle:
            raise NativeError(err.value.decode(errors="replace"))
        return NativeReader(self, handle, Path(path))


@dataclass(frozen=True)
class Counters:
    """A reader's statistics since the last take (the shape RowStats.merge adds)."""

    lookups: int
    hits: int
    misses: int
    batches: int
    reads: tuple[int, int, tuple[int, ...]]  # total, max ns, bucket counts
    batch: tuple[int, int, tuple[int, ...]]


class NativeReader:
    """One shard's native reader: batch reads (GIL released) and the host function's arguments."""

    def __init__(self, library: Library, handle: int, path: Path) -> None:
        self.library = library
        self.path = path
        self._handle = handle
        self._lock = threading.Lock()  # close against a concurrent take_stats
        self.threads = int(library.c.dsv41_engram_threads(handle))

    @property
    def fd(self) -> int:
        """The reader's own descriptor of the shard."""
        return int(self.library.c.dsv41_engram_fd(self._live()))

    def _live(self) -> int:
        if self._handle is None:
            raise ValueError(f"{self.path}: the native reader is closed")
        return self._handle

    def read(self, ids_address: int, n: int, out_address: int) -> None:
        """``n`` int64 ids at ``ids_address`` into ``n * 264`` bytes at ``out_address``; StoreError
        when a row cannot be read."""
        err = ctypes.create_string_buffer(_ERR_BYTES)
        if self.library.c.dsv41_engram_read(self._live(), ids_address, n, out_address, err, _ERR_BYTES) != 0:
            from adapter.engram.store import StoreError

            raise StoreError(err.value.decode(errors="replace"))

    def launches(self, ids_address: int, out_address: int, rows: int) -> int:
        """The address of ``rows + 1`` host-function arguments over one pair of buffers; the one for
        ``n`` rows is ``launch_arg(base, n)``. They live as long as the reader."""
        base = self.library.c.dsv41_engram_launches(self._live(), ids_address, out_address, rows)
        if not base:
            raise MemoryError(f"{self.path}: no memory for {rows + 1} launch arguments")
        return int(base)

    def launch_arg(self, base: int, n: int) -> int:
        return base + n * self.library.launch_bytes

    @property
    def host_fn(self) -> int:
        return int(self.library.host_fn)

    def exit_on_failure(self, line: str, code: int = 1) -> None:
        """A host function's failure then writes ``line`` + the error + "; the rank stops" to stderr
        and ends the process with ``code`` (the forward would otherwise go on with unread rows)."""
        self.library.c.dsv41_engram_set_exit(self._live(), line.encode(), code)

    def failure(self) -> str | None:
        """The first failure of a host function, if any."""
        buf = ctypes.create_string_buffer(_ERR_BYTES)
        if self.library.c.dsv41_engram_failure(self._live(), buf, _ERR_BYTES):
            return buf.value.decode(errors="replace")
        return None

    def take_stats(self) -> Counters | None:
        """The counters since the last take (None once closed)."""
        with self._lock:
            if self._handle is None:
                return None
            words = (ctypes.c_uint64 * self.library.stats_words)()
            self.library.c.dsv41_engram_take_stats(self._handle, words)
        w = list(words)
        size = (len(w) - 4) // 2

        def hist(at: int) -> tuple[int, int, tuple[int, ...]]:
            return w[at], w[at + 1], tuple(w[at + 2:at + size])

        return Counters(w[0], w[1], w[2], w[3], hist(4), hist(4 + size))

    def close(self) -> None:
        with self._lock:
            handle, self._handle = self._handle, None
        if handle is not None:
            self.library.c.dsv41_engram_close(handle)
