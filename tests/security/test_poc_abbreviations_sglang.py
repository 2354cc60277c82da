"""Finding 5 against SGLang 0.5.23's own parser: the option table the coordinator and the stand-in
read flags through is SGLang's, and every abbreviation expands to what SGLang itself parses."""

from __future__ import annotations

import json
import subprocess

import pytest

from coordinator import sglang_cli, sglang_options
from tests.configtext import REPO
from tests.sglang.harness import Sglang

pytestmark = pytest.mark.sglang

BASE = ["--model-path", "/m", "--tp-size", "3", "--nnodes", "3", "--dist-init-addr", "10.0.0.1:20000"]
ABBREVIATED = [
    ["--node-ra=2"], ["--node-ra", "2"], ["--tp-s", "6"], ["--mem-frac", "0.5"], ["--context-len", "4096"],
    ["--api-ke=sglang-K3y-argv"], ["--watch", "1800"], ["--sleep-on"], ["--fp8-gemm", "triton"],
    ["--tensor-parallel-size", "6"], ["--model", "/other"], ["--nccl-init-addr", "10.0.0.9:1"],
]
PARSE = r"""
import argparse, json, sys
from sglang.srt.server_args import ServerArgs, prepare_server_args
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
dests = sorted({a.dest for a in parser._actions if a.dest != "help"})
out = []
for argv in json.load(sys.stdin):
    try:
        s = prepare_server_args(argv)
        # every field, as text: what SGLang made of the whole argv
        out.append({d: repr(getattr(s, d, None)) for d in dests})
    except SystemExit as exc:
        out.append({"error": exc.code})
print(json.dumps(out))
"""
GENERATE = REPO / "tools" / "gen-sglang-options.py"


def parse_all(sglang: Sglang, argvs: list[list[str]]) -> list[dict]:
    done = subprocess.run([str(sglang.python), "-c", PARSE], input=json.dumps(argvs),
                          capture_output=True, text=True, timeout=300, env=sglang.env(False), cwd=str(sglang.root))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_option_table_is_sglangs(sglang: Sglang) -> None:
    done = subprocess.run([str(sglang.python), str(GENERATE)], capture_output=True, text=True, timeout=300,
                          env=sglang.env(False), cwd=str(sglang.root))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == (REPO / "coordinator" / "sglang_options.py").read_text(), \
        "coordinator/sglang_options.py differs from the installed SGLang: regenerate it with tools/gen-sglang-options.py"
    assert sglang_options.SGLANG_VERSION == "0.5.23"


def test_abbreviations_expand_to_what_sglang_parses(sglang: Sglang) -> None:
    argvs = [BASE + extra for extra in ABBREVIATED]
    canonical = []
    for argv in argvs:
        words, problems = sglang_cli.canonicalize(argv)
        assert problems == [], (argv, problems)
        assert all(not w.startswith("-") or w.partition("=")[0] in sglang_cli.CANONICAL.values() for w in words)
        canonical.append(words)
    assert parse_all(sglang, argvs) == parse_all(sglang, canonical)
    parsed = parse_all(sglang, argvs)
    assert parsed[0]["node_rank"] == parsed[1]["node_rank"] == "2"  # what the plan's --node-rank said no longer counts
    assert parsed[5]["api_key"] == "'sglang-K3y-argv'"  # an abbreviated key flag is a key in argv


def test_what_sglang_refuses_canonicalize_reports(sglang: Sglang) -> None:
    for extra in (["--mod", "x"], ["--no-such-flag"]):
        _, problems = sglang_cli.canonicalize(BASE + extra)
        assert problems, extra
        assert parse_all(sglang, [BASE + extra]) == [{"error": 2}]
