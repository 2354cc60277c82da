"""Pack state: absent, packing, complete, stale and corrupt, from files written by hand from the
format description (not by the packer)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from test_pack_checkpoint import ROWS, packed_row, write_checkpoint

from agent.pack.state import Status, pack_state

pytestmark = pytest.mark.unit

N = ROWS[14]


def floor_range(n: int, rank: int, tp: int) -> tuple[int, int]:
    return n * rank // tp, n * (rank + 1) // tp


def hand_written(path: Path, layer: int, lo: int, hi: int, n: int, magic: int = 0x31344E4531565344,
                 rows: bytes | None = None) -> Path:
    header = struct.pack("<6Q", magic, layer, lo, hi, n, 264) + bytes(4096 - 48)
    path.write_bytes(header + (rows if rows is not None else
                               b"".join(packed_row(layer, i) for i in range(lo, hi))))
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "model")


def one(out: Path, rank: int = 1, tp: int = 3, model: Path | None = None, layer: int = 14):
    return pack_state(out, rank, tp, (layer,), model)[0]


def test_absent(tmp_path: Path) -> None:
    s = one(tmp_path)
    assert s.status is Status.ABSENT and "engram-l14-r1of3.bin does not exist" in s.detail
    assert (s.row_lo, s.row_hi, s.total_rows) == (0, 0, 0)


def test_hand_written_file_is_complete_with_and_without_source(tmp_path: Path, model: Path) -> None:
    hand_written(tmp_path / "engram-l14-r1of3.bin", 14, *floor_range(N, 1, 3), N)
    for source in (None, model):
        s = one(tmp_path, model=source)
        assert s.status is Status.COMPLETE, s.detail
        assert s.done_bytes == s.total_bytes == (N * 2 // 3 - N // 3) * 264
        assert (s.row_lo, s.row_hi, s.total_rows) == (*floor_range(N, 1, 3), N)


def test_other_tp_size_is_stale_and_named(tmp_path: Path) -> None:
    hand_written(tmp_path / "engram-l14-r1of4.bin", 14, *floor_range(N, 1, 4), N)
    s = one(tmp_path)
    assert s.status is Status.STALE
    assert "another TP size: engram-l14-r1of4.bin" in s.detail


def test_header_for_another_range_is_stale_and_says_whose(tmp_path: Path) -> None:
    lo, hi = floor_range(N, 1, 4)
    hand_written(tmp_path / "engram-l14-r1of3.bin", 14, lo, hi, N)
    s = one(tmp_path)
    assert s.status is Status.STALE
    assert (s.row_lo, s.row_hi, s.total_rows) == (lo, hi, N)  # the rows the file really holds
    want = floor_range(N, 1, 3)
    assert f"holds rows [{lo}, {hi}) (rank 1 of tp 4), this rank needs [{want[0]}, {want[1]})" \
        in s.detail


def test_header_for_another_table_size_is_stale_with_source(tmp_path: Path, model: Path) -> None:
    hand_written(tmp_path / "engram-l14-r1of3.bin", 14, *floor_range(N + 3, 1, 3), N + 3,
                 rows=bytes(264 * (floor_range(N + 3, 1, 3)[1] - floor_range(N + 3, 1, 3)[0])))
    assert one(tmp_path).status is Status.COMPLETE  # without the checkpoint the header is trusted
    s = one(tmp_path, model=model)
    assert s.status is Status.STALE and f"table of {N + 3} rows, the checkpoint has {N}" in s.detail


def test_truncated_file_is_corrupt(tmp_path: Path) -> None:
    path = hand_written(tmp_path / "engram-l14-r1of3.bin", 14, *floor_range(N, 1, 3), N)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)
    s = one(tmp_path)
    assert s.status is Status.CORRUPT and "size is" in s.detail


def test_bad_magic_is_corrupt(tmp_path: Path) -> None:
    hand_written(tmp_path / "engram-l14-r1of3.bin", 14, *floor_range(N, 1, 3), N, magic=1234)
    s = one(tmp_path)
    assert s.status is Status.CORRUPT and "bad magic" in s.detail
    assert (s.row_lo, s.row_hi, s.total_rows) == (0, 0, 0)


def test_flipped_end_row_is_corrupt_against_the_source(tmp_path: Path, model: Path) -> None:
    lo, hi = floor_range(N, 1, 3)
    rows = bytearray(b"".join(packed_row(14, i) for i in range(lo, hi)))
    rows[-1] ^= 0xFF  # the last row's last scale byte: ends are always sampled
    hand_written(tmp_path / "engram-l14-r1of3.bin", 14, lo, hi, N, rows=bytes(rows))
    assert one(tmp_path).status is Status.COMPLETE
    s = one(tmp_path, model=model)
    assert s.status is Status.CORRUPT and f"row {hi - 1} differs from the checkpoint" in s.detail


def test_partial_file_reports_packing_progress(tmp_path: Path, model: Path) -> None:
    lo, hi = floor_range(N, 1, 3)
    partial_magic = int.from_bytes(b"DSV41ENP", "little")
    header = struct.pack("<7Q", partial_magic, 14, lo, hi, N, 264, 123) + bytes(4096 - 56)
    (tmp_path / "engram-l14-r1of3.bin.partial").write_bytes(header + bytes(264 * (hi - lo)))
    for source in (None, model):
        s = one(tmp_path, model=source)
        assert s.status is Status.PACKING
        assert (s.done_bytes, s.total_bytes) == (123 * 264, (hi - lo) * 264)
        assert (s.row_lo, s.row_hi, s.total_rows) == (lo, hi, N)


def test_partial_under_final_name_is_corrupt(tmp_path: Path) -> None:
    lo, hi = floor_range(N, 1, 3)
    partial_magic = int.from_bytes(b"DSV41ENP", "little")
    header = struct.pack("<7Q", partial_magic, 14, lo, hi, N, 264, 5) + bytes(4096 - 56)
    (tmp_path / "engram-l14-r1of3.bin").write_bytes(header + bytes(264 * (hi - lo)))
    s = one(tmp_path)
    assert s.status is Status.CORRUPT and "partial" in s.detail
