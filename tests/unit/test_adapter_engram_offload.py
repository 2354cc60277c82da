"""engram_offload's pure parts: its settings, the refusal decision, the loader filter, the cache share.
The hooks themselves run on SGLang's real modules in tests/sglang/test_engram_offload.py."""

from __future__ import annotations

import io

import pytest

from adapter import engram_offload as eo
from adapter.engram.settings import StoreSettings
from adapter.patching import ON_IMPORT, Refused
from dsv41 import engram_format as fmt
from dsv41.adapterlog import AdapterLog
from dsv41.ranksettings import SettingError

pytestmark = pytest.mark.unit


def test_off_unless_offload_mode_is_nvme() -> None:
    assert eo.settings_from_env({}) is None
    assert eo.settings_from_env({"OFFLOAD_MODE": "host", "DSV41_IO_THREADS": "bad"}) is None
    assert eo.build({"OFFLOAD_MODE": "host"}, AdapterLog(io.StringIO())) is None


def test_settings_from_the_rank_environment() -> None:
    s = eo.settings_from_env({"OFFLOAD_MODE": "NVMe", "DSV41_PACKED_DIR": "/srv/engram", "DSV41_ENGRAM_PREFETCH": "1",
                              "DSV41_IO_THREADS": "96", "DSV41_CACHE_GIB": "1.5", "DSV41_RESIDENT_SCALES": "1"})
    assert s == eo.OffloadSettings("/srv/engram", True, False,
                                   StoreSettings(io_threads=96, cache_gib=1.5, resident_scales=True))
    assert eo.settings_from_env({"OFFLOAD_MODE": "nvme"}).packed_dir == "/engram"


@pytest.mark.parametrize("env, message", [
    ({"OFFLOAD_MODE": "disk"}, "OFFLOAD_MODE='disk': expected one of nvme, host"),
    ({"DSV41_PACKED_DIR": "engram"}, "DSV41_PACKED_DIR='engram': expected an absolute path"),
    ({"DSV41_ENGRAM_PREFETCH": "maybe"}, "DSV41_ENGRAM_PREFETCH='maybe': expected 1 or 0"),
    ({"DSV41_IO_THREADS": "0"}, r"DSV41_IO_THREADS=0: outside the allowed range \[1, 1024\]"),
    ({"SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE": "1"}, "SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE=1 makes SGLang hold"),
    ({"SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS": "true"}, "unset SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS"),
])
def test_bad_settings_are_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingError, match=message):
        eo.settings_from_env({"OFFLOAD_MODE": "nvme", **env})


def test_a_bad_setting_refuses_where_sglang_would_build_the_tables() -> None:
    # Staying out would let SGLang allocate ~63 GiB per rank: the spec stops the process instead.
    spec = eo.build({"OFFLOAD_MODE": "nvme", "DSV41_CACHE_WAYS": "99"}, AdapterLog(io.StringIO()))
    assert spec.fail_closed and [(p.module, p.kind) for p in spec.patches] == [(eo.ENGRAM_MODULE, ON_IMPORT)]
    with pytest.raises(Refused, match=r"engram_offload: DSV41_CACHE_WAYS=99: outside the allowed range \[1, 16\]; the rank does not start"):
        spec.patches[0].hook(object())


def test_the_spec_is_fail_closed_and_prefetch_adds_its_hooks() -> None:
    base = eo.build({"OFFLOAD_MODE": "nvme"}, AdapterLog(io.StringIO()))
    prefetch = eo.build({"OFFLOAD_MODE": "nvme", "DSV41_ENGRAM_PREFETCH": "1"}, AdapterLog(io.StringIO()))
    assert base.fail_closed and prefetch.fail_closed
    targets = {p.target for p in base.patches}
    assert targets == {f"{eo.ENGRAM_MODULE}.{a}" for a in ("EngramEmbedding.__init__", "EngramEmbedding.finish_load",
                                                          "EngramEmbedding._owned_rows", "Engram.__init__",
                                                          "Engram.embed_rows")} | {
        f"{eo.MODEL_MODULE}.DeepseekV4ForCausalLM.load_weights"}
    assert {p.target for p in prefetch.patches} - targets == {f"{eo.ENGRAM_MODULE}.EngramHasher.forward",
                                                             f"{eo.STAGING_MODULE}.EngramRowStager.from_model"}
    assert "prefetch off" in base.detail and "prefetch on" in prefetch.detail


def test_the_loader_filter_drops_exactly_the_tables() -> None:
    names = ["layers.0.attn.wq_a.weight", "layers.1.engram.embed.weight", "layers.1.engram.norm.weight",
             "layers.1.engram.embed.scale", "layers.1.engram.wkv.scale", "model.layers.14.engram.embed.weight"]
    dropped: list[str] = []
    kept = [n for n, _ in eo.drop_engram_tables(((n, None) for n in names), dropped)]
    assert kept == ["layers.0.attn.wq_a.weight", "layers.1.engram.norm.weight", "layers.1.engram.wkv.scale"]
    assert dropped == ["layers.1.engram.embed.weight", "layers.1.engram.embed.scale",
                       "model.layers.14.engram.embed.weight"]


def test_the_cache_budget_is_per_host() -> None:
    s = eo.store_settings_per_table(StoreSettings(cache_gib=6.0, stats_seconds=60), layers=2, ranks_per_host=3)
    assert (s.cache_gib, s.stats_seconds) == (1.0, 0)
    assert eo.store_settings_per_table(StoreSettings(cache_gib=0.0), 2, 1).cache_bytes == 0


def floor(n: int, tp: int, problem: str | None = None, bad: int = -1) -> list[eo.Found]:
    return [eo.Found(r, problem if r == bad else None, *fmt.row_range(n, r, tp), n) for r in range(tp)]


def test_ranks_that_partition_the_table_may_start() -> None:
    assert eo.refusal(1, 3, floor(1001, 3)) is None
    # Any partition the ranks agree on is exact, SGLang's column split included.
    assert eo.refusal(1, 3, [eo.Found(0, None, 0, 300, 1001), eo.Found(1, None, 300, 800, 1001),
                             eo.Found(2, None, 800, 1001, 1001)]) is None


def test_one_ranks_problem_refuses_every_rank_naming_it_and_the_fix_once() -> None:
    why = eo.refusal(14, 3, floor(2003, 3, f"/engram/engram-l14-r1of3.bin: no packed Engram shard; {fmt.REPACK_HINT}", 1))
    assert why == ("engram_offload: the packed Engram shards cannot serve layer 14 at tp 3: rank 1: "
                   "/engram/engram-l14-r1of3.bin: no packed Engram shard; re-pack with `dsv41ctl pack --start`")


def test_ranges_that_do_not_partition_are_refused() -> None:
    gap = [eo.Found(0, None, 0, 333, 1001), eo.Found(1, None, 334, 667, 1001), eo.Found(2, None, 667, 1001, 1001)]
    assert "rows [333, 334) are owned by no rank (next to rank 0 [0, 333) and rank 1 [334, 667))" in eo.refusal(1, 3, gap)
    twice = [eo.Found(0, None, 0, 334, 1001), eo.Found(1, None, 333, 667, 1001), eo.Found(2, None, 667, 1001, 1001)]
    assert "rows [333, 334) are owned twice, by rank 0 [0, 334) and rank 1 [333, 667)" in eo.refusal(1, 3, twice)
    sizes = [eo.Found(0, None, 0, 500, 1000), eo.Found(1, None, 500, 1001, 1001)]
    assert "tables of different sizes: rank 0 1000 rows, rank 1 1001 rows" in eo.refusal(1, 2, sizes)
