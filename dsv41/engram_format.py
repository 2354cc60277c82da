"""The packed Engram shard format: names, row ranges and the one header codec (pure, stdlib only).

A packed shard ``engram-l{L}-r{R}of{TP}.bin`` is a 4096-byte header of little-endian u64 fields
(magic, layer, row_lo, row_hi, total_rows, row_bytes), zero-padded, followed by ``row_hi - row_lo``
rows of 264 bytes: the row's 256 FP8-E4M3 weight bytes, then its 8 E8M0 scale bytes (one scale per
32 weights). Rank R of TP owns the floor-split range ``[N*R//TP, N*(R+1)//TP)``. Files written by
the existing recipe use exactly this layout and must keep being accepted.

While a pack is in progress the file lives under a temporary name and carries a *partial* header
(another magic, plus the number of rows known to be on disk), so it can never pass for a complete
shard and it records its own crash-safe resume point.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

# On disk the u64 reads b"DSV1EN41"; the recipes call it "DSV41EN1". The number is what counts.
MAGIC = 0x31344E4531565344
PARTIAL_MAGIC = int.from_bytes(b"DSV41ENP", "little")
HEADER_BYTES = 4096
WEIGHT_BYTES = 256
SCALE_BYTES = 8
ROW_BYTES = WEIGHT_BYTES + SCALE_BYTES
VALUES_PER_SCALE = WEIGHT_BYTES // SCALE_BYTES
LAYERS = (1, 14)
PARTIAL_SUFFIX = ".partial"
REPACK_HINT = "re-pack with `dsv41ctl pack --start`"

_FIELDS = struct.Struct("<6Q")
_PARTIAL_FIELDS = struct.Struct("<7Q")
_NAME = re.compile(r"engram-l(\d+)-r(\d+)of(\d+)\.bin")


class HeaderError(ValueError):
    """A header that is not a packed Engram header (or not the one expected)."""


@dataclass(frozen=True)
class Header:
    layer: int
    row_lo: int
    row_hi: int
    total_rows: int
    row_bytes: int = ROW_BYTES

    @property
    def rows(self) -> int:
        return self.row_hi - self.row_lo

    @property
    def file_bytes(self) -> int:
        return HEADER_BYTES + self.rows * self.row_bytes

    def describe(self) -> str:
        return f"layer {self.layer} rows [{self.row_lo}, {self.row_hi}) of {self.total_rows}"


@dataclass(frozen=True)
class PartialHeader:
    """Header of a pack in progress: the target header plus rows durably written so far."""

    target: Header
    rows_done: int


def check_rank(rank: int, tp: int) -> None:
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if not 0 <= rank < tp:
        raise ValueError(f"rank must be in [0, {tp}), got {rank}")


def check_layer(layer: int) -> None:
    if layer not in LAYERS:
        raise ValueError(f"Engram layer must be one of {LAYERS}, got {layer}")


def row_range(total_rows: int, rank: int, tp: int) -> tuple[int, int]:
    """The floor-split range of global rows rank ``rank`` of ``tp`` owns."""
    check_rank(rank, tp)
    if total_rows < 0:
        raise ValueError(f"total_rows must be >= 0, got {total_rows}")
    return total_rows * rank // tp, total_rows * (rank + 1) // tp


def expected_header(layer: int, total_rows: int, rank: int, tp: int) -> Header:
    check_layer(layer)
    lo, hi = row_range(total_rows, rank, tp)
    return Header(layer=layer, row_lo=lo, row_hi=hi, total_rows=total_rows)


def file_name(layer: int, rank: int, tp: int) -> str:
    check_layer(layer)
    check_rank(rank, tp)
    return f"engram-l{layer}-r{rank}of{tp}.bin"


def partial_name(layer: int, rank: int, tp: int) -> str:
    return file_name(layer, rank, tp) + PARTIAL_SUFFIX


def parse_name(name: str) -> tuple[int, int, int] | None:
    """(layer, rank, tp) of a complete shard's file name, or None for any other name."""
    m = _NAME.fullmatch(name)
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def row_offset(header: Header, global_row: int) -> int:
    """Byte offset of a global row inside the shard described by ``header``."""
    if not header.row_lo <= global_row < header.row_hi:
        raise ValueError(f"row {global_row} is outside {header.describe()}")
    return HEADER_BYTES + (global_row - header.row_lo) * header.row_bytes


def encode_header(header: Header) -> bytes:
    _check_fields(header)
    return _FIELDS.pack(MAGIC, header.layer, header.row_lo, header.row_hi, header.total_rows,
                        header.row_bytes).ljust(HEADER_BYTES, b"\0")


def decode_header(buf: bytes) -> Header:
    """Parse a complete shard's header; HeaderError says what is wrong."""
    magic = _magic(buf)
    if magic == PARTIAL_MAGIC:
        raise HeaderError("header is a partial (in-progress) pack header, not a complete shard")
    if magic != MAGIC:
        raise HeaderError(f"bad magic {magic:#018x}, expected {MAGIC:#018x}")
    _, layer, lo, hi, total, row_bytes = _FIELDS.unpack_from(buf)
    _check_padding(buf, _FIELDS.size)
    header = Header(layer=layer, row_lo=lo, row_hi=hi, total_rows=total, row_bytes=row_bytes)
    _check_fields(header)
    return header


