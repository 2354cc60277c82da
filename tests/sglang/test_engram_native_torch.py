"""The native Engram reader built as the rank builds it (torch's cpp_extension, in the cached venv's
torch) and used through PackedTable (checks/chk_engram_native.py), on packs of the real pack job:
the build is done once and cached, survives a dead build's lock file, and falls back with one line
when it cannot compile; every lookup, prefetch and staged batch equals the Python path's bit for
bit and the packed rows dequantised. The CUDA part runs where there is a GPU (bench/engram_lookup
measures it there)."""

from __future__ import annotations

import json
import re

import pytest

from agent.pack.packer import PackJob, Packer
from dsv41.sdnotify import SdNotify
from tests.sglang.harness import Sglang
from tests.unit.test_pack_checkpoint import write_checkpoint

pytestmark = pytest.mark.sglang

ROWS = {1: 4001, 14: 3003}
TP = 3


@pytest.fixture(scope="module")
def facts(sglang: Sglang) -> dict:
    root = sglang.root / "engram-native"
    model = write_checkpoint(root / "model", ROWS)
    packed = root / "packed"
    for rank in range(TP):
        Packer(PackJob(model_dir=model, out_dir=packed, rank=rank, tp=TP), SdNotify(None), log=lambda _line: None).run()
    layout = root / "layout.json"
    layout.write_text(json.dumps({str(k): [v] for k, v in ROWS.items()}))
    scratch = root / "scratch"
    scratch.mkdir()
    result, _ = sglang.check("chk_engram_native", str(packed), str(scratch), str(layout), armed=False, timeout=900)
    return result


READY = re.compile(r"native Engram row reader ready in [0-9.]+ s \((.+\.so)\); rows are read without the GIL")
UNAVAILABLE = re.compile(r"native Engram row reader unavailable \((.+)\); rows are read by the Python path, "
                         r"which needs the GIL")


def test_the_library_is_built_once_logged_once_and_reused(facts) -> None:
    first = facts["first"]
    assert first["ok"] and len(first["lines"]) == 1 and READY.fullmatch(first["lines"][0]), first
    assert facts["second_same_object"] and facts["lines_after_second"] == 1
    assert facts["library_under_root"]
    other = facts["other_process"]
    assert other["rc"] == 0 and other["out"][0] == "True", other
    assert READY.fullmatch(other["out"][1]) and not other["rebuilt"]


def test_a_dead_builds_lock_file_does_not_hold_the_next_build(facts) -> None:
    assert facts["stale_lock_built"] and len(facts["stale_lock_lines"]) == 1
    assert READY.fullmatch(facts["stale_lock_lines"][0])


def test_a_source_that_does_not_compile_and_a_missing_compiler_fall_back_with_one_line(facts) -> None:
    for case in ("broken", "no_compiler"):
        got = facts[case]
        assert got["none"] and len(got["lines"]) == 1, got
        assert UNAVAILABLE.fullmatch(got["lines"][0]), got["lines"][0]
    assert "error" in facts["broken"]["lines"][0].lower()
    assert facts["broken_lines_after_second"] == 1  # the failure is not retried, nor logged again


def test_every_native_lookup_prefetch_and_stage_is_the_python_paths_bit_for_bit(facts) -> None:
    tables = facts["tables"]
    # 2 settings x 2 layers x 3 ranks x 5 shapes x 2 readers x (lookup, prefetch, staged)
    assert tables["checked"] == 2 * 2 * 3 * 5 * 2 * 3
    assert tables["failures"] == [] and tables["readers"] == ["native", "python"]


def test_a_failed_native_host_function_is_raised_by_the_next_lookup(facts) -> None:
    failure = facts["failure"]
    assert failure["before"] is True
    raised = failure["raised"]
    assert raised and raised.startswith("reading Engram rows of layer 1 failed on the CUDA driver's thread: StoreError: ")
    assert "engram-l1-r0of3.bin: short read of row 3 (0 of 264 bytes)" in raised and "re-pack" in raised


def test_on_a_gpu_both_readers_serve_lookups_prefetches_and_graph_replays(facts) -> None:
    cuda = facts["cuda"]
    if not cuda["available"]:
        pytest.skip("no CUDA device here: bench/engram_lookup checks the GPU paths on one")
    assert cuda["failures"] == []

