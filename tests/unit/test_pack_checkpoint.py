"""A small real checkpoint (safetensors shards + index) with the Engram tables; the parser's tests.

``write_checkpoint`` is the fixture the other pack/engram tests import. It writes the files from
the safetensors layout directly (8-byte little-endian header length, JSON header padded with spaces
to a multiple of 8, data), independently of agent/pack/checkpoint.py.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest

from agent.pack.checkpoint import CheckpointError, SourceRows, engram_tables, read_header

pytestmark = pytest.mark.unit

# Odd row counts: 1001 and 2003 split unevenly at TP 3 and TP 4.
ROWS = {1: 1001, 14: 2003}


def weight_row(layer: int, row: int) -> bytes:
    return hashlib.shake_128(f"w{layer}:{row}".encode()).digest(256)


def scale_row(layer: int, row: int) -> bytes:
    return hashlib.shake_128(f"s{layer}:{row}".encode()).digest(8)


def packed_row(layer: int, row: int) -> bytes:
    return weight_row(layer, row) + scale_row(layer, row)


def write_safetensors(path: Path, tensors: list[tuple[str, str, list[int], bytes]]) -> None:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, _, _, data in tensors:
            f.write(data)


def write_checkpoint(model_dir: Path, rows: dict[int, int] = ROWS) -> Path:
    """Three shards: the layers apart, layer 1's scale and an unrelated tensor between its weight
    and scale, layer 14's weight and scale in different shards. Returns ``model_dir``."""
    model_dir.mkdir(parents=True, exist_ok=True)
    r1, r14 = rows[1], rows[14]

    def table(kind, layer, n):
        f = weight_row if kind == "w" else scale_row
        return b"".join(f(layer, i) for i in range(n))

    unrelated = ("layers.0.attn.wq_a.weight", "BF16", [3, 5], bytes(range(30)))
    shards = {
        "model-00001-of-00003.safetensors": [
            unrelated,
            ("layers.14.engram.embed.scale", "F8_E8M0", [r14, 8], table("s", 14, r14)),
        ],
        "model-00002-of-00003.safetensors": [
            ("layers.1.engram.embed.weight", "F8_E4M3", [r1, 256], table("w", 1, r1)),
            ("layers.1.engram.norm.weight", "BF16", [7], bytes(14)),
            ("layers.1.engram.embed.scale", "F8_E8M0", [r1, 8], table("s", 1, r1)),
        ],
        "model-00003-of-00003.safetensors": [
            ("layers.14.engram.embed.weight", "F8_E4M3", [r14, 256], table("w", 14, r14)),
        ],
    }
    weight_map = {}
    for shard, tensors in shards.items():
        write_safetensors(model_dir / shard, tensors)
        weight_map.update({t[0]: shard for t in tensors})
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return model_dir


def test_finds_both_tables_in_whichever_shards_hold_them(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "model")
    tables = engram_tables(model)
    assert {k: t.rows for k, t in tables.items()} == ROWS
    assert tables[14].weight.path.name != tables[14].scale.path.name
    with SourceRows(tables) as source:
        for layer, n in ROWS.items():
            for row in (0, 1, n // 2, n - 1):
                assert source.row(layer, row) == packed_row(layer, row)


def test_header_offsets_are_absolute(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "model")
    spans = read_header(model / "model-00002-of-00003.safetensors")
    raw = (model / "model-00002-of-00003.safetensors").read_bytes()
    scale = spans["layers.1.engram.embed.scale"]
    assert raw[scale.offset:scale.offset + 8] == scale_row(1, 0)
    assert scale.nbytes == ROWS[1] * 8


def test_wrong_dtype_is_refused_with_what_was_expected(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "model")
    write_safetensors(model / "model-00003-of-00003.safetensors", [
        ("layers.14.engram.embed.weight", "BF16", [ROWS[14], 128], bytes(ROWS[14] * 256))])
    with pytest.raises(CheckpointError, match=r"BF16.*expected F8_E4M3\[N, 256\]"):
        engram_tables(model)


def test_tensor_missing_from_listed_shard(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "model")
    write_safetensors(model / "model-00003-of-00003.safetensors", [])
    with pytest.raises(CheckpointError, match="does not hold it"):
        engram_tables(model, (14,))


def test_truncated_shard_is_refused(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "model")
    shard = model / "model-00003-of-00003.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="outside the file"):
        engram_tables(model, (14,))


def test_missing_index_names_the_option(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="--model must be a checkpoint directory"):
        engram_tables(tmp_path)
