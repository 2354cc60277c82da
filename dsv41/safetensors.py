"""Safetensors checkpoints read without the safetensors package: headers and the shard index.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping tensor names to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the end of the header),
then the data. ``model.safetensors.index.json`` maps tensor names to shard files. Used by the pack
job (agent) and the weight verification (coordinator).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 2**20  # the format's own limit; anything larger is not a safetensors file
_DTYPE_BYTES = {"F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U8": 1, "I8": 1, "BOOL": 1,
                "F16": 2, "BF16": 2, "I16": 2, "U16": 2, "F32": 4, "I32": 4, "U32": 4,
                "F64": 8, "I64": 8, "U64": 8}


class CheckpointError(RuntimeError):
    """The checkpoint is not what it should be; the message names the file."""


@dataclass(frozen=True)
class TensorSpan:
    path: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the first element in the file
    nbytes: int


def read_header(path: Path) -> dict[str, TensorSpan]:
    """All tensors of one safetensors file, with their absolute offsets checked against its size."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path}: too short for a safetensors file")
        (length,) = struct.unpack("<Q", raw)
        if length > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: header length {length} is over {MAX_HEADER_BYTES}: "
                                  "not a safetensors file")
        text = f.read(length)
        size = os.fstat(f.fileno()).st_size
    if len(text) != length:
        raise CheckpointError(f"{path}: header is cut short ({len(text)} of {length} bytes)")
    try:
        header = json.loads(text)
    except ValueError as e:
        raise CheckpointError(f"{path}: header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    data_start = 8 + length
    spans = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = entry["dtype"], tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry") from None
        count = 1
        for d in shape:
            count *= d
        if dtype in _DTYPE_BYTES and end - begin != count * _DTYPE_BYTES[dtype]:
            raise CheckpointError(f"{path}: tensor {name!r} {dtype}{list(shape)} spans "
                                  f"{end - begin} bytes, expected {count * _DTYPE_BYTES[dtype]}")
        if not 0 <= begin <= end or data_start + end > size:
            raise CheckpointError(f"{path}: tensor {name!r} bytes [{begin}, {end}) lie outside "
                                  f"the file ({size - data_start} data bytes)")
        spans[name] = TensorSpan(path, name, dtype, shape, data_start + begin, end - begin)
    return spans


def read_index(model_dir: Path) -> dict[str, str]:
    path = model_dir / INDEX_NAME
    try:
        index = json.loads(path.read_text())
        weight_map = index["weight_map"]
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; --model must be a checkpoint directory") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: not a safetensors index ({e!r})") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{path}: weight_map is not an object")
    return weight_map
