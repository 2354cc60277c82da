import shlex

import pytest

from tests.configtext import HOME, SEED_TEXT, edited, nodes_text
from coordinator import config, plan

pytestmark = pytest.mark.unit


def cluster(text=SEED_TEXT, **kw):
    cfg = config.parse(text, "cluster.env", HOME)
    return cfg, plan.render_cluster(cfg, **kw)


def sglang_part(argv):
    return list(argv[argv.index("sglang.launch_server") + 1:]) if "sglang.launch_server" in argv else list(argv[1:])


def flag(argv, name):
    return argv[argv.index(name) + 1]


def test_rank_argv_has_every_recipe_flag():
    _, plans = cluster()
    args = sglang_part(plans[1].rank_spec.argv)
    for name, value in [("--model-path", "/var/tmp/DeepSeek-V4.1-Flash"), ("--tp-size", "3"), ("--ep-size", "1"),
                        ("--attention-backend", "dsv4"), ("--moe-runner-backend", "flashinfer_mxfp4"),
                        ("--mem-fraction-static", "0.95"), ("--chunked-prefill-size", "768"),
                        ("--context-length", "262144"), ("--max-running-requests", "4"), ("--random-seed", "0"),
                        ("--tool-call-parser", "deepseekv41"), ("--reasoning-parser", "deepseek-v41"),
                        ("--host", "0.0.0.0"), ("--port", "8888"), ("--speculative-algorithm", "DSPARK"),
                        ("--speculative-dspark-block-size", "5"), ("--nnodes", "3"), ("--node-rank", "1"),
                        ("--dist-init-addr", "10.0.0.1:20000"), ("--max-total-tokens", "750000"),
                        ("--load-format", "safetensors"), ("--served-model-name", "deepseek-v4.1-flash")]:
        assert flag(args, name) == value, name
    for bare in ("--trust-remote-code", "--enable-cache-report"):
        assert bare in args
    assert args[-5:] == ["--fp8-gemm-backend", "flashinfer_cutlass", "--watchdog-timeout", "1800", "--sleep-on-idle"]


def test_ranks_are_identical_except_rank_address_gid_and_head_fraction():
    cfg, plans = cluster(edited(HEAD_MEM_FRACTION_STATIC="0.93"))
    head, w1, w2 = (p.rank_spec for p in plans)
    assert flag(sglang_part(head.argv), "--mem-fraction-static") == "0.93"
    assert flag(sglang_part(w1.argv), "--mem-fraction-static") == "0.95"

    def normalised(spec, rank, address):
        args = sglang_part(spec.argv)
        args[args.index("--node-rank") + 1] = "R"
        args[args.index("--mem-fraction-static") + 1] = "F"
        env = dict(spec.env)
        assert env.pop("SGLANG_HOST_IP") == address
        assert env["NCCL_IB_GID_INDEX"] == plan.GID_PLACEHOLDER
        return args, env

    assert normalised(w1, 1, "10.0.0.2") == normalised(w2, 2, "10.0.0.3")
    assert normalised(head, 0, "10.0.0.1")[1] == normalised(w1, 1, "10.0.0.2")[1]
    assert normalised(head, 0, "10.0.0.1")[0] == normalised(w1, 1, "10.0.0.2")[0]


def test_rank_environment_carries_the_measured_settings():
    _, plans = cluster()
    env = plans[0].rank_spec.env
    assert env["NCCL_IB_HCA"] == "rocep1s0f0,rocep1s0f1"
    assert env["NCCL_BUFFSIZE"] == "1048576" and env["NCCL_PROTO"] == "^LL128"
    assert env["GLOO_SOCKET_IFNAME"] == "enP7s7" and env["NCCL_SOCKET_IFNAME"] == "enP7s7"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"
    assert env["DSV41_SOURCE"] == "/var/tmp/DeepSeek-V4.1-Flash"
    assert env["DSV41_PACKED_DIR"] == "/engram"
    assert env["DSV41_PREFILL_EMPTY_CACHE_TOKENS"] == "8192"
    assert env["SGLANG_DSV41_REASONING_EFFORT"] == "75"
    assert env["OFFLOAD_MODE"] == "nvme"
    assert env["LD_LIBRARY_PATH"] == plan.CONTAINER_NCCL_DIR
    assert "NCCL_HOST_DIR" not in env and "IB_HCA" not in env and "WORKER_USER" not in env
    assert plans[0].rank_spec.agent_fills == {"NCCL_IB_GID_INDEX": "roce_gid_index"}


