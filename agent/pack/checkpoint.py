"""Where the Engram tables sit in a safetensors checkpoint (headers parsed here, no safetensors
package).

A safetensors file is an 8-byte little-endian header length, a JSON header mapping tensor names to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the end of the header),
then the data. ``model.safetensors.index.json`` maps tensor names to shard files.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from adapter.engram import format as fmt

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 2**20  # the format's own limit; anything larger is not a safetensors file
_DTYPE_BYTES = {"F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U8": 1, "I8": 1, "BOOL": 1,
                "F16": 2, "BF16": 2, "I16": 2, "U16": 2, "F32": 4, "I32": 4, "U32": 4,
                "F64": 8, "I64": 8, "U64": 8}


class CheckpointError(RuntimeError):
    """The checkpoint does not hold the Engram tables the way they are expected."""


@dataclass(frozen=True)
class TensorSpan:
    path: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the first element in the file
    nbytes: int


@dataclass(frozen=True)
class EngramTable:
    """One layer's table: weight rows [N, 256] F8_E4M3 and scale rows [N, 8] F8_E8M0."""

    layer: int
    rows: int
    weight: TensorSpan
    scale: TensorSpan

    def weight_offset(self, row: int) -> int:
        return self.weight.offset + row * fmt.WEIGHT_BYTES

    def scale_offset(self, row: int) -> int:
        return self.scale.offset + row * fmt.SCALE_BYTES


def tensor_names(layer: int) -> tuple[str, str]:
    fmt.check_layer(layer)
    prefix = f"layers.{layer}.engram.embed."
    return prefix + "weight", prefix + "scale"


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


def _span(model_dir: Path, weight_map: dict[str, str], name: str,
          headers: dict[str, dict[str, TensorSpan]]) -> TensorSpan:
    shard = weight_map.get(name)
    if not isinstance(shard, str) or "/" in shard:
        raise CheckpointError(f"{model_dir / INDEX_NAME}: no shard listed for {name}")
    if shard not in headers:
        headers[shard] = read_header(model_dir / shard)
    span = headers[shard].get(name)
    if span is None:
        raise CheckpointError(f"{model_dir / shard}: the index lists {name} here but the file "
                              "does not hold it")
    return span


def engram_tables(model_dir: str | Path, layers: tuple[int, ...] = fmt.LAYERS
                  ) -> dict[int, EngramTable]:
    """Locate and check each layer's weight and scale tensors, in whichever shards hold them."""
    model_dir = Path(model_dir)
    weight_map = read_index(model_dir)
    headers: dict[str, dict[str, TensorSpan]] = {}
    tables = {}
    for layer in layers:
        wname, sname = tensor_names(layer)
        weight = _span(model_dir, weight_map, wname, headers)
        scale = _span(model_dir, weight_map, sname, headers)
        for span, dtype, width in ((weight, "F8_E4M3", fmt.WEIGHT_BYTES),
                                   (scale, "F8_E8M0", fmt.SCALE_BYTES)):
            if span.dtype != dtype or len(span.shape) != 2 or span.shape[1] != width:
                raise CheckpointError(f"{span.path}: {span.name} is {span.dtype}"
                                      f"{list(span.shape)}, expected {dtype}[N, {width}]")
        if weight.shape[0] != scale.shape[0]:
            raise CheckpointError(f"layer {layer}: {wname} has {weight.shape[0]} rows but {sname} "
                                  f"has {scale.shape[0]}")
        tables[layer] = EngramTable(layer, weight.shape[0], weight, scale)
    return tables


class SourceRows:
    """Reads single rows of the source tables, as the 264 packed bytes (verification samples)."""

    def __init__(self, tables: dict[int, EngramTable]) -> None:
        self.tables = tables
        self._fds: dict[Path, int] = {}

    def _fd(self, path: Path) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        return self._fds[path]

    def row(self, layer: int, row: int) -> bytes:
        t = self.tables[layer]
        w = os.pread(self._fd(t.weight.path), fmt.WEIGHT_BYTES, t.weight_offset(row))
        s = os.pread(self._fd(t.scale.path), fmt.SCALE_BYTES, t.scale_offset(row))
        if len(w) != fmt.WEIGHT_BYTES or len(s) != fmt.SCALE_BYTES:
            raise CheckpointError(f"layer {layer}: short read of source row {row}")
        return w + s

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> SourceRows:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
