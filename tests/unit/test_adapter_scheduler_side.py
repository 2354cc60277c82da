"""Scheduler-side adapters without SGLang: the empty-cache decision and the autotune cache keeper."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from adapter import autotune_keep, prefill_empty_cache
from adapter.autotune_keep import AutotuneCacheKeeper, launch_args, launch_fingerprint
from adapter.prefill_empty_cache import PrefillEmptyCache, should_empty_cache
from dsv41.adapterlog import AdapterLog
from dsv41.autotune_cache import clear_autotune_caches, default_cache_root

pytestmark = pytest.mark.unit


class Mode:
    def __init__(self, extend: bool) -> None:
        self.extend = extend

    def is_extend(self) -> bool:
        return self.extend


def batch(extend: bool, *prompt_lengths: int) -> SimpleNamespace:
    return SimpleNamespace(forward_mode=Mode(extend), reqs=[SimpleNamespace(origin_input_ids=[0] * n) for n in prompt_lengths])


def test_should_empty_cache() -> None:
    assert should_empty_cache(True, [100, 9000], 8192)
    assert should_empty_cache(True, [8192], 8192)
    assert not should_empty_cache(True, [8191, 20], 8192)
    assert not should_empty_cache(False, [100_000], 8192)  # decode steps never pay for it
    assert not should_empty_cache(True, [100_000], 0)


def test_empty_cache_runs_before_each_long_prefill_chunk_and_once_after_the_last() -> None:
    calls = []
    hook = PrefillEmptyCache(8192, lambda: calls.append(1))
    for _ in range(3):  # three chunks of one long prompt: the chunk before's buffers, each time
        hook.before_batch(object(), batch(True, 200_000))
    assert len(calls) == 3
    hook.before_batch(object(), batch(False, 200_000))  # its first decode step: the last chunk's
    assert len(calls) == 4
    hook.before_batch(object(), batch(False, 200_000))  # decode steps never pay for it
    hook.before_batch(object(), batch(True, 500, 600))  # nor short prompts
    hook.before_batch(object(), batch(True, 500, 600))
    assert len(calls) == 4 == hook.calls


def test_the_hook_is_on_run_batch_before_the_launch() -> None:
    spec = prefill_empty_cache.build({})
    (patch,) = spec.patches
    assert (patch.module, patch.attr, patch.kind, patch.params) == (
        "sglang.srt.managers.scheduler", "Scheduler.run_batch", prefill_empty_cache.BEFORE, ("self", "batch"))


def test_prefill_setting() -> None:
    assert prefill_empty_cache.build({"DSV41_PREFILL_EMPTY_CACHE_TOKENS": "0"}) is None
    assert prefill_empty_cache.build({}).state.threshold == 8192


ARGV = [
    "/usr/bin/python3", "-m", "sglang.launch_server", "--model-path", "/m", "--tp-size", "3",
    "--dist-init-addr", "10.0.0.1:20000", "--port=8888", "--chunked-prefill-size", "768", "--api-key", "k1",
]
ENV = {"SGLANG_FLASHINFER_MOE_FUSED_FINALIZE": "0", "DSV41_MXFP8_BACKEND": "b12x", "HOME": "/root", "NCCL_DEBUG": "WARN"}


def test_fingerprint_ignores_per_boot_values() -> None:
    base = launch_fingerprint(ARGV, ENV)
    other_boot = [a.replace("10.0.0.1:20000", "10.9.9.9:31000").replace("--port=8888", "--port=9999").replace("k1", "k2") for a in ARGV]
    assert launch_fingerprint(other_boot, {**ENV, "INVOCATION_ID": "abc", "NCCL_DEBUG": "INFO", "HOME": "/x"}) == base
    assert launch_args(ARGV) == ["-m", "sglang.launch_server", "--model-path", "/m", "--tp-size", "3", "--chunked-prefill-size", "768"]


@pytest.mark.parametrize(
    "argv, env",
    [
        ([a.replace("768", "1024") for a in ARGV], ENV),
        (ARGV, {**ENV, "SGLANG_FLASHINFER_MOE_FUSED_FINALIZE": "1"}),
        (ARGV, {**ENV, "DSV41_MXFP8_BACKEND": "cudnn"}),
        (ARGV, {**ENV, "FLASHINFER_AUTOTUNER_LOAD_FROM_FILE": "1"}),
        (ARGV + ["--sleep-on-idle"], ENV),
    ],
)
def test_fingerprint_follows_what_changes_kernels(argv, env) -> None:
    assert launch_fingerprint(argv, env) != launch_fingerprint(ARGV, ENV)


def cache_file(root: Path, rank: int = 0) -> Path:
    d = root / "flashinfer" / "autotune" / "0.7.2" / "sm121" / "0123456789abcdef"
    d.mkdir(parents=True, exist_ok=True)
    f = d / f"rank_tp{rank}_pp0_dp0.json"
    f.write_text(json.dumps({"tactics": rank}))
    return f


def test_keeper_keeps_the_same_launch_and_discards_another(tmp_path: Path) -> None:
    buf = io.StringIO()
    f = cache_file(tmp_path)
    first = AutotuneCacheKeeper(lambda: ARGV, lambda: ENV, AdapterLog(buf))
    assert first.reconcile(f) == "discarded"  # a cache without a launch record is not trusted
    assert not f.exists() and f.with_suffix(".launch").is_file()
    f.write_text("{}")  # this boot's tuning result
    again = AutotuneCacheKeeper(lambda: [a.replace("20000", "20001") for a in ARGV], lambda: ENV)
    assert again.reconcile(f) == "kept" and f.read_text() == "{}"
    changed = AutotuneCacheKeeper(lambda: ARGV, lambda: {**ENV, "DSV41_MXFP8_BACKEND": "cudnn"}, AdapterLog(buf))
    assert changed.reconcile(f) == "discarded" and not f.exists()
    assert changed.reconcile(f) == "kept"  # the record now names this launch
    record = json.loads(f.with_suffix(".launch").read_text())
    assert record["fingerprint"] == changed.fingerprint and "k1" not in json.dumps(record)
    assert buf.getvalue().count("launch changed, discarded") == 2


def test_keeper_without_cache_writes_the_record(tmp_path: Path) -> None:
    f = tmp_path / "a" / "rank_tp1_pp0_dp0.json"
    keeper = AutotuneCacheKeeper(lambda: ARGV, lambda: ENV)
    assert keeper.reconcile(f) == "new"
    assert keeper.after_cache_path(f, object()) is None and f.with_suffix(".launch").is_file()


def test_clear_removes_every_rank_cache_and_record(tmp_path: Path) -> None:
    files = [cache_file(tmp_path, r) for r in range(3)]
    for f in files:
        f.with_suffix(".launch").write_text("{}")
    other = tmp_path / "flashinfer" / "autotune" / "0.7.2" / "sm121" / "0123456789abcdef" / "notes.txt"
    other.write_text("keep")
    removed = clear_autotune_caches(tmp_path)
    assert sorted(removed) == sorted(files + [f.with_suffix(".launch") for f in files])
    assert other.exists() and not any(f.exists() for f in files)
    assert clear_autotune_caches(tmp_path) == []
    assert clear_autotune_caches(tmp_path / "missing") == []


def test_cache_root() -> None:
    assert default_cache_root({"SGLANG_CACHE_DIR": "/srv/c"}) == Path("/srv/c")
    assert default_cache_root({}, home="/home/u") == Path("/home/u/.cache/sglang")


def test_autotune_setting() -> None:
    assert autotune_keep.build({"DSV41_AUTOTUNE_KEEP": "0"}) is None
    assert autotune_keep.build({}, argv=lambda: ARGV).patches[0].attr == "flashinfer_autotune_cache_path"


def test_bench_dry_run_replays_the_pattern_on_the_cpu() -> None:
    import subprocess
    import sys

    bench = Path(__file__).resolve().parents[2] / "bench" / "prefill_empty_cache"
    out = subprocess.run([sys.executable, str(bench), "--dry-run"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout.strip().splitlines()[-1])["results"]
    assert [r["prompt"] for r in results] == [4096, 16384]
    for r in results:
        assert r["with"]["peak_reserved"] < r["without"]["peak_reserved"]
        assert r["with"]["empty_cache_calls"] == r["with"]["chunks"] and r["without"]["empty_cache_calls"] == 0
    # Without the hook the pool grows with the prompt; with it, it stays near one chunk's worth.
    assert results[1]["without"]["peak_reserved"] > 4 * results[0]["without"]["peak_reserved"]
    assert results[1]["peak_ratio"] > results[0]["peak_ratio"] > 1.5
