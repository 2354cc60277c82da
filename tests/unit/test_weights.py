import json
import os

import pytest

from coordinator import weights
from tests.unit.test_pack_checkpoint import write_safetensors

pytestmark = pytest.mark.unit


def checkpoint(root, shards=3):
    root.mkdir()
    weight_map = {}
    for i in range(1, shards + 1):
        name = f"model-{i:05d}-of-{shards:05d}.safetensors"
        tensors = [(f"layers.{i}.w", "BF16", [4, 8], bytes(64)), (f"layers.{i}.b", "F32", [8], bytes(32))]
        write_safetensors(root / name, tensors)
        weight_map.update({t[0]: name for t in tensors})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (root / "config.json").write_text("{}")
    return root


def test_a_good_checkpoint_verifies_and_the_second_run_reads_nothing(tmp_path):
    model = checkpoint(tmp_path / "m")
    receipts = tmp_path / "state" / "weights.json"
    first = weights.verify(str(model), 3, str(receipts))
    assert first.ok and first.shards == 3 and first.hashed_bytes > 0
    stored = json.loads(receipts.read_text())
    assert set(stored) == {f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)}
    assert all(len(r["sha256"]) == 64 for r in stored.values())
    second = weights.verify(str(model), 3, str(receipts))
    assert second.ok and second.hashed_bytes == 0 and "receipts" in second.detail


def test_a_changed_shard_is_verified_again(tmp_path):
    model = checkpoint(tmp_path / "m")
    receipts = tmp_path / "weights.json"
    weights.verify(str(model), 3, str(receipts))
    shard = model / "model-00002-of-00003.safetensors"
    data = bytearray(shard.read_bytes())
    shard.write_bytes(bytes(data[:-10]))  # truncated: the header now points past the end
    result = weights.verify(str(model), 3, str(receipts))
    assert not result.ok and "model-00002-of-00003.safetensors" in result.detail


@pytest.mark.parametrize("damage, fragment", [
    (lambda m: os.unlink(m / "model-00003-of-00003.safetensors"), "missing (the index lists it)"),
    (lambda m: os.unlink(m / "config.json"), "config.json: missing"),
    (lambda m: os.unlink(m / "model.safetensors.index.json"), "model.safetensors.index.json: missing"),
    (lambda m: write_safetensors(m / "model-00001-of-00003.safetensors", [("other", "F32", [1], bytes(4))]),
     "does not hold layers.1"),
])
def test_damage_is_named(tmp_path, damage, fragment):
    model = checkpoint(tmp_path / "m")
    damage(model)
    result = weights.verify(str(model), 3, str(tmp_path / "r.json"))
    assert not result.ok and fragment in result.detail, result.detail


def test_shard_count_must_match_the_config(tmp_path):
    model = checkpoint(tmp_path / "m", shards=2)
    result = weights.verify(str(model), 48, str(tmp_path / "r.json"))
    assert not result.ok and "EXPECTED_SHARDS is 48" in result.detail
