"""The native row reader (adapter/engram/reader.cpp) against the Python path it replaces, on packs
written by the real pack job from a real-format checkpoint.

The library is compiled here with g++ and native.CFLAGS, the flags torch's cpp_extension gets in the
rank (tests/sglang/test_engram_native_torch.py builds it that way), so this tier needs no torch.
Every read is compared with the Python store's and with the checkpoint's own bytes.
"""

from __future__ import annotations

import ctypes
import errno
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from array import array
from pathlib import Path

import pytest

from adapter.engram import native
from adapter.engram.settings import StoreSettings
from adapter.engram.stats import RankStats
from adapter.engram.store import RowStore, StoreError
from dsv41 import engram_format as fmt
from agent.pack.packer import PackJob, Packer
from dsv41.sdnotify import SdNotify
from tests.unit.test_pack_checkpoint import packed_row, write_checkpoint

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
# Odd table sizes, split unevenly at TP 3; enough rows for batches the pool splits.
ROWS = {1: 6007, 14: 4001}
TP = 3
ETIMEDOUT = 110


def compile_library(out: Path) -> native.Library:
    cxx = shutil.which("g++")
    assert cxx, "g++ is needed (tools/install-test-deps.sh installs it)"
    path = out / "reader.so"
    subprocess.run([cxx, *native.CFLAGS, "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror", str(native.SOURCE),
                    "-o", str(path), *native.LDFLAGS], check=True, capture_output=True, text=True)
    return native.Library(path)


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> native.Library:
    return compile_library(tmp_path_factory.mktemp("native"))


@pytest.fixture(scope="module")
def packs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("packs")
    model = write_checkpoint(root / "model", ROWS)
    out = root / "packed"
    for rank in range(TP):
        Packer(PackJob(model_dir=model, out_dir=out, rank=rank, tp=TP), SdNotify(None), log=lambda _line: None).run()
    return out


def settings(**kw: object) -> StoreSettings:
    return StoreSettings(**{"io_threads": 4, "stats_seconds": 0, **kw})


def open_pair(packs: Path, library: native.Library, layer: int, rank: int,
              s: StoreSettings) -> tuple[RowStore, RowStore]:
    kw = dict(layer=layer, rank=rank, tp=TP, total_rows=ROWS[layer], settings=s)
    return RowStore.open_rank(packs, **kw), RowStore.open_rank(packs, native=library, **kw)


def expected(layer: int, lo: int, hi: int, ids: list[int]) -> bytes:
    return b"".join(packed_row(layer, i) if lo <= i < hi else bytes(fmt.ROW_BYTES) for i in ids)


