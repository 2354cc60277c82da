"""Weight verification on the head (SKIP_VERIFY=0): the checkpoint against its own index.

The index lists every tensor and its shard; each shard's header must parse, hold the tensors the
index puts there, and fit inside the file; the shard count must be what the config expects. Each
shard's sha256 is recorded in a receipt keyed by (size, mtime, inode): a second run re-reads only
files that changed, so it is instant, and a file that changed under the same name is re-verified.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dsv41.atomicfile import replace_file
from dsv41.safetensors import CheckpointError, read_header, read_index

_SHARD = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")
_CHUNK = 8 << 20


@dataclass(frozen=True)
class Verification:
    ok: bool
    detail: str
    shards: int
    hashed_bytes: int  # bytes read for hashing in this run (0 when every receipt held)


def _receipts(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _save(path: Path, receipts: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(str(path), json.dumps(receipts, indent=1, sort_keys=True).encode(), 0o600)


def _sha256(path: Path, progress: Callable[[int], None]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            progress(len(chunk))
    return digest.hexdigest()


def verify(model_dir: str, expected_shards: int, receipts_path: str,
           progress: Callable[[int], None] = lambda n: None) -> Verification:
    root = Path(model_dir)
    try:
        weight_map = read_index(root)
    except CheckpointError as exc:
        return Verification(False, str(exc), 0, 0)
    if not (root / "config.json").is_file():
        return Verification(False, f"{root / 'config.json'}: missing", 0, 0)
    shards = sorted(set(weight_map.values()))
    bad_names = [s for s in shards if "/" in s or not _SHARD.fullmatch(s)]
    if bad_names:
        return Verification(False, f"index names unexpected shard files: {', '.join(bad_names[:3])}", len(shards), 0)
    if len(shards) != expected_shards:
        return Verification(False, f"index lists {len(shards)} shards, EXPECTED_SHARDS is {expected_shards}",
                            len(shards), 0)
    totals = {int(_SHARD.fullmatch(s).group(2)) for s in shards}
    if totals != {expected_shards}:
        return Verification(False, f"shard names say -of-{'/'.join(map(str, sorted(totals)))}, expected "
                                   f"-of-{expected_shards:05d}", len(shards), 0)
    receipts_file = Path(receipts_path)
    receipts = _receipts(receipts_file)
    by_shard: dict[str, list[str]] = {}
    for tensor, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(tensor)
    hashed = 0
    try:
        for shard in shards:
            path = root / shard
            try:
                st = path.stat()
            except FileNotFoundError:
                return Verification(False, f"{path}: missing (the index lists it)", len(shards), hashed)
            key = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}
            receipt = receipts.get(shard)
            if receipt and all(receipt.get(k) == v for k, v in key.items()):
                continue
            spans = read_header(path)
            missing = [t for t in by_shard[shard] if t not in spans]
            if missing:
                return Verification(False, f"{path}: does not hold {missing[0]} (and {len(missing) - 1} more) that "
                                           "the index puts there", len(shards), hashed)
            receipts[shard] = {**key, "sha256": _sha256(path, progress), "tensors": len(spans)}
            hashed += st.st_size
    except CheckpointError as exc:
        return Verification(False, str(exc), len(shards), hashed)
    finally:
        if hashed:
            _save(receipts_file, receipts)
    return Verification(True, f"{len(shards)} shards match the index" + (f" ({hashed / 2**30:.1f} GiB hashed)"
                                                                          if hashed else " (receipts)"),
                        len(shards), hashed)
