"""The engram_offload adapter on SGLang's real Engram modules at TP 3 (checks/chk_engram_offload.py).

A small checkpoint in the real format (safetensors shards, the real tensor names and dtypes, odd row
counts) is packed by the real pack job for ranks 0..2 of TP 3; the check runs three ranks with
SGLang's parallel state, once with the adapter and once without (SGLang's own table loaded from the
checkpoint). Every lookup, reassembled by the TP all-reduce, must be the reference table's rows bit
for bit, whichever path served it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv41 import engram_format as fmt
from agent.pack.packer import PackJob, Packer
from dsv41.sdnotify import SdNotify
from tests.sglang.harness import Sglang, adapter_lines
from tests.unit.test_pack_checkpoint import write_checkpoint

pytestmark = pytest.mark.sglang

LAYERS = (1, 14)
TP = 3
FIX = "`dsv41ctl pack --start`"
# The hash moduli of each layer (3 n-gram sizes x 8 heads = 24 columns, as in the real model):
# primes, and one 2 per layer so that both tables have odd row counts (split unevenly at TP 3).
PRIMES = [p for p in range(41, 400) if all(p % d for d in range(2, int(p**0.5) + 1))]
MODULI = {"1": [2] + PRIMES[:23], "14": [2] + PRIMES[23:46]}
ROWS = {int(k): sum(v) for k, v in MODULI.items()}
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 4,
          "vocab_size": 1000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}
ARMED = {"OFFLOAD_MODE": "nvme", "DSV41_ENGRAM_PREFETCH": "1", "DSV41_ENGRAM_PREFETCH_CHECK": "1",
         "DSV41_IO_THREADS": "4", "DSV41_CACHE_GIB": "0.002", "DSV41_RESIDENT_SCALES": "1",
         "DSV41_STATS_SECONDS": "1"}


@pytest.fixture(scope="module")
def packed(sglang: Sglang) -> tuple[Path, Path]:
    root = sglang.root / "engram"
    model = write_checkpoint(root / "model", ROWS)
    (model / "config.json").write_text(json.dumps(CONFIG))
    out = root / "packed"
    for rank in range(TP):
        Packer(PackJob(model_dir=model, out_dir=out, rank=rank, tp=TP), SdNotify(None), log=lambda _line: None).run()
    (root / "layout.json").write_text(json.dumps(MODULI))
    return model, out


def run(sglang: Sglang, packed: tuple[Path, Path], name: str, env: dict[str, str] | None) -> tuple[dict, str, Path]:
    model, out = packed
    if env is not None:
        # A fresh build directory: the three ranks build the native reader at their first finish_load.
        env = {"TORCH_EXTENSIONS_DIR": str(sglang.root / "engram" / f"{name}-extensions"), **env,
               "DSV41_PACKED_DIR": str(out)}
    results = sglang.root / "engram" / name
    result, err = sglang.check("chk_engram_offload", str(model), str(out), str(results),
                               str(sglang.root / "engram" / "layout.json"), armed=env is not None, env=env,
                               timeout=600)
    return result, err, results


@pytest.fixture(scope="module")
def plain(sglang: Sglang, packed) -> tuple[dict, str, Path]:
    return run(sglang, packed, "plain", None)


@pytest.fixture(scope="module")
def armed(sglang: Sglang, packed) -> tuple[dict, str, Path]:
    return run(sglang, packed, "armed", ARMED)


@pytest.fixture(scope="module")
def fallback(sglang: Sglang, packed) -> tuple[dict, str, Path]:
    """Armed, where the native reader cannot be built (no compiler): the Python path serves."""
    return run(sglang, packed, "fallback", {**ARMED, "CXX": str(sglang.root / "no-such-compiler")})


def blob(results: Path, rank: int, name: str) -> bytes:
    return (results / str(rank) / f"{name}.bin").read_bytes()


def lookups(results: Path) -> list[str]:
    names = sorted(p.stem for p in (results / "0").glob("*.bin"))
    return [n for n in names if not n.endswith(("_ids", "_hash")) and not n.startswith("reference")]


def test_the_checkpoint_is_real_format_with_odd_tables(plain) -> None:
    result, _, _ = plain
    assert all(n % 2 == 1 for n in ROWS.values()) and result["layout_rows"] == [ROWS[1], ROWS[14]]
    assert result["ranks"][0]["checkpoint_dtypes"] == {
        f"layers.{layer}.engram.embed.{part}": dtype
        for layer in LAYERS for part, dtype in (("weight", "torch.float8_e4m3fn"), ("scale", "torch.float8_e8m0fnu"))}


@pytest.mark.parametrize("served", ["armed", "fallback"])
def test_every_lookup_is_the_reference_table_bit_for_bit(served, request, plain) -> None:
    _, _, a = request.getfixturevalue(served)
    _, _, p = plain
    names = lookups(a)
    assert {"table_l1", "table_l14", "verify0_l1", "verify1_l14_sync", "extend1_l14"} <= set(names)
    assert names == lookups(p)
    # The ids (and the device-side hashes) are the same in both runs, so the rows must be too.
    for name in sorted(set(x.stem for x in (p / "0").glob("*_ids.bin")) | set(x.stem for x in (p / "0").glob("*_hash.bin"))):
        assert blob(a, 0, name) == blob(p, 0, name), name
    for name in names:
        want = blob(p, 0, name)
        for rank in range(TP):  # reassembled on every rank by the all-reduce
            assert blob(a, rank, name) == want, (name, rank)
            assert blob(p, rank, name) == want, (name, rank)


def reduced_bf16(got: bytes, want: bytes) -> bool:
    """``got`` is ``want`` after the TP all-reduce, which adds the other ranks' +0.0 to the owner's
    value (in SGLang's own path as in ours): bit for bit, except that -0.0 comes out +0.0 and any
    NaN comes out a quiet NaN. The fixture's random bytes hold both."""
    import array

    a, b = array.array("H", got), array.array("H", want)

    def nan(x: int) -> bool:
        return (x & 0x7F80) == 0x7F80 and (x & 0x7F) != 0

    return len(a) == len(b) and all(x == y or (nan(x) and nan(y)) or (y, x) == (0x8000, 0) for x, y in zip(a, b))


def test_every_row_matches_the_dequantised_checkpoint(armed) -> None:
    import array

    _, _, a = armed
    reduced = 0
    for layer in LAYERS:
        ids = array.array("q", blob(a, 0, f"table_l{layer}_ids"))
        ref = blob(a, 0, f"reference_l{layer}")
        got = blob(a, 0, f"table_l{layer}")
        row = 512  # 256 bfloat16
        assert len(got) == len(ids) * row and len(ref) == ROWS[layer] * row
        assert set(ids) == set(range(ROWS[layer]))
        for k, i in enumerate(ids):
            mine, theirs = got[k * row:(k + 1) * row], ref[i * row:(i + 1) * row]
            assert mine == theirs or reduced_bf16(mine, theirs), (layer, i)
            reduced += mine != theirs
    assert reduced  # the comparison did meet the fixture's NaNs and negative zeros


@pytest.mark.parametrize("served", ["armed", "fallback"])
def test_the_prefetched_and_staged_paths_were_taken_and_agree(served, request) -> None:
    result, err, a = request.getfixturevalue(served)
    for r in result["ranks"]:
        # 2 verify batches x 2 layers prefetched after the hasher, 2 extend batches x 2 layers staged.
        assert r["counters"]["prefetched"] == 4 and r["counters"]["staged"] == 4, r["counters"]
        assert r["counters"]["checked_rows"] == 2 * 2 * 24 * 24 + (500 + 768) * 24 * 2
        assert r["counters"]["mismatched_rows"] == 0
        assert r["stager"] == "PackedStager"
    for step in range(2):
        for layer in LAYERS:
            assert blob(a, 0, f"verify{step}_l{layer}") == blob(a, 0, f"verify{step}_l{layer}_sync")
    assert not [line for line in adapter_lines(err) if "prefetch check" in line]


def test_no_table_is_allocated_and_the_loader_skips_the_tables(armed, plain) -> None:
    a, _, _ = armed
    p, _, _ = plain
    for r in a["ranks"]:
        assert r["parameters"] == [[], []]
        assert r["loader_dropped"] == sorted(f"layers.{layer}.engram.embed.{part}" for layer in LAYERS
                                             for part in ("scale", "weight"))
        assert "layers.1.engram.norm.weight" in r["loader_kept"] and not [n for n in r["loader_kept"] if ".embed." in n]
    assert all(r["parameters"] == [["scale", "weight"], ["scale", "weight"]] for r in p["ranks"])
    big = a["ranks"][0]["real_size"]
    # 384,016,682 rows x 264 bytes would be 94 GiB; the module exists without them.
    assert big["parameters"] == [] and big["rows"] == 384_016_682 // 3 and big["vm_growth_kib"] < 64 * 1024


def test_rows_owned_follow_the_packs_not_sglangs_column_split(armed, plain) -> None:
    a, _, _ = armed
    p, _, _ = plain
    for rank in range(TP):
        floor = [list(fmt.row_range(ROWS[layer], rank, TP)) for layer in LAYERS]
        assert [[lo, lo + n] for lo, n in a["ranks"][rank]["shard"]] == floor
        # SGLang's own shard_range splits these 24 columns 8 per rank: another partition.
        assert a["ranks"][rank]["shard_before_load"] == p["ranks"][rank]["shard"]
    assert [r["shard"] for r in a["ranks"]] != [r["shard"] for r in p["ranks"]]


def test_a_missing_foreign_or_stale_pack_refuses_every_rank_with_the_fix(armed) -> None:
    result, _, _ = armed
    for r in result["ranks"]:
        missing, foreign, stale = (r["refusals"][k] for k in ("missing", "foreign", "stale"))
        assert missing.startswith("dsv41-adapter: engram_offload: the packed Engram shards cannot serve layer 14 at tp 3: "
                                  "rank 1: ") and "engram-l14-r1of3.bin: no packed Engram shard" in missing
        assert foreign.count("rank 2: ") == 1 and "engram-l1-r2of3.bin: header holds rows [0, " in foreign
        assert "(rank 0 of tp 3), this rank needs" in foreign
        assert f"header is for a table of {ROWS[1]} rows, the checkpoint has {ROWS[1] + 3}" in stale
        assert all(stale.count(f"rank {k}: ") == 1 for k in range(TP))
        for text in (missing, foreign, stale):
            assert text.endswith(f"; re-pack with {FIX}; the rank does not start") and text.count(FIX) == 1


def test_installed_once_with_its_patches_and_one_statistics_line_per_rank(armed) -> None:
    result, err, _ = armed
    lines = adapter_lines(err)
    installed = [line for line in lines if " installed (" in line and "engram_offload" in line]
    assert len(installed) == TP, installed  # one per rank process
    assert "tables from " in installed[0] and "prefetch on (checked)" in installed[0]
    for r in result["ranks"]:
        assert set(r["marked"].values()) == {"engram_offload"} and r["marked_stager"] == "engram_offload"
    assert result["ranks"][0]["marked_load_weights"] == "engram_offload"
    for rank in range(TP):
        opened = [line for line in lines if f"engram_offload: rank {rank}/3 layer " in line]
        assert len(opened) == 2 and all(" of " in line and ".bin" in line for line in opened), opened
        stats = [line for line in lines if line.startswith(f"dsv41-adapter: engram_offload: rank {rank}/3: ")]
        assert stats and all(" lookups/s, " in line and " rows/s over " in line and "row read p50 " in line
                             and "layer 1 " in line and "layer 14 " in line for line in stats), stats


def test_the_native_reader_is_built_in_the_rank_and_reads_every_layer(armed) -> None:
    result, err, _ = armed
    lines = adapter_lines(err)
    ready = [line for line in lines if line.startswith("dsv41-adapter: engram_offload: native Engram row reader ready in ")]
    assert len(ready) == TP and all("/armed-extensions/dsv41_engram_reader-" in line for line in ready), ready
    for rank in range(TP):
        opened = [line for line in lines if f"engram_offload: rank {rank}/3 layer " in line]
        assert len(opened) == 2 and all("(native reader, 4 threads)" in line for line in opened), opened
    assert all(r["readers"] == ["native", "native"] for r in result["ranks"])
    # Its reads need no GIL: the interpreter's switch interval is left alone.
    assert not [line for line in lines if "switch interval" in line]


def test_without_a_compiler_every_rank_says_so_once_and_reads_through_python(fallback) -> None:
    result, err, _ = fallback
    lines = adapter_lines(err)
    unavailable = [line for line in lines if "native Engram row reader unavailable (" in line]
    assert len(unavailable) == TP, unavailable  # once per rank process, not once per layer
    assert all(line.endswith("); rows are read by the Python path, which needs the GIL") for line in unavailable)
    assert not [line for line in lines if "native Engram row reader ready" in line]
    for rank in range(TP):
        opened = [line for line in lines if f"engram_offload: rank {rank}/3 layer " in line]
        assert len(opened) == 2 and all("(Python path, 4 threads)" in line for line in opened), opened
    assert all(r["readers"] == ["python", "python"] for r in result["ranks"])
