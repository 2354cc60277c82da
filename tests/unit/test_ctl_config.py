import io
import json
import re
import os
import subprocess
import sys

import pytest

from tests.configtext import REPO, SEED_TEXT, edited
from coordinator import ctl

pytestmark = pytest.mark.unit


def run(*argv):
    out, err = io.StringIO(), io.StringIO()
    code = ctl.main(list(argv), out, err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def env_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", "/home/op")

    def write(text=SEED_TEXT):
        path = tmp_path / "cluster.env"
        path.write_text(text)
        return str(path)
    return write


def test_check_valid_file_exits_0_and_reports_unused_keys(env_file):
    code, out, err = run("config", "check", env_file())
    assert code == 0 and err == ""
    assert "valid: 3 nodes" in out
    assert "unused: WORKER_USER: the agents replace ssh" in out


def test_check_invalid_file_exits_1_with_every_error_on_stderr(env_file):
    code, out, err = run("config", "check", env_file(edited(TP_SIZE="4", DSV41_CACHE_WAYS="32")))
    assert code == 1 and out == ""
    lines = err.strip().splitlines()
    assert any(line.startswith("cluster.env:") and "TP_SIZE=4: must be a multiple of NNODES=3" in line
               for line in lines)
    assert any("DSV41_CACHE_WAYS=32" in line for line in lines)
    assert lines[-1].endswith("2 error(s); nothing was changed")


def test_show_json_has_the_documented_shape(env_file):
    code, out, _ = run("config", "show", env_file(), "--node", "spark3", "--json")
    assert code == 0
    body = json.loads(out)
    assert {"node", "rank", "argv", "env", "mount", "fabric", "pack"} <= set(body)
    assert body["node"] == "spark3" and body["rank"] == 2
    assert body["argv"][body["argv"].index("--node-rank") + 1] == "2"
    assert body["env"]["SGLANG_HOST_IP"] == "10.0.0.3"
    assert body["mount"]["what"] == "10.0.23.1:/"
    assert body["pack"]["ranks"] == [2]


def test_show_unknown_node_names_the_known_ones(env_file):
    code, _, err = run("config", "show", env_file(), "--node", "spark9")
    assert code == 1
    assert "no node 'spark9'" in err and "spark1, spark2, spark3" in err


def test_show_human_output_fits_80_columns(env_file):
    code, out, _ = run("config", "show", env_file(), "--node", "spark1")
    assert code == 0
    argv_lines = out.split("env:")[0].splitlines()[2:]
    assert argv_lines and all(len(line) <= 80 for line in argv_lines)


def test_keys_lists_every_schema_key():
    from coordinator import schema
    code, out, _ = run("config", "keys")
    assert code == 0
    for key in schema.KEYS:
        assert f"\n{key.name}  " in "\n" + out


def test_module_entry_point_runs_under_the_distribution_python(env_file):
    path = env_file()
    proc = subprocess.run(["/usr/bin/python3", "-m", "coordinator.ctl", "config", "check", path],
                          cwd=REPO, capture_output=True, text=True, env={**os.environ, "HOME": "/home/op"})
    assert proc.returncode == 0, proc.stderr
    assert "valid" in proc.stdout


def test_with_every_adapter_installed_no_key_of_the_example_is_without_effect(env_file):
    code, out, _ = run("config", "check", env_file())
    assert code == 0 and "no effect" not in out
    code, out, _ = run("config", "keys")
    assert "no adapter implements this yet" not in out


def test_check_and_keys_say_which_rank_keys_have_no_effect(env_file, monkeypatch):
    # An installed dsv41-adapter without the decode adapters (what `implemented` reads is its own
    # declarations): their keys are reported, each with its line, and marked in `config keys`.
    from adapter import boot
    from coordinator import adapterkeys

    decode = {"DSV41_WO_A_W8", "DSV41_WO_A_W8_MID", "DSV41_WO_A_W8_DROP", "DSV41_WO_A_W8_DRAFT",
              "DSV41_DRAFT_HEAD_FP8", "DSV41_VERIFY_CAP", "DSV41_DRAFT_TAU", "DSV41_BLOCK_VERIFY", "DSV41_FOLDED_FENCE"}
    monkeypatch.setattr(adapterkeys, "implemented", lambda: frozenset(boot.env_keys()) - decode)
    code, out, _ = run("config", "check", env_file())
    assert code == 0
    idle = [line for line in out.splitlines() if line.startswith("  no effect: ")]
    assert len(idle) == 9 and all(line.endswith(": no adapter implements this yet; it has no effect") for line in idle)
    assert any(": DSV41_WO_A_W8=1: " in line for line in idle) and not any("ENGRAM" in line for line in idle)
    code, out, _ = run("config", "keys")
    blocks = {b.split()[0]: b for b in re.split(r"\n(?=\S)", out)}
    assert "no adapter implements this yet; it has no effect" in blocks["DSV41_DRAFT_TAU"]
    assert "no effect" not in blocks["DSV41_ENGRAM_PREFETCH"] and "no effect" not in blocks["OFFLOAD_MODE"]
    assert sum("no adapter implements this yet" in b for b in blocks.values()) == 9