def test_the_admission_gate_gets_the_guards_level_and_cost_model_only_when_asked_for():
    _, plans = cluster()
    env = plans[0].rank_spec.env
    assert env["DSV41_ADMISSION_GUARD_BYTES"] == "0" and "DSV41_ADMISSION_TOKEN_BYTES" not in env
    _, plans = cluster(edited(MEMORY_GUARD_ADMISSION="1", MEMORY_GUARD_GB="2"))
    for p in plans:  # every rank: they decide together
        env = p.rank_spec.env
        assert (env["DSV41_ADMISSION_GUARD_BYTES"], env["DSV41_ADMISSION_TOKEN_BYTES"],
                env["DSV41_ADMISSION_TRANSIENT_BYTES"], env["DSV41_ADMISSION_LONE_WAIT_S"]) == \
            ("2000000000", "12000", "20.0", "5.0")
    _, plans = cluster(edited(MEMORY_GUARD_ADMISSION="1", MEMORY_GUARD_TOKEN_BYTES="9000",
                              MEMORY_GUARD_TRANSIENT_BYTES="8.5"))
    env = plans[1].rank_spec.env
    assert (env["DSV41_ADMISSION_TOKEN_BYTES"], env["DSV41_ADMISSION_TRANSIENT_BYTES"]) == ("9000", "8.5")
    # a guard that only observes aborts nothing: a request alone is not held for it
    _, plans = cluster(edited(MEMORY_GUARD_ADMISSION="1", MEMORY_GUARD="observe"))
    assert plans[0].rank_spec.env["DSV41_ADMISSION_LONE_WAIT_S"] == "0.0"
    _, plans = cluster(edited(MEMORY_GUARD_ADMISSION="1", MEMORY_GUARD="off"))
    assert plans[0].rank_spec.env["DSV41_ADMISSION_GUARD_BYTES"] == "0"  # no guard level to keep
    # the coordinator derives them: set by hand they are refused, with what to set instead
    with pytest.raises(config.ConfigInvalid, match=r"DSV41_ADMISSION_GUARD_BYTES=1: the coordinator sets"):
        cluster(edited(DSV41_ADMISSION_GUARD_BYTES="1"))


def test_container_argv_pins_the_image_and_keeps_values_out_of_argv():
    _, plans = cluster(edited(IMAGE=""))
    spec = plans[2].rank_spec
    argv = list(spec.argv)
    assert argv[:4] == [plan.DOCKER, "run", "--rm", "--name"]
    assert argv[argv.index("python3") - 1].endswith(
        "@sha256:3dbc313030a6ef2c5d7de8ecf48e9aece722694a82182cb618cc82b588816349")
    env_flags = [argv[i + 1] for i, a in enumerate(argv) if a == "-e"]
    assert sorted(env_flags) == sorted(spec.env)
    assert all("=" not in name for name in env_flags)
    assert "--network" in argv and flag(argv, "--network") == "host" and flag(argv, "--ipc") == "host"
    volumes = [argv[i + 1] for i, a in enumerate(argv) if a == "-v"]
    assert "/var/tmp/DeepSeek-V4.1-Flash:/var/tmp/DeepSeek-V4.1-Flash:ro" in volumes
    assert "/home/op/dsv41-engram:/engram:ro" in volumes
    assert f"{plan.ADAPTER_DIR}:{plan.CONTAINER_ADAPTER_DIR}:ro" in volumes
    assert spec.exec_start_pre == spec.exec_stop_post == ((plan.DOCKER, "rm", "--force", "dsv41-rank"),)


def test_head_binds_its_model_dir_at_the_common_path():
    _, plans = cluster()
    argv = list(plans[0].rank_spec.argv)
    volumes = [argv[i + 1] for i, a in enumerate(argv) if a == "-v"]
    assert "/home/op/NewModels/DeepSeek-V4.1-Flash:/var/tmp/DeepSeek-V4.1-Flash:ro" in volumes
    assert argv[argv.index("python3") - 1] == "dsv41-3x-spark:local"


def test_host_runtime_renders_a_complete_argv_with_bind_paths():
    _, plans = cluster(edited(RANK_RUNTIME="host", RANK_PYTHON="/opt/sglang/bin/python"))
    head = plans[0].rank_spec
    assert head.runtime == "host"
    assert list(head.argv[:3]) == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
    assert plan.Bind("/home/op/NewModels/DeepSeek-V4.1-Flash", "/var/tmp/DeepSeek-V4.1-Flash") in head.binds
    assert head.env["PYTHONPATH"] == plan.ADAPTER_DIR
    assert head.env["LD_LIBRARY_PATH"] == "/home/op/nccl-2.30.7"
    assert head.exec_start_pre == ()
    # a worker's model path is its own mount: nothing to re-map
    assert all(b.target != "/var/tmp/DeepSeek-V4.1-Flash" for b in plans[1].rank_spec.binds)


def test_sim_engine_uses_the_stand_in_with_the_same_flags():
    _, plans = cluster(edited(RANK_RUNTIME="host", RANK_ENGINE="sim"))
    argv = plans[1].rank_spec.argv
    assert argv[0] == "/usr/bin/dsv41-sim-rank"
    assert flag(list(argv), "--node-rank") == "1"


