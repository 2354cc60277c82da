"""Where the Engram tables sit in a safetensors checkpoint (headers parsed by dsv41.safetensors,
no safetensors package)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dsv41 import engram_format as fmt
from dsv41.safetensors import INDEX_NAME, CheckpointError, TensorSpan, read_header, read_index  # noqa: F401


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
