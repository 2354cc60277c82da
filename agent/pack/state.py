"""Pack state of one node: per Engram layer, is this rank's shard absent, packing, complete,
stale or corrupt? Reads headers, sizes and a few sampled rows only: it answers in milliseconds."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from pathlib import Path

from dsv41 import engram_format as fmt
from agent.pack.checkpoint import EngramTable, SourceRows, engram_tables
from agent.pack.verify import first_mismatch, sample_rows

DEFAULT_SAMPLE_ROWS = 8


class Status(str, enum.Enum):
    ABSENT = "absent"
    PACKING = "packing"  # a temporary file is present (running now, or resumable)
    COMPLETE = "complete"
    STALE = "stale"  # a shard for another TP size, row range or table size
    CORRUPT = "corrupt"  # wrong size, bad header, or rows that differ from the checkpoint


@dataclass(frozen=True)
class LayerState:
    layer: int
    status: Status
    path: Path  # the complete shard's path (the file the rank opens)
    detail: str  # one line for people: what was found and why this status
    done_bytes: int = 0  # row bytes known to be written (packing) or present (complete)
    total_bytes: int = 0  # row bytes of the complete shard, 0 when unknown
    # The header's global rows [row_lo, row_hi) of a table of total_rows (packing: the partial
    # pack's target); all 0 when no header could be read. The coordinator checks that the ranks'
    # ranges partition each table.
    row_lo: int = 0
    row_hi: int = 0
    total_rows: int = 0


def _rows(header: fmt.Header) -> dict[str, int]:
    return {"row_lo": header.row_lo, "row_hi": header.row_hi, "total_rows": header.total_rows}


def pack_state(out_dir: str | Path, rank: int, tp: int, layers: tuple[int, ...] = fmt.LAYERS,
               model_dir: str | Path | None = None,
               sample: int = DEFAULT_SAMPLE_ROWS) -> list[LayerState]:
    """State of each layer; with ``model_dir`` the row count and sampled rows are checked against
    the checkpoint (CheckpointError when it cannot be read), without it the header is trusted."""
    fmt.check_rank(rank, tp)
    out_dir = Path(out_dir)
    if model_dir is None:
        return [layer_state(out_dir, layer, rank, tp) for layer in layers]
    tables = engram_tables(model_dir, layers)
    with SourceRows(tables) as source:
        return [layer_state(out_dir, layer, rank, tp, tables[layer], source, sample)
                for layer in layers]


def layer_state(out_dir: Path, layer: int, rank: int, tp: int, table: EngramTable | None = None,
                source: SourceRows | None = None,
                sample: int = DEFAULT_SAMPLE_ROWS) -> LayerState:
    path = out_dir / fmt.file_name(layer, rank, tp)
    expected = fmt.expected_header(layer, table.rows, rank, tp) if table else None
    final = _final_state(path, layer, rank, tp, expected, source, sample)
    if final.status is Status.COMPLETE:
        return final
    partial = out_dir / fmt.partial_name(layer, rank, tp)
    if partial.exists():
        return _partial_state(path, partial, layer, rank, tp, expected, final)
    if final.status is Status.ABSENT:
        others = other_tp_files(out_dir, layer, tp)
        if others:
            return LayerState(layer, Status.STALE, path,
                              f"no shard for tp {tp}; found shards for another TP size: "
                              + ", ".join(sorted(p.name for p in others)))
    return final


def other_tp_files(out_dir: Path, layer: int, tp: int) -> list[Path]:
    try:
        names = os.listdir(out_dir)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        parsed = fmt.parse_name(name)
        if parsed and parsed[0] == layer and parsed[2] != tp:
            found.append(out_dir / name)
    return found


def _final_state(path: Path, layer: int, rank: int, tp: int, expected: fmt.Header | None,
                 source: SourceRows | None, sample: int) -> LayerState:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return LayerState(layer, Status.ABSENT, path, f"{path.name} does not exist",
                          total_bytes=expected.rows * fmt.ROW_BYTES if expected else 0)
    try:
        size = os.fstat(fd).st_size
        try:
            found = fmt.decode_header(os.pread(fd, fmt.HEADER_BYTES, 0))
        except fmt.HeaderError as e:
            return LayerState(layer, Status.CORRUPT, path, f"{path.name}: {e}")
        rows = _rows(found)
        if found.layer != layer:
            return LayerState(layer, Status.CORRUPT, path,
                              f"{path.name}: header is for layer {found.layer}", **rows)
        want = expected or fmt.expected_header(layer, found.total_rows, rank, tp)
        total = want.rows * fmt.ROW_BYTES
        why = fmt.mismatch(found, want)
        if why:
            return LayerState(layer, Status.STALE, path, f"{path.name}: {why}", total_bytes=total, **rows)
        if size != found.file_bytes:
            return LayerState(layer, Status.CORRUPT, path,
                              f"{path.name}: size is {size} bytes, {found.describe()} needs "
                              f"{found.file_bytes}", total_bytes=total, **rows)
        if source is not None:
            bad = first_mismatch(fd, found, source, sample_rows(found.row_lo, found.row_hi, sample))
            if bad is not None:
                return LayerState(layer, Status.CORRUPT, path,
                                  f"{path.name}: row {bad} differs from the checkpoint",
                                  total_bytes=total, **rows)
        checked = "sampled rows match the checkpoint" if source else "header and size match"
        return LayerState(layer, Status.COMPLETE, path,
                          f"{path.name}: {found.describe()}, {checked}", total, total, **rows)
    finally:
        os.close(fd)


def _partial_state(path: Path, partial: Path, layer: int, rank: int, tp: int,
                   expected: fmt.Header | None, final: LayerState) -> LayerState:
    note = "" if final.status is Status.ABSENT else f" (replacing: {final.detail})"
    with open(partial, "rb") as f:
        buf = f.read(fmt.HEADER_BYTES)
    try:
        ph = fmt.decode_partial(buf)
    except fmt.HeaderError as e:
        return LayerState(layer, Status.PACKING, path,
                          f"{partial.name}: unreadable partial header ({e}); a pack restarts it "
                          f"from row 0{note}", total_bytes=final.total_bytes)
    total = ph.target.rows * fmt.ROW_BYTES
    want = expected or fmt.expected_header(layer, ph.target.total_rows, rank, tp)
    if ph.target != want:
        return LayerState(layer, Status.PACKING, path,
                          f"{partial.name}: partial pack of {ph.target.describe()} is not the "
                          f"range wanted; a pack restarts it from row 0{note}",
                          total_bytes=want.rows * fmt.ROW_BYTES, **_rows(want))
    done = ph.rows_done * fmt.ROW_BYTES
    return LayerState(layer, Status.PACKING, path,
                      f"{partial.name}: {ph.rows_done} of {ph.target.rows} rows of "
                      f"{ph.target.describe()} written{note}", done, total, **_rows(ph.target))