def test_dspark_tables_only_when_the_coordinator_says_all_ranks_match():
    _, without = cluster()
    assert "--speculative-dspark-sps-table-path" not in without[0].rank_spec.argv
    _, with_tables = cluster(dspark_tables=True)
    args = sglang_part(with_tables[1].rank_spec.argv)
    assert flag(args, "--speculative-dspark-sps-table-path") == "/state/dspark_sps.json"
    assert flag(args, "--speculative-dspark-confidence-sts-path") == "/state/dspark_sts.json"
    assert with_tables[1].dspark_tables == {"/state/dspark_sps.json": "/var/lib/dsv41/state/dspark_sps.json",
                                           "/state/dspark_sts.json": "/var/lib/dsv41/state/dspark_sts.json"}
    assert without[0].fingerprint != with_tables[0].fingerprint


def test_spec_algo_none_renders_no_speculative_flags():
    _, plans = cluster(edited(SPEC_ALGO="NONE"))
    assert not [a for a in plans[0].rank_spec.argv if a.startswith("--speculative")]


def test_export_on_the_head_and_mounts_on_workers():
    _, plans = cluster()
    head, w1, w2 = plans
    assert head.mount is None and w1.export is None
    assert head.export.path == "/home/op/NewModels/DeepSeek-V4.1-Flash"
    assert head.export.options == "ro,sync,no_subtree_check,root_squash,secure,fsid=0"
    assert head.export.clients == ("10.0.0.2", "10.0.0.3", "10.0.22.0/24", "10.0.23.0/24", "10.0.33.0/24")
    assert (w1.mount.what, w2.mount.what) == ("10.0.22.1:/", "10.0.23.1:/")
    assert w1.mount.where == "/var/tmp/DeepSeek-V4.1-Flash" and w1.mount.type == "nfs4"
    assert w1.mount.options == "nfsvers=4.2,ro,nosuid,nodev,nconnect=8,rsize=1048576,wsize=1048576,hard,timeo=600"
    assert w1.mount.expected_shards == 48
    _, ganesha = cluster(edited(NFS_BACKEND="ganesha"))
    assert ganesha[1].mount.what == "10.0.22.1:/dsv41-native"
    _, unshared = cluster(edited(NFS_SHARE="0"))
    assert unshared[0].export is None and unshared[1].mount is None


def test_fabric_expectations():
    _, plans = cluster()
    fabric = plans[1].fabric
    assert fabric.hcas == ("rocep1s0f0", "rocep1s0f1")
    assert (fabric.iface, fabric.address, fabric.mtu) == ("enp1s0f1np1", "10.0.0.2", 9000)
    assert fabric.socket_ifaces == ("enP7s7",)
    assert [(p.name, p.address) for p in fabric.peers] == [
        ("spark1", "10.0.0.1"), ("spark3", "10.0.0.3"), ("spark1 (NFS)", "10.0.22.1")]


def test_pack_spec_per_node():
    _, plans = cluster()
    assert [(p.pack.source_dir, p.pack.ranks) for p in plans] == [
        ("/home/op/NewModels/DeepSeek-V4.1-Flash", (0,)), ("/var/tmp/DeepSeek-V4.1-Flash", (1,)),
        ("/var/tmp/DeepSeek-V4.1-Flash", (2,))]
    pack = plans[0].pack
    assert pack.tp == 3 and pack.layers == (1, 14) and pack.required and not pack.run_if_missing
    _, six = cluster(edited(TP_SIZE="6", EP_SIZE="1"))
    assert [p.pack.ranks for p in six] == [(0, 1), (2, 3), (4, 5)]


def test_fingerprint_is_stable_and_tracks_changes():
    _, a = cluster()
    _, b = cluster()
    _, c = cluster(edited(CHUNKED_PREFILL_SIZE="1024"))
    assert [p.fingerprint for p in a] == [p.fingerprint for p in b]
    assert all(x.fingerprint != y.fingerprint for x, y in zip(a, c))
    assert len({p.fingerprint for p in a}) == 3


@pytest.mark.parametrize("n", [2, 4, 8])
def test_other_cluster_sizes_render(n):
    cfg = config.parse(nodes_text(n), "cluster.env", HOME)
    plans = plan.render_cluster(cfg)
    assert [flag(sglang_part(p.rank_spec.argv), "--node-rank") for p in plans] == [str(r) for r in range(n)]
    assert all(flag(sglang_part(p.rank_spec.argv), "--tp-size") == str(n) for p in plans)


def test_extra_args_are_split_like_a_shell():
    _, plans = cluster(edited(EXTRA_SGLANG_ARGS="\"--json-model-override-args '{\\\"a\\\": 1}' --enable-metrics\""))
    args = sglang_part(plans[0].rank_spec.argv)
    assert args[-3:] == ["--json-model-override-args", '{"a": 1}', "--enable-metrics"]
    assert shlex.split(shlex.join(args)) == args


def test_no_gid_to_fill_when_nccl_does_not_use_roce():
    for changes in ({"NCCL_NET": "Socket"}, {"NCCL_IB_DISABLE": "1"}):
        _, plans = cluster(edited(**changes))
        assert plans[1].rank_spec.agent_fills == {}
        assert "NCCL_IB_GID_INDEX" not in plans[1].rank_spec.env
        assert plans[1].fabric.hcas == ()