def batches(layer: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    n = ROWS[layer]
    rng = random.Random(seed)
    owned = list(range(lo, hi))
    return [
        [], [lo], [0 if lo else n - 1], [lo - 1, lo, hi - 1, hi], [-1, -2**63, 2**63 - 1, n, n + 7],
        [lo + 3] * 9, owned[::-1], owned + owned[:50],  # every owned row, then repeats
        [rng.randrange(-3, n + 3) for _ in range(576)],  # a decode step of 4 requests
        [rng.randrange(n) for _ in range(18432)],  # a 768-token prefill chunk
        [rng.choice(owned[:40]) for _ in range(700)],  # few rows, many repeats
    ]


VARIANTS = {
    "caller alone": settings(io_threads=1),
    "4 threads": settings(),
    "96 threads": settings(io_threads=96),
    "cache": settings(cache_gib=200 * fmt.ROW_BYTES / 2**30, cache_ways=4),
    "resident scales": settings(resident_scales=True),
    "cache and scales": settings(io_threads=8, resident_scales=True, cache_gib=64 * fmt.ROW_BYTES / 2**30,
                                 cache_ways=2),
}


@pytest.mark.parametrize("variant", VARIANTS, ids=list(VARIANTS))
def test_native_reads_are_the_python_reads_and_the_checkpoint_rows(packs, library, variant) -> None:
    for layer in fmt.LAYERS:
        for rank in range(TP):
            lo, hi = fmt.row_range(ROWS[layer], rank, TP)
            python, fast = open_pair(packs, library, layer, rank, VARIANTS[variant])
            with python, fast:
                assert fast.reader == "native" and python.reader == "python"
                for ids in batches(layer, lo, hi, seed=layer * 10 + rank):
                    want = expected(layer, lo, hi, ids)
                    assert python.read_rows(ids) == want
                    got = fast.read_rows(ids)
                    assert got == want, (variant, layer, rank, len(ids))


def test_a_reused_buffer_gets_zeros_for_foreign_rows(packs, library) -> None:
    lo, hi = fmt.row_range(ROWS[1], 1, TP)
    _, fast = open_pair(packs, library, 1, 1, settings())
    with fast:
        buf = bytearray(b"\xff" * fmt.ROW_BYTES * 3)
        fast.read_rows_into([0, lo, hi], memoryview(buf))
    assert buf == bytes(fmt.ROW_BYTES) + packed_row(1, lo) + bytes(fmt.ROW_BYTES)


def test_cache_hits_and_statistics_are_the_python_paths(packs, library) -> None:
    # 16 sets of 2 ways: a working set far larger than the cache, so evictions happen everywhere.
    s = settings(cache_gib=32 * fmt.ROW_BYTES / 2**30, cache_ways=2)
    lo, hi = fmt.row_range(ROWS[14], 2, TP)
    rng = random.Random(5)
    python, fast = open_pair(packs, library, 14, 2, s)
    with python, fast:
        for _ in range(40):
            ids = [rng.randrange(lo - 20, lo + 120) for _ in range(rng.randrange(1, 90))]
            assert fast.read_rows(ids) == python.read_rows(ids)
        now = time.monotonic()
        a, b = python.stats.take(now), fast.stats.take(now)
    assert (b.lookups, b.hits, b.misses, b.batches) == (a.lookups, a.hits, a.misses, a.batches)
    assert b.hits > 100 and b.misses > 100  # the sequence did exercise both
    # One latency per row read, one per batch, in the same buckets the Python path uses.
    assert b.read_latency.total == b.misses and b.batch_latency.total == b.batches == 40
    assert sum(b.read_latency.counts) == b.misses and 0 < b.read_latency.percentile(0.5) <= b.read_latency.max_ns


def test_the_statistics_line_comes_from_the_native_counters(packs, library) -> None:
    now = [100.0]
    lines: list[str] = []
    lo, _ = fmt.row_range(ROWS[1], 0, TP)
    s = settings(stats_seconds=60)
    store = RowStore.open_rank(packs, layer=1, rank=0, tp=TP, total_rows=ROWS[1], settings=s, native=library,
                               clock=lambda: now[0], log=lines.append)
    with store:
        store.read_rows([lo, lo + 1, ROWS[1] - 1])
        now[0] += 61
        store.read_rows([lo + 2])
    assert len(lines) == 1 and lines[0].startswith("engram layer 1 rank 0/3: 0 rows/s in 2 batches over 61.0 s")
    assert "cache hit off (0 hits, 3 rows read)" in lines[0]


def test_concurrent_batches_on_one_reader(packs, library) -> None:
    lo, hi = fmt.row_range(ROWS[1], 2, TP)
    _, fast = open_pair(packs, library, 1, 2, settings(io_threads=6, cache_gib=500 * fmt.ROW_BYTES / 2**30))
    errors: list[str] = []

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(30):
            ids = [rng.randrange(ROWS[1]) for _ in range(rng.choice((1, 40, 600, 3000)))]
            if fast.read_rows(ids) != expected(1, lo, hi, ids):
                errors.append(f"thread {seed}: {len(ids)} rows differ")

    with fast:
        threads = [threading.Thread(target=reader, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert fast.stats.take(time.monotonic()).batches == 180
    assert errors == []


# ----- the host function -----

def launch(reader: native.NativeReader, ids: list[int], rows: int) -> tuple[array, bytearray, int]:
    """Buffers of ``rows`` rows holding ``ids``, their launch records' base address."""
    id_buf = array("q", ids + [0] * (rows - len(ids)))
    out = bytearray(b"\xee" * rows * fmt.ROW_BYTES)
    base = reader.launches(id_buf.buffer_info()[0], address(out), rows)
    return id_buf, out, base


def address(buf: bytearray) -> int:
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


def call_host_fn(fn: int, arg: int) -> None:
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(fn)(arg)


def test_launch_records_read_the_first_n_ids(packs, library) -> None:
    lo, hi = fmt.row_range(ROWS[14], 0, TP)
    _, fast = open_pair(packs, library, 14, 0, settings())
    with fast:
        ids = [lo, hi, lo + 7, lo + 7, 1, hi - 1]
        keep = launch(fast.native, ids, 8)
        _, out, base = keep
        call_host_fn(fast.native.host_fn, fast.native.launch_arg(base, 4))
        assert out[:4 * fmt.ROW_BYTES] == expected(14, lo, hi, ids[:4])
        assert out[4 * fmt.ROW_BYTES:] == b"\xee" * 4 * fmt.ROW_BYTES  # rows past n untouched
        call_host_fn(fast.native.host_fn, fast.native.launch_arg(base, 0))
        call_host_fn(fast.native.host_fn, fast.native.launch_arg(base, 6))
        assert out[:6 * fmt.ROW_BYTES] == expected(14, lo, hi, ids)
        assert fast.native.failure() is None
        # n = 0 reads nothing and still counts as a batch, as on the Python path.
        taken = fast.stats.take(time.monotonic())
        assert (taken.batches, taken.lookups, taken.misses) == (3, 10, 6)


class Pthreads:
    """libc's pthread_create and joins, called with the GIL held (PyDLL) or released (CDLL)."""

    def __init__(self) -> None:
        held, released = ctypes.PyDLL(None), ctypes.CDLL(None)
        self.create = held.pthread_create
        self.create.argtypes = (ctypes.POINTER(ctypes.c_ulong), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
        self.timedjoin_held = held.pthread_timedjoin_np
        self.timedjoin_held.argtypes = (ctypes.c_ulong, ctypes.c_void_p, ctypes.c_void_p)
        self.join_released = released.pthread_join
        self.join_released.argtypes = (ctypes.c_ulong, ctypes.c_void_p)

    def start(self, fn: int, arg: int) -> ctypes.c_ulong:
        tid = ctypes.c_ulong()
        assert self.create(ctypes.byref(tid), None, fn, arg) == 0
        return tid

    def join_holding_the_gil(self, tid: ctypes.c_ulong, seconds: float) -> int:
        class Timespec(ctypes.Structure):
            _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

        deadline = time.clock_gettime(time.CLOCK_REALTIME) + seconds
        ts = Timespec(int(deadline), int((deadline % 1) * 1e9))
        return self.timedjoin_held(tid, None, ctypes.byref(ts))


def test_the_native_host_function_needs_no_gil(packs, library) -> None:
    """A thread with no Python state (as the CUDA driver's) runs the host function to the end while
    this thread holds the GIL throughout; the Python path's host function cannot."""
    lo, hi = fmt.row_range(ROWS[1], 1, TP)
    ids = [random.Random(3).randrange(ROWS[1]) for _ in range(3000)]
    python, fast = open_pair(packs, library, 1, 1, settings(io_threads=8))
    pthreads = Pthreads()
    with python, fast:
        _, out, base = launch(fast.native, ids, len(ids))
        tid = pthreads.start(fast.native.host_fn, fast.native.launch_arg(base, len(ids)))
        assert pthreads.join_holding_the_gil(tid, 20.0) == 0
        assert out == expected(1, lo, hi, ids)

        # The Python path's host function, as PackedTable makes it: a ctypes callback into the store.
        slow = bytearray(len(ids) * fmt.ROW_BYTES)
        fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda n: python.read_rows_into(ids[:n], memoryview(slow)))
        tid = pthreads.start(ctypes.cast(fn, ctypes.c_void_p).value, len(ids))
        assert pthreads.join_holding_the_gil(tid, 1.0) == ETIMEDOUT  # it waits for the GIL
        assert pthreads.join_released(tid, None) == 0
        assert slow == out


# ----- errors -----

def test_a_short_read_fails_alike_on_both_paths(packs, library, tmp_path) -> None:
    for name in ("engram-l1-r0of3.bin", "engram-l14-r0of3.bin"):
        shutil.copy(packs / name, tmp_path / name)
    lo, hi = fmt.row_range(ROWS[1], 0, TP)
    for s in (settings(io_threads=1), settings(io_threads=16), settings(resident_scales=True)):
        python, fast = open_pair(tmp_path, library, 1, 0, s)
        with python, fast:
            row = hi - 3
            size = fmt.HEADER_BYTES + (row - lo) * fmt.ROW_BYTES + 100  # row hi-3 ends 100 bytes in
            with open(tmp_path / "engram-l1-r0of3.bin", "r+b") as f:
                f.truncate(size)
            messages = []
            for store in (python, fast):
                with pytest.raises(StoreError) as e:
                    store.read_rows([lo, row] + list(range(lo, lo + 600)))
                messages.append(str(e.value))
            length = fmt.WEIGHT_BYTES if s.resident_scales else fmt.ROW_BYTES
            assert messages[0] == messages[1] == (
                f"{tmp_path / 'engram-l1-r0of3.bin'}: short read of row {row} (100 of {length} bytes): the file "
                "changed under the rank; re-pack with `dsv41ctl pack --start`")
            # The rows before the cut still read, on both paths.
            assert fast.read_rows([lo, lo + 1]) == python.read_rows([lo, lo + 1]) == expected(1, lo, hi, [lo, lo + 1])
        shutil.copy(packs / "engram-l1-r0of3.bin", tmp_path / "engram-l1-r0of3.bin")


def test_a_closed_descriptor_fails_alike_on_both_paths(packs, library) -> None:
    lo, hi = fmt.row_range(ROWS[14], 1, TP)
    python, fast = open_pair(packs, library, 14, 1, settings())
    with python, fast:
        messages = []
        for store, fd in ((python, python._fd), (fast, fast.native.fd)):
            saved = os.dup(fd)
            os.close(fd)
            try:
                with pytest.raises(StoreError) as e:
                    store.read_rows([lo + 5, lo + 6])
                messages.append(str(e.value))
            finally:
                os.dup2(saved, fd)  # the store closes it at the end
                os.close(saved)
            assert store.read_rows([lo + 5]) == packed_row(14, lo + 5)
        path = packs / "engram-l14-r1of3.bin"
        assert messages == [f"{path}: reading row {lo + 5} failed: Bad file descriptor (errno {errno.EBADF})"] * 2


def test_a_failed_host_function_is_kept_for_the_next_lookup(packs, library, tmp_path) -> None:
    shutil.copy(packs / "engram-l1-r2of3.bin", tmp_path / "engram-l1-r2of3.bin")
    lo, hi = fmt.row_range(ROWS[1], 2, TP)
    store = RowStore.open_rank(tmp_path, layer=1, rank=2, tp=TP, total_rows=ROWS[1], settings=settings(),
                               native=library)
    with store:
        with open(tmp_path / "engram-l1-r2of3.bin", "r+b") as f:
            f.truncate(fmt.HEADER_BYTES)
        _, _, base = keep = launch(store.native, [lo, hi - 1], 2)
        call_host_fn(store.native.host_fn, store.native.launch_arg(base, 2))
        first = store.native.failure()
        assert first is not None and "short read of row" in first and "re-pack" in first
        call_host_fn(store.native.host_fn, store.native.launch_arg(base, 1))
        assert store.native.failure() == first  # the first failure is kept
        del keep


def test_a_failed_host_function_with_an_exit_line_ends_the_process(packs, library, tmp_path) -> None:
    shutil.copy(packs / "engram-l14-r0of3.bin", tmp_path / "engram-l14-r0of3.bin")
    script = f"""
import ctypes, os
from array import array
from adapter.engram import native
from adapter.engram.settings import StoreSettings
from adapter.engram.store import RowStore
lib = native.Library({str(library.path)!r})
store = RowStore.open_rank({str(tmp_path)!r}, layer=14, rank=0, tp=3, settings=StoreSettings(io_threads=4), native=lib)
store.native.exit_on_failure("dsv41-adapter: engram_offload: reading Engram rows failed: StoreError: ")
os.truncate({str(tmp_path / 'engram-l14-r0of3.bin')!r}, 4096)
ids, out = array("q", [5, 6]), bytearray(2 * 264)
base = store.native.launches(ids.buffer_info()[0], ctypes.addressof((ctypes.c_char * len(out)).from_buffer(out)), 2)
ctypes.CFUNCTYPE(None, ctypes.c_void_p)(store.native.host_fn)(store.native.launch_arg(base, 2))
print("still running")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 1, done.stdout + done.stderr
    assert "still running" not in done.stdout
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("dsv41-adapter: engram_offload: reading Engram rows failed: StoreError: ")
    assert "engram-l14-r0of3.bin: short read of row 5 (0 of 264 bytes)" in line
    assert line.endswith("re-pack with `dsv41ctl pack --start`; the rank stops")


def test_a_closed_reader_refuses_reads(packs, library) -> None:
    _, fast = open_pair(packs, library, 1, 0, settings())
    reader = fast.native
    fast.close()
    with pytest.raises(ValueError, match="the native reader is closed"):
        reader.read(0, 1, 0)
    assert reader.take_stats() is None


def test_a_cache_too_small_for_one_set_is_refused_as_by_the_python_store(packs, library) -> None:
    for lib in (None, library):
        with pytest.raises(ValueError, match=r"cannot hold one set of 4 rows of 264 bytes"):
            RowStore.open_rank(packs, layer=1, rank=0, tp=TP, settings=settings(cache_gib=1e-7, cache_ways=4),
                               native=lib)


# ----- building -----

def test_without_torch_the_build_falls_back_and_says_so_once(tmp_path) -> None:
    script = """
import sys
from adapter.engram import native
lines = []
first = native.load(sys.argv[1], log=lines.append)
second = native.load(sys.argv[1], log=lines.append)
print(first is None and second is None, len(lines))
print(lines[0])
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(["/usr/bin/python3", "-S", "-c", f"import sys; sys.path.insert(0, {str(REPO)!r})\n{script}",
                           str(tmp_path)], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    verdict, line = done.stdout.strip().splitlines()
    assert verdict == "True 1"
    assert line.startswith("native Engram row reader unavailable (NativeError: torch is needed to build the reader: ")
    assert line.endswith("); rows are read by the Python path, which needs the GIL")


def test_the_build_key_follows_what_the_library_depends_on() -> None:
    text = native.SOURCE.read_text()
    key = native.build_key(text, "2.11.0+cu130")
    assert key == native.build_key(text, "2.11.0+cu130") and len(key) == 16
    assert key != native.build_key(text + "\n", "2.11.0+cu130")
    assert key != native.build_key(text, "2.13.0+cpu")


def test_a_library_of_another_abi_is_refused(tmp_path) -> None:
    src = tmp_path / "old.cpp"
    src.write_text('extern "C" int dsv41_engram_abi() { return 0; }\n')
    subprocess.run(["g++", "-shared", "-fPIC", str(src), "-o", str(tmp_path / "old.so")], check=True)
    with pytest.raises(native.NativeError, match=r"ABI 0, expected 1"):
        native.Library(tmp_path / "old.so")


# ----- the rank's statistics timer -----

def test_the_rank_statistics_report_from_their_timer_and_skip_idle_intervals(packs, library) -> None:
    lines: list[str] = []
    lo, _ = fmt.row_range(ROWS[1], 0, TP)
    s = settings()
    stores = {layer: RowStore.open_rank(packs, layer=layer, rank=0, tp=TP, settings=s, native=library)
              for layer in fmt.LAYERS}
    rank = RankStats("engram_offload: rank 0/3", 0.2, time.monotonic, lines.append, cache_enabled=False)
    try:
        for layer, store in stores.items():
            rank.add(layer, store.stats)
        rank.start_timer()
        time.sleep(0.5)
        assert lines == []  # nothing read: no line
        stores[1].read_rows([lo, lo + 1])  # a native read: no Python runs that could report it
        deadline = time.monotonic() + 5
        while not lines and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        rank.stop_timer()
        for store in stores.values():
            store.close()
    assert len(lines) == 1, lines
    assert lines[0].startswith("engram_offload: rank 0/3: ") and "(0 hits, 2 rows read)" in lines[0]
    assert "layer 1 " in lines[0] and "layer 14 0 rows/s" in lines[0]


def test_a_machine_with_only_g_plus_plus_builds_with_it(tmp_path, monkeypatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "g++").symlink_to(shutil.which("g++"))
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.delenv("CXX", raising=False)
    with native._compiler():
        assert os.environ["CXX"] == str(bin_dir / "g++")
    assert "CXX" not in os.environ
    (bin_dir / "g++").unlink()
    with pytest.raises(native.NativeError, match=r"no C\+\+ compiler \(c\+\+, g\+\+ or clang\+\+\) on PATH"):
        with native._compiler():
            pass
    monkeypatch.setenv("CXX", "/opt/cc/bin/c++")  # an explicit choice is left alone
    with native._compiler():
        assert os.environ["CXX"] == "/opt/cc/bin/c++"