def encode_partial(partial: PartialHeader) -> bytes:
    t = partial.target
    _check_fields(t)
    if not 0 <= partial.rows_done <= t.rows:
        raise HeaderError(f"rows_done {partial.rows_done} outside [0, {t.rows}]")
    return _PARTIAL_FIELDS.pack(PARTIAL_MAGIC, t.layer, t.row_lo, t.row_hi, t.total_rows,
                                t.row_bytes, partial.rows_done).ljust(HEADER_BYTES, b"\0")


def decode_partial(buf: bytes) -> PartialHeader:
    magic = _magic(buf)
    if magic != PARTIAL_MAGIC:
        raise HeaderError(f"bad partial magic {magic:#018x}, expected {PARTIAL_MAGIC:#018x}")
    _, layer, lo, hi, total, row_bytes, done = _PARTIAL_FIELDS.unpack_from(buf)
    _check_padding(buf, _PARTIAL_FIELDS.size)
    target = Header(layer=layer, row_lo=lo, row_hi=hi, total_rows=total, row_bytes=row_bytes)
    _check_fields(target)
    if done > target.rows:
        raise HeaderError(f"partial header claims {done} rows done of {target.rows}")
    return PartialHeader(target=target, rows_done=done)


def mismatch(found: Header, expected: Header) -> str | None:
    """Why ``found`` is not the shard ``expected`` describes, or None when it is."""
    if found == expected:
        return None
    if found.layer != expected.layer:
        return f"header is for layer {found.layer}, expected layer {expected.layer}"
    if found.total_rows != expected.total_rows:
        return (f"header is for a table of {found.total_rows} rows, the checkpoint has "
                f"{expected.total_rows}")
    owner = owner_of(found)
    whose = f" (rank {owner[0]} of tp {owner[1]})" if owner else ""
    return (f"header holds rows [{found.row_lo}, {found.row_hi}){whose}, this rank needs "
            f"[{expected.row_lo}, {expected.row_hi})")


def owner_of(header: Header, max_tp: int = 64) -> tuple[int, int] | None:
    """(rank, tp) whose floor split gives exactly the header's range, smallest tp first."""
    n = header.total_rows
    for tp in range(1, max_tp + 1):
        rank = -(-header.row_lo * tp // n) if n else 0  # ceil: inverts the floor split
        if rank < tp and row_range(n, rank, tp) == (header.row_lo, header.row_hi):
            return rank, tp
    return None


@dataclass(frozen=True)
class Fault:
    """Rows [lo, hi) that no range covers (gap), that two ranges cover (overlap), or that a range
    claims past the end of the table (beyond)."""

    kind: str  # "gap", "overlap" or "beyond" (rows past the end of the table)
    lo: int
    hi: int
    ranges: tuple[int, ...]  # indexes into the ranges given: a gap's neighbours, an overlap's owners


def coverage_faults(ranges: Sequence[tuple[int, int]], total_rows: int) -> list[Fault]:
    """How the row ranges fail to partition ``[0, total_rows)`` exactly; [] when they do. Every
    rank looks up every row and the TP all-reduce sums them, so a gap reads as zeros and an
    overlap doubles a row: both are silent wrong results."""
    order = sorted(range(len(ranges)), key=lambda i: (ranges[i][0], ranges[i][1]))
    faults: list[Fault] = []
    cursor, last = 0, None  # rows below cursor are covered; last: the range that reached it
    for i in order:
        lo, hi = ranges[i]
        if lo >= hi:
            continue  # an empty range (more ranks than rows) owns nothing
        if lo > cursor:
            faults.append(Fault("gap", cursor, lo, tuple(x for x in (last, i) if x is not None)))
        elif lo < cursor and last is not None:
            faults.append(Fault("overlap", lo, min(hi, cursor), (last, i)))
        if hi > cursor:
            cursor, last = hi, i
    if cursor < total_rows:
        faults.append(Fault("gap", cursor, total_rows, (last,) if last is not None else ()))
    elif cursor > total_rows:
        faults.append(Fault("beyond", total_rows, cursor, (last,) if last is not None else ()))
    return faults


def _magic(buf: bytes) -> int:
    if len(buf) < HEADER_BYTES:
        raise HeaderError(f"header is {len(buf)} bytes, expected {HEADER_BYTES}")
    return int.from_bytes(buf[:8], "little")


def _check_padding(buf: bytes, used: int) -> None:
    if any(buf[used:HEADER_BYTES]):
        raise HeaderError(f"header bytes {used}..{HEADER_BYTES} are not zero")


def _check_fields(h: Header) -> None:
    if h.row_bytes != ROW_BYTES:
        raise HeaderError(f"row_bytes is {h.row_bytes}, expected {ROW_BYTES}")
    if not h.row_lo <= h.row_hi <= h.total_rows:
        raise HeaderError(f"row range [{h.row_lo}, {h.row_hi}) does not fit a table of "
                          f"{h.total_rows} rows")
