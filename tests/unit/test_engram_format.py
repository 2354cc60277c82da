"""The header codec, names and floor-split ranges."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsv41 import engram_format as fmt

pytestmark = pytest.mark.unit


@given(n=st.integers(0, 10**9), tp=st.integers(1, 16))
def test_floor_split_covers_every_row_once(n: int, tp: int) -> None:
    ranges = [fmt.row_range(n, r, tp) for r in range(tp)]
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert max(hi - lo for lo, hi in ranges) - min(hi - lo for lo, hi in ranges) <= 1


def test_real_table_split_at_tp3() -> None:
    # Layer 14 (384016682 rows) is not divisible by 3: stock SGLang's equal split fails there.
    assert [fmt.row_range(384016682, r, 3) for r in range(3)] == [
        (0, 128005560), (128005560, 256011121), (256011121, 384016682)]


def test_header_bytes_match_the_description() -> None:
    h = fmt.expected_header(14, 384016682, 1, 3)
    raw = fmt.encode_header(h)
    assert len(raw) == 4096 and not any(raw[48:])
    assert raw[:48] == struct.pack("<6Q", 0x31344E4531565344, 14, 128005560, 256011121,
                                   384016682, 264)
    assert fmt.decode_header(raw) == h
    assert h.file_bytes == 4096 + (256011121 - 128005560) * 264


@given(n=st.integers(0, 2**40), tp=st.integers(1, 64), data=st.data())
def test_owner_is_recovered_from_a_header(n: int, tp: int, data: st.DataObject) -> None:
    rank = data.draw(st.integers(0, tp - 1))
    h = fmt.expected_header(1, n, rank, tp)
    owner = fmt.owner_of(h)
    assert owner is not None
    assert fmt.row_range(n, *owner) == (h.row_lo, h.row_hi)


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b[:100], "header is 100 bytes"),
    (lambda b: b"\0" * 8 + b[8:], "bad magic"),
    (lambda b: b[:40] + struct.pack("<Q", 256) + b[48:], "row_bytes is 256"),
    (lambda b: b[:24] + struct.pack("<Q", 10**10) + b[32:], "does not fit"),
    (lambda b: b[:4095] + b"\1", "are not zero"),
])
def test_bad_headers_say_what_is_wrong(mutate, message: str) -> None:
    raw = fmt.encode_header(fmt.expected_header(1, 1001, 0, 3))
    with pytest.raises(fmt.HeaderError, match=message):
        fmt.decode_header(mutate(raw))


def test_partial_header_never_decodes_as_complete() -> None:
    target = fmt.expected_header(1, 1001, 2, 3)
    raw = fmt.encode_partial(fmt.PartialHeader(target, 17))
    assert fmt.decode_partial(raw) == fmt.PartialHeader(target, 17)
    with pytest.raises(fmt.HeaderError, match="partial"):
        fmt.decode_header(raw)
    with pytest.raises(fmt.HeaderError, match="rows_done"):
        fmt.encode_partial(fmt.PartialHeader(target, target.rows + 1))


def test_names() -> None:
    assert fmt.file_name(14, 2, 3) == "engram-l14-r2of3.bin"
    assert fmt.partial_name(1, 0, 3) == "engram-l1-r0of3.bin.partial"
    assert fmt.parse_name("engram-l14-r2of3.bin") == (14, 2, 3)
    assert fmt.parse_name("engram-l14-r2of3.bin.partial") is None
    with pytest.raises(ValueError, match=r"rank must be in \[0, 3\), got 3"):
        fmt.file_name(1, 3, 3)
    with pytest.raises(ValueError, match=r"one of \(1, 14\), got 2"):
        fmt.file_name(2, 0, 3)


def test_floor_split_ranges_partition_any_table() -> None:
    from dsv41.engram_format import coverage_faults

    for n in (0, 1, 2, 1001, 384016682):
        for tp in (1, 2, 3, 4, 8):
            assert coverage_faults([fmt.row_range(n, r, tp) for r in range(tp)], n) == [], (n, tp)
    # SGLang's column split at TP 3 is just as exact, and order does not matter.
    assert coverage_faults([(700, 1001), (0, 300), (300, 700)], 1001) == []


def test_gaps_overlaps_and_rows_past_the_end_are_named() -> None:
    from dsv41.engram_format import Fault, coverage_faults

    assert coverage_faults([(0, 333), (334, 667), (667, 1001)], 1001) == [Fault("gap", 333, 334, (0, 1))]
    assert coverage_faults([(0, 334), (333, 667), (667, 1001)], 1001) == [Fault("overlap", 333, 334, (0, 1))]
    assert coverage_faults([(0, 333), (333, 667)], 1001) == [Fault("gap", 667, 1001, (1,))]
    assert coverage_faults([(0, 500), (500, 1002)], 1001) == [Fault("beyond", 1001, 1002, (1,))]
    assert coverage_faults([], 5) == [Fault("gap", 0, 5, ())]
    # A range inside another: the overlap is the inner range, owned by both.
    assert coverage_faults([(0, 1001), (10, 20)], 1001) == [Fault("overlap", 10, 20, (0, 1))]
