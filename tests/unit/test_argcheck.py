import pytest

from tests.configtext import HOME, SEED_TEXT
from coordinator import argcheck, config, plan

pytestmark = pytest.mark.unit

BASE = ["--model-path", "/m", "--tp-size", "3", "--nnodes", "3", "--dist-init-addr", "10.0.0.1:20000"]


def test_rendered_plans_are_consistent():
    cfg = config.parse(SEED_TEXT, "cluster.env", HOME)
    for node in cfg.nodes:
        assert argcheck.check_sglang_args(plan.sglang_args(cfg, node, {})) == []


@pytest.mark.parametrize("extra, fragment", [
    (["--node-rank", "3"], "--node-rank 3 must be in 0..2"),
    (["--node-rank", "-1"], "--node-rank -1 must be in 0..2"),
    (["--tp-size", "4"], "--tp-size 4 must be a multiple of --nnodes 3"),
    (["--ep-size", "2"], "--ep-size 2 must divide --tp-size 3"),
    (["--speculative-algorithm", "DSPARK", "--speculative-dspark-block-size", "5",
      "--speculative-num-draft-tokens", "5"], "must be --speculative-dspark-block-size + 1 = 6"),
    (["--speculative-algorithm", "EAGLE", "--speculative-dspark-block-size", "5"], "needs --speculative-algorithm"),
    (["--node-rank", "one"], "is not an integer"),
])
def test_inconsistent_args_are_named(extra, fragment):
    errors = argcheck.check_sglang_args(BASE + extra)
    assert any(fragment in e for e in errors), errors


def test_last_occurrence_wins_like_argparse():
    assert argcheck.check_sglang_args(BASE + ["--tp-size", "6", "--node-rank=2"]) == []
    assert argcheck.check_sglang_args(["--tp-size", "6"] + BASE[2:] + ["--tp-size", "4"]) != []


def test_multi_node_needs_a_rendezvous_address():
    assert any("--dist-init-addr" in e for e in argcheck.check_sglang_args(["--nnodes", "2", "--tp-size", "2"]))
