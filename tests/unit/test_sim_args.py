import io
from contextlib import redirect_stderr, redirect_stdout

import pytest

from configtext import HOME, SEED_TEXT, edited
from coordinator import config, plan
from sim import args as simargs
from sim import group, settings
from sim.flags import human_readable_int

pytestmark = pytest.mark.unit

SIM_TEXT = edited(SEED_TEXT, RANK_RUNTIME="host", RANK_ENGINE="sim")
BASE = ["--model-path", "/m", "--tp-size", "3", "--nnodes", "3", "--node-rank", "1",
        "--dist-init-addr", "10.0.0.1:20000"]


def rendered(text=SIM_TEXT, **kw):
    cfg = config.parse(text, "cluster.env", HOME)
    return plan.render_cluster(cfg, **kw)


def rejected(argv):
    err = io.StringIO()
    with redirect_stderr(err), pytest.raises(SystemExit) as exit_info:
        simargs.parse(argv)
    return exit_info.value.code, err.getvalue()


@pytest.mark.parametrize("tables", [False, True])
def test_every_rendered_rank_argv_of_the_example_config_parses(tables):
    plans = rendered(dspark_tables=tables)
    assert len(plans) == 3
    for node_plan in plans:
        argv = list(node_plan.rank_spec.argv)
        assert argv[0] == "/usr/bin/dsv41-sim-rank"
        parsed = simargs.parse(argv[1:])
        assert parsed.rank == node_plan.rank
        assert (parsed.tp_size, parsed.nnodes, parsed.chunked_prefill_size) == (3, 3, 768)
        assert (parsed.dist_host, parsed.dist_port) == ("10.0.0.1", 20000)
        assert parsed.model_name == "deepseek-v4.1-flash"
        # the example's EXTRA_SGLANG_ARGS
        assert (parsed.fp8_gemm_backend, parsed.watchdog_timeout, parsed.sleep_on_idle) == \
            ("flashinfer_cutlass", 1800.0, True)
        assert (parsed.speculative_dspark_sps_table_path is not None) == tables


def test_the_container_runtime_renders_the_same_sglang_flags():
    cfg = config.parse(SEED_TEXT, "cluster.env", HOME)
    for node in cfg.nodes:
        assert simargs.parse(plan.sglang_args(cfg, node, {})).rank == node.rank


def test_ranks_of_one_plan_agree_on_group_settings_despite_the_head_fraction():
    plans = rendered(edited(SIM_TEXT, HEAD_MEM_FRACTION_STATIC="0.93"))
    head, w1, w2 = (simargs.parse(list(p.rank_spec.argv[1:])) for p in plans)
    assert head.mem_fraction_static == 0.93 and w1.mem_fraction_static == 0.95
    assert head.group_settings() == w1.group_settings() == w2.group_settings()
    assert group.differences(group.settings_of(head), group.settings_of(w2)) == []


def test_differences_name_the_flag_and_both_values():
    a = simargs.parse(BASE + ["--chunked-prefill-size", "768"])
    b = simargs.parse(BASE + ["--chunked-prefill-size", "1024"])
    assert group.differences(group.settings_of(a), group.settings_of(b)) == \
        ["--chunked-prefill-size 1024 there, 768 here"]


@pytest.mark.parametrize("extra, fragment", [
    (["--no-such-flag"], "--no-such-flag is not a flag of SGLang 0.5.23"),
    (["--enable-lora"], "unrecognized arguments: --enable-lora (dsv41-sim-rank knows a subset"),  # SGLang's, not ours
    (["--mod", "/m"], "--mod is ambiguous to SGLang's parser: it could mean"),
    (["--load-format", "torch"], "argument --load-format: invalid choice: 'torch'"),
    (["--attention-backend", "fa9"], "argument --attention-backend: invalid choice"),
    (["--fp8-gemm-backend", "cudnn"], "argument --fp8-gemm-backend: invalid choice"),
    (["--tool-call-parser", "deepseekv99"], "argument --tool-call-parser: invalid choice"),
    (["--port", "http"], "argument --port: invalid int value"),
    (["--context-length", "1.5Ki"], "argument --context-length"),
    (["--node-rank", "3"], "--node-rank 3 must be in 0..2"),
    (["--tp-size", "4"], "--tp-size 4 must be a multiple of --nnodes 3"),
    (["--speculative-algorithm", "EAGLE", "--speculative-dspark-block-size", "5"], "needs --speculative-algorithm"),
    (["--speculative-algorithm", "MEDUSA"], "supports only EAGLE or DSPARK"),
    (["--mem-fraction-static", "1.5"], "--mem-fraction-static 1.5 must be in (0, 1]"),
    (["--chunked-prefill-size", "0"], "--chunked-prefill-size 0 must be positive"),
    (["--port", "70000"], "--port 70000 must be in 1..65535"),
    (["--dist-init-addr", "10.0.0.1"], "must be HOST:PORT"),
    (["--max-running-requests", "0"], "--max-running-requests 0 must be at least 1"),
])
def test_rejections_exit_2_and_say_what_is_wrong(extra, fragment):
    code, err = rejected(BASE + extra)
    assert code == 2
    assert fragment in err, err
    assert err.startswith("usage: dsv41-sim-rank")


