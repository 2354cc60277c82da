"""The rank's row store against packed files written by hand from the format description."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from adapter.engram.settings import StoreSettings
from adapter.engram.store import RowStore, StoreError

pytestmark = pytest.mark.unit

N, LAYER = 1001, 1
MAGIC = 0x31344E4531565344


def row_bytes(row: int) -> bytes:
    return bytes((row * 7 + j) & 0xFF for j in range(256)) + struct.pack("<Q", row ^ 0xA5A5)


def write_shard(path: Path, lo: int, hi: int, n: int = N, layer: int = LAYER) -> Path:
    header = struct.pack("<6Q", MAGIC, layer, lo, hi, n, 264).ljust(4096, b"\0")
    path.write_bytes(header + b"".join(row_bytes(r) for r in range(lo, hi)))
    return path


def rank_range(rank: int, tp: int, n: int = N) -> tuple[int, int]:
    return n * rank // tp, n * (rank + 1) // tp


def quiet(**kw) -> StoreSettings:
    return StoreSettings(**{"io_threads": 8, "stats_seconds": 0, **kw})


@pytest.fixture
def shard(tmp_path: Path) -> Path:
    return write_shard(tmp_path / "engram-l1-r1of3.bin", *rank_range(1, 3))


def test_hand_written_shard_reads_back_with_zeros_outside_the_range(shard: Path) -> None:
    lo, hi = rank_range(1, 3)
    ids = [0, lo - 1, lo, lo + 1, hi - 1, hi, N - 1, lo + 5, lo + 5, (lo + hi) // 2]
    with RowStore(shard, layer=1, rank=1, tp=3, total_rows=N, settings=quiet()) as store:
        got = store.read_rows(ids)
    for k, row in enumerate(ids):
        want = row_bytes(row) if lo <= row < hi else bytes(264)
        assert got[k * 264:(k + 1) * 264] == want, row


@pytest.mark.parametrize("threads", [1, 3, 96])
def test_every_row_at_any_thread_count(tmp_path: Path, threads: int) -> None:
    # The whole table in one shard: a batch large enough to be split over several tasks.
    path = write_shard(tmp_path / "engram-l1-r0of1.bin", 0, N)
    ids = list(range(N - 1, -1, -1))
    with RowStore(path, layer=1, rank=0, tp=1, settings=quiet(io_threads=threads)) as store:
        got = store.read_rows(ids)
    assert got == b"".join(row_bytes(r) for r in ids)


def test_reused_buffer_gets_zeros_for_foreign_ids(shard: Path) -> None:
    lo, _ = rank_range(1, 3)
    buf = bytearray(b"\xff" * 264 * 2)
    with RowStore(shard, layer=1, rank=1, tp=3, settings=quiet()) as store:
        store.read_rows_into([0, lo], memoryview(buf))
    assert buf == bytes(264) + row_bytes(lo)


def test_shard_for_another_tp_is_refused_naming_the_fix(tmp_path: Path) -> None:
    path = write_shard(tmp_path / "engram-l1-r1of3.bin", *rank_range(1, 4))
    with pytest.raises(StoreError, match=r"rank 1 of tp 4.*re-pack with `dsv41ctl pack --start`"):
        RowStore(path, layer=1, rank=1, tp=3, settings=quiet())


def test_wrong_table_size_is_refused(shard: Path) -> None:
    with pytest.raises(StoreError, match=r"table of 1001 rows, the checkpoint has 1004"):
        RowStore(shard, layer=1, rank=1, tp=3, total_rows=1004, settings=quiet())


def test_wrong_layer_is_refused(shard: Path) -> None:
    with pytest.raises(StoreError, match="header is for layer 1, expected layer 14"):
        RowStore(shard, layer=14, rank=1, tp=3, settings=quiet())


def test_truncated_shard_is_refused(shard: Path) -> None:
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 264)
    with pytest.raises(StoreError, match="size is .* re-pack"):
        RowStore(shard, layer=1, rank=1, tp=3, settings=quiet())


def test_missing_shard_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no packed Engram shard .* re-pack"):
        RowStore.open_rank(tmp_path, layer=14, rank=0, tp=3, settings=quiet())


def test_cache_serves_repeats_and_stays_correct_under_eviction(shard: Path) -> None:
    lo, hi = rank_range(1, 3)
    lines: list[str] = []
    tiny = quiet(cache_gib=264 * 4 * 8 / 2**30, cache_ways=4)  # 8 sets of 4 ways = 32 rows
    with RowStore(shard, layer=1, rank=1, tp=3, settings=tiny, log=lines.append) as store:
        few = list(range(lo, lo + 8))
        store.read_rows(few)
        assert store.read_rows(few) == b"".join(row_bytes(r) for r in few)
        assert store.stats.hits == 8
        many = list(range(lo, hi))  # far more rows than slots: evictions everywhere
        for _ in range(2):
            assert store.read_rows(many) == b"".join(row_bytes(r) for r in many)
        assert store.stats.hits + store.stats.misses == 8 + 8 + 2 * len(many)
        assert store.stats.misses >= 8 + 2 * (len(many) - 32)


def test_stats_line_every_interval(shard: Path) -> None:
    now = [100.0]
    lines: list[str] = []
    settings = quiet(stats_seconds=60, cache_gib=0.001)
    lo, _ = rank_range(1, 3)
    with RowStore(shard, layer=1, rank=1, tp=3, settings=settings, clock=lambda: now[0],
                  log=lines.append) as store:
        store.read_rows([lo, lo + 1, 0, 1])
        now[0] += 30
        store.read_rows([lo, lo + 1])
        assert lines == []
        now[0] += 30
        store.read_rows([lo + 2])
        assert len(lines) == 1
    line = lines[0]
    assert line.startswith("engram layer 1 rank 1/3: 0 rows/s in 3 batches over 60.0 s")
    assert "cache hit 40.0 % (2 hits, 3 rows read)" in line
    assert " µs" in line or " ms" in line


def test_settings_from_env() -> None:
    env = {"DSV41_IO_THREADS": "16", "DSV41_CACHE_GIB": "0.5", "DSV41_CACHE_WAYS": "8",
           "DSV41_STATS_SECONDS": "10"}
    assert StoreSettings.from_env(env) == StoreSettings(16, 0.5, 8, 10.0)
    assert StoreSettings.from_env({}) == StoreSettings()
    with pytest.raises(ValueError, match=r"DSV41_IO_THREADS='many': expected an integer"):
        StoreSettings.from_env({"DSV41_IO_THREADS": "many"})
    with pytest.raises(ValueError, match=r"DSV41_IO_THREADS=0: outside the allowed range \[1, 1024\]"):
        StoreSettings.from_env({"DSV41_IO_THREADS": "0"})


def test_settings_read_resident_scales() -> None:
    assert StoreSettings.from_env({"DSV41_RESIDENT_SCALES": "1"}).resident_scales is True
    assert StoreSettings.from_env({"DSV41_RESIDENT_SCALES": "0"}).resident_scales is False
    with pytest.raises(ValueError, match=r"DSV41_RESIDENT_SCALES='2': expected 1 or 0"):
        StoreSettings.from_env({"DSV41_RESIDENT_SCALES": "2"})


@pytest.mark.parametrize("threads", [1, 8])
def test_resident_scales_serve_the_same_rows_reading_weights_only(tmp_path: Path, threads: int) -> None:
    lo, hi = rank_range(1, 3)
    path = write_shard(tmp_path / "engram-l1-r1of3.bin", lo, hi)
    ids = list(range(hi + 5, lo - 5, -1)) + [lo, lo]
    resident = quiet(io_threads=threads, resident_scales=True)
    with RowStore(path, layer=1, rank=1, tp=3, total_rows=N, settings=resident) as store:
        # The scale bytes now come from memory: scribble over them on disk, the rows stay right.
        with open(path, "r+b") as f:
            for row in range(lo, hi):
                f.seek(4096 + (row - lo) * 264 + 256)
                f.write(b"\xee" * 8)
        got = store.read_rows(ids)
    for k, row in enumerate(ids):
        want = row_bytes(row) if lo <= row < hi else bytes(264)
        assert got[k * 264:(k + 1) * 264] == want, row
    with RowStore(path, layer=1, rank=1, tp=3, total_rows=N, settings=quiet()) as plain:
        assert plain.read_rows([lo])[256:] == b"\xee" * 8  # without them the disk's bytes are read


def test_resident_scales_over_several_scan_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import adapter.engram.store as store_mod

    monkeypatch.setattr(store_mod, "_SCAN_ROWS", 7)  # 334 rows: 47 full chunks and a short one
    lo, hi = rank_range(1, 3)
    path = write_shard(tmp_path / "engram-l1-r1of3.bin", lo, hi)
    with RowStore(path, layer=1, rank=1, tp=3, settings=quiet(resident_scales=True)) as store:
        assert store.read_rows(list(range(lo, hi))) == b"".join(row_bytes(r) for r in range(lo, hi))
