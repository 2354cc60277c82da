"""Finding 5: SGLang's parser keeps argparse's allow_abbrev, so `--node-ra=2`, `--tp-s 4`,
`--mem-frac 0.5`, `--context-len ...` in EXTRA_SGLANG_ARGS overrode the plan, and `--api-ke=KEY`
put the key in argv, past `config check` and argcheck, which compared spellings. The stand-in
refused abbreviations, so no test noticed. Both now read flags as SGLang does (the sglang tier
checks that against SGLang's own parser: test_poc_abbreviations_sglang.py)."""

from __future__ import annotations

import pytest

from coordinator import argcheck, config, plan
from sim import args as simargs
from tests.configtext import HOME, edited

pytestmark = pytest.mark.unit

KEY = "sglang-K3y-not-for-argv"


def check(extra: str):
    return config.parse(edited(EXTRA_SGLANG_ARGS=f'"{extra}"'), "cluster.env", HOME)


@pytest.mark.parametrize("extra, flag, owner", [
    ("--node-ra=2", "--node-rank", "the node's rank"),
    ("--tp-s 4", "--tp-size", "TP_SIZE"),
    ("--mem-frac 0.5", "--mem-fraction-static", "MEM_FRACTION_STATIC"),
    ("--context-len 1048576", "--context-length", "CONTEXT_LENGTH"),
    ("--tensor-parallel-size 4", "--tp-size", "TP_SIZE"),  # an alias of SGLang's, not an abbreviation
    ("--model /srv/other", "--model-path", "COMMON_MODEL"),
    ("--nccl-init-addr 10.9.9.9:1", "--dist-init-addr", "HEAD_IP and DIST_PORT"),
])
def test_an_abbreviated_owned_flag_is_refused_by_config_check(extra, flag, owner):
    with pytest.raises(config.ConfigInvalid) as info:
        check(extra)
    assert f"(SGLang reads it as {flag}) is set from {owner}; remove it here" in str(info.value)


def test_an_abbreviated_key_flag_is_refused_without_repeating_the_key():
    with pytest.raises(config.ConfigInvalid) as info:
        check(f"--api-ke={KEY} --watchdog-timeout 1800")
    text = str(info.value)
    assert "--api-ke (SGLang reads it as --api-key) would put a key in argv" in text
    assert KEY not in text
    with pytest.raises(config.ConfigInvalid) as info:
        check(f"--admin-api {KEY}")
    assert "(SGLang reads it as --admin-api-key)" in str(info.value) and KEY not in str(info.value)


def test_what_sglang_would_refuse_or_read_from_elsewhere_is_refused():
    for extra, why in (("--mod x", "--mod is ambiguous to SGLang's parser"),
                       ("--no-such-flag", "--no-such-flag is not a flag of SGLang 0.5.23"),
                       ("--config /srv/flags.yaml", "--config is refused: it reads more flags from a file")):
        with pytest.raises(config.ConfigInvalid, match=why):
            check(extra)


def test_accepted_abbreviations_reach_the_rank_spelled_in_full():
    cfg = check("--fp8-gemm flashinfer_cutlass --watchdog 1800 --sleep-on")
    argv = plan.sglang_args(cfg, cfg.nodes[1], {})
    assert argv[-5:] == ["--fp8-gemm-backend", "flashinfer_cutlass", "--watchdog-timeout", "1800", "--sleep-on-idle"]


def test_argcheck_reads_abbreviations_as_sglang_does():
    base = ["--model-path", "/m", "--tp-size", "3", "--nnodes", "3", "--dist-init-addr", "10.0.0.1:20000"]
    assert argcheck.check_sglang_args(base + ["--node-rank", "1"]) == []
    assert any("--node-rank 3 must be in 0..2" in e for e in argcheck.check_sglang_args(base + ["--node-ra", "3"]))
    assert any("--tp-size 4 must be a multiple" in e for e in argcheck.check_sglang_args(base + ["--tp-s=4"]))


def test_the_stand_in_parses_like_sglang_abbreviations_included():
    base = ["--model-path", "/m", "--tp-size", "3", "--nnodes", "3", "--dist-init-addr", "10.0.0.1:20000"]
    parsed = simargs.parse(base + ["--node-ra=2", "--mem-frac", "0.5", "--context-len", "4096"])
    assert (parsed.rank, parsed.mem_fraction_static, parsed.context_length) == (2, 0.5, 4096)
    with pytest.raises(SystemExit) as info:
        simargs.parse(base + ["--mod", "x"])
    assert info.value.code == 2