def test_missing_model_path_and_rendezvous_address_are_rejected():
    code, err = rejected(["--tp-size", "3", "--nnodes", "3"])
    assert code == 2 and "--model-path is required" in err and "--dist-init-addr HOST:PORT is required" in err


def test_sglang_aliases_are_accepted_and_seen_by_the_cross_checks():
    parsed = simargs.parse(["--model", "/m", "--tensor-parallel-size", "3", "--nnodes", "3",
                            "--nccl-init-addr", "10.0.0.1:20000", "--node-rank=2"])
    assert (parsed.model_path, parsed.tp_size, parsed.dist_port, parsed.rank) == ("/m", 3, 20000, 2)
    code, err = rejected(["--model", "/m", "--tensor-parallel-size", "4", "--nnodes", "3",
                          "--nccl-init-addr", "10.0.0.1:20000"])
    assert code == 2 and "--tp-size 4 must be a multiple" in err


def test_last_occurrence_wins_like_argparse():
    assert simargs.parse(BASE + ["--chunked-prefill-size", "256", "--chunked-prefill-size", "512"]) \
        .chunked_prefill_size == 512


def test_human_readable_ints_follow_sglang():
    assert [human_readable_int(v) for v in ("262144", "256k", "256Ki", "1.5M", "1M")] == \
        [262144, 256000, 262144, 1500000, 1000000]


def test_help_says_it_is_a_stand_in():
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        simargs.parse(["--help"])
    assert exit_info.value.code == 0
    text = out.getvalue()
    assert "STAND-IN" in text and "no model" in text and "no GPU" in text
    assert "DSV41_SIM_BYTES_PER_TOKEN" in text and "--chunked-prefill-size" in text


def test_settings_from_the_environment():
    s = settings.from_env({"DSV41_SIM_PREFILL_TOKENS_PER_S": "500", "DSV41_SIM_BYTES_PER_TOKEN": "0",
                           "DSV41_SIM_PEER_TIMEOUT_S": "1"}, dist_timeout_s=30)
    assert (s.prefill_tokens_per_s, s.bytes_per_token, s.rendezvous_timeout_s) == (500.0, 0, 30.0)
    assert s.heartbeat_s < s.peer_timeout_s / 2
    assert settings.from_env({}) == settings.Settings()
    s = settings.from_env({"DSV41_SIM_TRANSIENT_BYTES": "0.5", "DSV41_SIM_LOAD_BYTES": "1048576",
                           "DSV41_PREFILL_EMPTY_CACHE_TOKENS": "0"})
    assert (s.transient_bytes, s.load_bytes, s.empty_cache_tokens) == (0.5, 1 << 20, 0)
    # the hook's threshold is the adapter's default, read as the adapter reads it
    assert settings.Settings().empty_cache_tokens == 8192 and settings.Settings().transient_bytes == 4.0
    assert settings.Settings().kv_pool and not settings.from_env({"DSV41_SIM_KV_POOL": "0"}).kv_pool


@pytest.mark.parametrize("env, fragment", [
    ({"DSV41_SIM_PREFILL_TOKENS_PER_S": "0"}, "DSV41_SIM_PREFILL_TOKENS_PER_S='0' must be more than zero"),
    ({"DSV41_SIM_BYTES_PER_TOKEN": "16k"}, "DSV41_SIM_BYTES_PER_TOKEN='16k' is not an integer"),
    ({"DSV41_SIM_DRAIN_TIMEOUT_S": "-1"}, "must be zero or more"),
    ({"DSV41_SIM_DECODE_TOKENS_PER_S": "inf"}, "is not a finite number"),
    ({"DSV41_SIM_LOAD_BYTES": "1.5"}, "DSV41_SIM_LOAD_BYTES='1.5' is not an integer"),
    ({"DSV41_SIM_TRANSIENT_BYTES": "-4"}, "DSV41_SIM_TRANSIENT_BYTES='-4' must be zero or more"),
    ({"DSV41_PREFILL_EMPTY_CACHE_TOKENS": "lots"}, "DSV41_PREFILL_EMPTY_CACHE_TOKENS='lots': expected an integer"),
    ({"DSV41_SIM_KV_POOL": "yes"}, "DSV41_SIM_KV_POOL='yes': expected an integer in [0, 1]"),
    ({"DSV41_SIM_KV_POOL": "2"}, "DSV41_SIM_KV_POOL=2: outside the allowed range [0, 1]"),
])
def test_bad_settings_are_named(env, fragment):
    with pytest.raises(ValueError) as exc:
        settings.from_env(env)
    assert fragment in str(exc.value)
