"""Every node's rendered argv for the example config, parsed by SGLang 0.5.23's own parser."""

import json
import subprocess

import pytest

from tests.configtext import HOME, REPO, SEED_TEXT, edited, nodes_text
from coordinator import argcheck, config, plan

pytestmark = pytest.mark.sglang

PARSE = r"""
import json, sys
from sglang.srt.server_args import prepare_server_args
out = []
for args in json.load(sys.stdin):
    try:
        s = prepare_server_args(args)
    except SystemExit as exc:
        out.append({"error": f"SystemExit({exc.code})"})
        continue
    out.append({k: getattr(s, k) for k in (
        "model_path", "tp_size", "ep_size", "nnodes", "node_rank", "dist_init_addr", "port", "host",
        "mem_fraction_static", "chunked_prefill_size", "context_length", "max_running_requests",
        "max_total_tokens", "speculative_algorithm", "speculative_dspark_block_size",
        "speculative_dspark_sps_table_path", "speculative_dspark_confidence_sts_path", "tool_call_parser",
        "reasoning_parser", "attention_backend", "moe_runner_backend", "watchdog_timeout", "sleep_on_idle",
        "random_seed", "trust_remote_code", "load_format", "served_model_name")})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def venv_python():
    proc = subprocess.run([str(REPO / "tools" / "sglang-venv.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip() + "/bin/python"


def parse_all(venv_python, arg_lists):
    proc = subprocess.run([venv_python, "-c", PARSE], input=json.dumps(arg_lists), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_example_config_argv_parses_on_every_node(venv_python):
    cfg = config.parse(SEED_TEXT, "cluster.env", HOME)
    tables = plan.render_cluster(cfg, dspark_tables=True)[0].dspark_tables
    arg_lists = [plan.sglang_args(cfg, node, tables) for node in cfg.nodes]
    parsed = parse_all(venv_python, arg_lists)
    for node, args, got in zip(cfg.nodes, arg_lists, parsed):
        assert "error" not in got, (node.name, got)
        assert argcheck.check_sglang_args(args) == []
        assert got["node_rank"] == node.rank and got["nnodes"] == 3 and got["tp_size"] == 3
        assert got["dist_init_addr"] == "10.0.0.1:20000"
        assert got["model_path"] == "/var/tmp/DeepSeek-V4.1-Flash"
        assert got["mem_fraction_static"] == 0.95
        assert got["chunked_prefill_size"] == 768 and got["context_length"] == 262144
        assert got["max_total_tokens"] == 750000 and got["max_running_requests"] == 4
        assert got["speculative_algorithm"] == "DSPARK" and got["speculative_dspark_block_size"] == 5
        assert got["speculative_dspark_sps_table_path"] == "/state/dspark_sps.json"
        assert got["speculative_dspark_confidence_sts_path"] == "/state/dspark_sts.json"
        assert got["tool_call_parser"] == "deepseekv41" and got["reasoning_parser"] == "deepseek-v41"
        assert got["attention_backend"] == "dsv4" and got["moe_runner_backend"] == "flashinfer_mxfp4"
        assert got["watchdog_timeout"] == 1800 and got["sleep_on_idle"] is True
        assert got["port"] == 8888 and got["host"] == "0.0.0.0" and got["random_seed"] == 0
    # identical except the rank
    assert [{k: v for k, v in g.items() if k != "node_rank"} for g in parsed[1:]] == \
        [{k: v for k, v in parsed[0].items() if k != "node_rank"}] * 2


def test_tp4_and_eagle_variants_parse(venv_python):
    cfgs = [config.parse(nodes_text(4), "cluster.env", HOME),
            config.parse(edited(SPEC_ALGO="EAGLE", HEAD_MEM_FRACTION_STATIC="0.9"), "cluster.env", HOME)]
    arg_lists = [plan.sglang_args(c, n, {}) for c in cfgs for n in c.nodes]
    parsed = parse_all(venv_python, arg_lists)
    assert all("error" not in p for p in parsed), parsed
    assert [p["node_rank"] for p in parsed[:4]] == [0, 1, 2, 3] and parsed[0]["tp_size"] == 4
    assert parsed[4]["speculative_algorithm"] == "EAGLE" and parsed[4]["mem_fraction_static"] == 0.9


def test_sglang_rejects_what_it_should_and_argcheck_catches_the_rest(venv_python):
    cfg = config.parse(SEED_TEXT, "cluster.env", HOME)
    good = plan.sglang_args(cfg, cfg.nodes[1], {})
    bad_flag = good + ["--no-such-flag"]
    out_of_range = good + ["--node-rank", "3"]
    parsed = parse_all(venv_python, [bad_flag, out_of_range])
    assert parsed[0] == {"error": "SystemExit(2)"}
    # SGLang accepts a node rank past the last node; the project's own check does not
    assert "error" not in parsed[1] and parsed[1]["node_rank"] == 3
    assert any("--node-rank 3" in e for e in argcheck.check_sglang_args(out_of_range))
