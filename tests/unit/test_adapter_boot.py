"""Arming: DSV41_SOURCE gates everything; sitecustomize does nothing else without it."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from adapter import boot
from dsv41.adapterlog import AdapterLog
from tests.rankentry import adapter_entry, rank_env

pytestmark = pytest.mark.unit

ALL = {"tp3_pad", "mxfp8_b12x", "autotune_keep", "prefill_empty_cache", "loop_abort", "max_new_tokens", "reasoning_effort",
       "inflight", "forward_progress"}


def test_defaults_switch_every_adapter_on() -> None:
    buf = io.StringIO()
    specs = boot.build_specs({"DSV41_SOURCE": "/m"}, AdapterLog(buf))
    assert {s.name for s in specs} == ALL and buf.getvalue() == ""


def test_each_setting_switches_its_adapter_off() -> None:
    off = {
        "DSV41_TP_PAD": "0",
        "DSV41_AUTOTUNE_KEEP": "0",
        "DSV41_PREFILL_EMPTY_CACHE_TOKENS": "0",
        "DSV41_LOOP_ABORT": "0",
        "DSV41_MAX_NEW_TOKENS": "0",
        "DSV41_REASONING_EFFORT_REMAP": "0",
        "DSV41_INFLIGHT_ROUTE": "0",
    }
    specs = boot.build_specs(off, AdapterLog(io.StringIO()))
    # cutlass still repairs scales; the forward-step counter has no setting
    assert [s.name for s in specs] == ["mxfp8_b12x", "forward_progress"]
    assert boot.build_specs({"DSV41_MXFP8_BACKEND": "cutlass"}, AdapterLog(io.StringIO()))[1].detail.startswith("SGLang's kernel choice")


def test_a_bad_setting_keeps_only_its_adapter_out() -> None:
    buf = io.StringIO()
    specs = boot.build_specs({"DSV41_LOOP_REPEATS": "1", "DSV41_MXFP8_BACKEND": "fast"}, AdapterLog(buf))
    assert {s.name for s in specs} == ALL - {"loop_abort", "mxfp8_b12x"}
    assert buf.getvalue().splitlines() == [
        "dsv41-adapter: mxfp8_b12x stays out: DSV41_MXFP8_BACKEND='fast': expected one of b12x, cudnn, cutlass",
        "dsv41-adapter: loop_abort stays out: DSV41_LOOP_REPEATS=1: outside the allowed range [2, 1000]",
    ]


def test_builder_bug_is_contained() -> None:
    def broken(env, log):
        raise KeyError("oops")

    buf = io.StringIO()
    specs = boot.build_specs({}, AdapterLog(buf), builders=(("broken", broken), boot.BUILDERS[0]))
    assert [s.name for s in specs] == ["tp3_pad"]
    assert buf.getvalue() == "dsv41-adapter: broken stays out: KeyError: 'oops'\n"


PROBE = (
    "import sys, json; from adapter.patching import armed_finder; "
    "print(json.dumps({'adapter_loaded': any(m == 'adapter' or m.startswith('adapter.') for m in sys.modules), "
    "'armed': armed_finder() is not None, 'shadowed': getattr(sys, 'dsv41_test_shadowed', False)}))"
)


def run_probe(tmp_path: Path, env_extra: dict[str, str], shadowed: bool = False) -> tuple[dict, str]:
    path = [str(adapter_entry(tmp_path))]
    if shadowed:
        other = tmp_path / "image-site"
        other.mkdir(exist_ok=True)
        (other / "sitecustomize.py").write_text("import sys\nsys.dsv41_test_shadowed = True\n")
        path.append(str(other))
    env = rank_env(path, **env_extra)
    # The probe itself imports adapter.patching: look at sys.modules before that import.
    code = "import sys; loaded = [m for m in sys.modules if m.startswith('adapter')]; " + PROBE.replace(
        "any(m == 'adapter' or m.startswith('adapter.') for m in sys.modules)", "bool(loaded)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_sitecustomize_without_dsv41_source_loads_nothing(tmp_path: Path) -> None:
    result, err = run_probe(tmp_path, {}, shadowed=True)
    assert result == {"adapter_loaded": False, "armed": False, "shadowed": True}
    assert err == ""


def test_sitecustomize_with_dsv41_source_arms_and_chains(tmp_path: Path) -> None:
    result, err = run_probe(tmp_path, {"DSV41_SOURCE": "/models/x"}, shadowed=True)
    assert result == {"adapter_loaded": True, "armed": True, "shadowed": True}
    assert "dsv41-adapter" not in err  # nothing imported SGLang, so nothing was patched yet


def test_sitecustomize_survives_a_broken_adapter_setting(tmp_path: Path) -> None:
    result, err = run_probe(tmp_path, {"DSV41_SOURCE": "/m", "DSV41_MAX_NEW_TOKENS": "lots"})
    assert result["armed"] is True
    assert "dsv41-adapter: max_new_tokens stays out: DSV41_MAX_NEW_TOKENS='lots'" in err
