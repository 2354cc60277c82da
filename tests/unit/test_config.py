import pytest

from tests.configtext import HOME, REPO, SEED_ENV, SEED_TEXT, edited, line_of, nodes_text
from coordinator import config, schema

pytestmark = pytest.mark.unit


def load(text, environ=HOME):
    return config.parse(text, "/etc/dsv41/cluster.env", environ)


def errors_of(text, environ=HOME):
    with pytest.raises(config.ConfigInvalid) as info:
        load(text, environ)
    return [str(e) for e in info.value.errors]


def test_copy_of_the_seed_file_is_verbatim():
    shared = REPO.parent / "shared" / "seed" / "cluster.env.example"
    if not shared.exists():
        pytest.skip("../shared is not beside this checkout")
    assert SEED_ENV.read_bytes() == shared.read_bytes()


def test_the_example_file_loads_unchanged():
    cfg = config.load(SEED_ENV, HOME)
    assert [(n.name, n.rank, n.address, n.nfs_server) for n in cfg.nodes] == [
        ("spark1", 0, "10.0.0.1", None), ("spark2", 1, "10.0.0.2", "10.0.22.1"),
        ("spark3", 2, "10.0.0.3", "10.0.23.1")]
    assert cfg.integer("TP_SIZE") == 3 and cfg.integer("EP_SIZE") == 1 and cfg.integer("NNODES") == 3
    assert cfg.number("MEM_FRACTION_STATIC") == 0.95
    assert cfg.text("MODEL_DIR") == "/home/op/NewModels/DeepSeek-V4.1-Flash"
    assert cfg.words("EXTRA_SGLANG_ARGS") == ("--fp8-gemm-backend", "flashinfer_cutlass", "--watchdog-timeout",
                                              "1800", "--sleep-on-idle")
    assert cfg.words("IB_HCA") == ("rocep1s0f0", "rocep1s0f1")
    assert cfg.optional_words("NFS_CLIENTS") == ("10.0.0.2", "10.0.0.3", "10.0.22.0/24", "10.0.23.0/24", "10.0.33.0/24")
    assert cfg.settings["SGLANG_DSV41_REASONING_EFFORT"] == 75  # an effort: 1-100 or a tier, read by the rank only
    assert cfg.number("DSV41_VERIFY_CAP") == 0.1
    assert cfg.flag("NFS_SHARE") is True and cfg.flag("DSV41_RESIDENT_SCALES") is False
    assert cfg.passthrough == {}


def test_a_key_reads_only_as_the_kind_its_schema_declares():
    cfg = config.load(SEED_ENV, HOME)
    assert isinstance(cfg.number("HANG_TIMEOUT_S"), float) and isinstance(cfg.integer("PORT"), int)
    with pytest.raises(TypeError, match="TP_SIZE is an integer; it was read as a number"):
        cfg.number("TP_SIZE")
    with pytest.raises(TypeError, match="NFS_SHARE is a flag; it was read as a text"):
        cfg.text("NFS_SHARE")
    with pytest.raises(TypeError, match="API_KEY_FILE is an optional text; it was read as a text"):
        cfg.text("API_KEY_FILE")  # may be None: read with optional_text
    with pytest.raises(KeyError, match="TP_SIZ is not a cluster.env key"):
        cfg.integer("TP_SIZ")


def test_every_schema_key_has_a_typed_reader():
    cfg = config.load(SEED_ENV, HOME)
    readers = {(config.v.Kind.INTEGER, False): cfg.integer, (config.v.Kind.NUMBER, False): cfg.number,
               (config.v.Kind.FLAG, False): cfg.flag, (config.v.Kind.TEXT, False): cfg.text,
               (config.v.Kind.WORDS, False): cfg.words, (config.v.Kind.INTEGER, True): cfg.optional_integer,
               (config.v.Kind.NUMBER, True): cfg.optional_number, (config.v.Kind.TEXT, True): cfg.optional_text,
               (config.v.Kind.WORDS, True): cfg.optional_words, (config.v.Kind.LISTEN, True): cfg.optional_listen,
               (config.v.Kind.LISTEN, False): cfg.listen}
    rank_only = {config.v.Kind.EFFORT, config.v.Kind.ALLOC_CONF}  # read by the rank from its environment
    for key in schema.KEYS:
        if key.parse.kind in rank_only:
            continue
        assert readers[(key.parse.kind, key.parse.optional)](key.name) == cfg.settings[key.name], key.name


def test_every_key_of_the_example_is_understood():
    cfg = load(SEED_TEXT)
    worker_keys = {p.format(k=k) for p in schema.WORKER_KEYS for k in (1, 2)}
    for line in SEED_TEXT.splitlines():
        if "=" in line and not line.startswith("#"):
            key = line.split("=", 1)[0]
            assert key in schema.BY_NAME or key in worker_keys or key in dict(cfg.unused), key


def test_unused_keys_are_reported_with_a_reason():
    cfg = load(SEED_TEXT)
    unused = dict(cfg.unused)
    assert set(unused) == {"WORKER_USER", "SSH_IDENTITY", "NFS_VOLUME"}
    assert "ssh" in unused["WORKER_USER"]


def test_home_defined_in_the_file_wins_over_the_environment():
    cfg = load("HOME=/home/operator\n" + SEED_TEXT, {})
    assert cfg.optional_text("NCCL_HOST_DIR") == "/home/operator/nccl-2.30.7"


def test_undefined_home_is_a_clear_error():
    errors = errors_of(SEED_TEXT, {})
    assert any("$HOME is not defined" in e and f":{line_of(SEED_TEXT, 'SSH_IDENTITY')}:" in e for e in errors)


@pytest.mark.parametrize("changes, expected", [
    ({"TP_SIZE": "4"}, "TP_SIZE=4: must be a multiple of NNODES=3"),
    ({"EP_SIZE": "2"}, "EP_SIZE=2: must divide TP_SIZE=3"),
    ({"CHUNKED_PREFILL_SIZE": "1000"}, "CHUNKED_PREFILL_SIZE=1000: must be a multiple of the 256-token KV page"),
    ({"MAX_TOTAL_TOKENS": "100000"}, "MAX_TOTAL_TOKENS=100000: must be at least CONTEXT_LENGTH=262144"),
    ({"CONTEXT_LENGTH": "1048577"}, "CONTEXT_LENGTH=1048577: must be an integer from 1 to 1048576"),
    ({"DSV41_CACHE_WAYS": "17"}, "DSV41_CACHE_WAYS=17: must be an integer from 1 to 16"),
    ({"BASE_IMAGE": "lmsysorg/sglang:dev-dsv41"}, "BASE_IMAGE=lmsysorg/sglang:dev-dsv41: must be pinned by digest"),
    ({"HEAD_IP": "10.0.0.256"}, "HEAD_IP=10.0.0.256: must be an IPv4 address"),
    ({"FABRIC_IFACE": "this-name-is-far-too-long"}, "FABRIC_IFACE=this-name-is-far-too-long: must be a network interface name"),
    ({"IB_HCA": "rocep1s0f0,,x"}, "IB_HCA=rocep1s0f0,,x: must be a comma-separated list of RDMA devices"),
    ({"MEM_FRACTION_STATIC": "1.2"}, "MEM_FRACTION_STATIC=1.2: must be a number in (0, 1)"),
    ({"NCCL_NET": "Foo"}, "NCCL_NET=Foo: must be one of IB, Socket"),
    ({"NCCL_IB_DISABLE": "yes"}, "NCCL_IB_DISABLE=yes: must be 1 or 0"),
    ({"NCCL_PROTO": "^LL256"}, "NCCL_PROTO=^LL256: must be a comma-separated list of LL, LL128, Simple"),
    ({"OFFLOAD_MODE": "disk"}, "OFFLOAD_MODE=disk: must be one of nvme, host"),
    ({"SPEC_ALGO": "MEDUSA"}, "SPEC_ALGO=MEDUSA: must be one of DSPARK, EAGLE, NONE"),
    ({"DSV41_MXFP8_BACKEND": "triton"}, "DSV41_MXFP8_BACKEND=triton: must be one of b12x, cudnn, cutlass"),
    ({"SGLANG_DSV41_REASONING_EFFORT": "101"}, "must be an integer from 1 to 100 or one of low, high, xhigh, max"),
    ({"SGLANG_DSV41_REASONING_EFFORT": "medium"}, "must be an integer from 1 to 100 or one of low, high, xhigh, max"),
    ({"DSV41_VERIFY_CAP": "conf:1.5"}, "DSV41_VERIFY_CAP=conf:1.5: must be 0 (off) or conf:<x>"),
    ({"DSV41_VERIFY_CAP": "0.1"}, "DSV41_VERIFY_CAP=0.1: must be 0 (off) or conf:<x>"),
    ({"NNODES": "9"}, "NNODES=9: must be an integer from 2 to 8"),
    ({"PORT": "70000"}, "PORT=70000: must be an integer from 1 to 65535"),
    ({"DIST_PORT": "8888"}, "DIST_PORT=8888: must differ from PORT=8888"),
    ({"NFS_CLIENTS": "10.0.22.1/24"}, "host bits zero"),
    ({"WORKER2_HOST": "spark2"}, "node name spark2 is used twice"),
    ({"WORKER2_IP": "10.0.0.2"}, "address 10.0.0.2 is used by two nodes"),
    ({"EXTRA_SGLANG_ARGS": '"--tp-size 3"'}, "--tp-size is set from TP_SIZE; remove it here"),
    ({"EXTRA_SGLANG_ARGS": '"--api-key secret"'}, "--api-key would put a key in argv, visible to every local "
                                                   "user in ps; remove it: set API_KEY_FILE instead"),
    ({"EXTRA_SGLANG_ARGS": '"--admin-api-key=secret"'}, "--admin-api-key would put a key in argv"),
    ({"EXTRA_SGLANG_ARGS": '"--speculative-num-draft-tokens 5"'}, "must be DSPARK_BLOCK_SIZE + 1 = 6"),
    ({"EXTRA_SGLANG_ARGS": '"oops --x"'}, "must start with a --flag"),
    ({"EXTRA_SGLANG_ARGS": "\"--a 'b\""}, "cannot be split like a shell would"),
    ({"DSV41_MAX_NEW_TOKENS": "300000"}, "DSV41_MAX_NEW_TOKENS=300000: must not exceed CONTEXT_LENGTH=262144"),
    ({"RANK_ENGINE": "sim"}, "RANK_ENGINE=sim: sim runs only with RANK_RUNTIME=host"),
])
def test_bad_values_name_file_line_key_and_what_is_allowed(changes, expected):
    text = edited(**changes)
    errors = errors_of(text)
    key = next(iter(changes))
    matching = [e for e in errors if expected in e]
    assert matching, errors
    if expected.startswith(f"{key}="):
        assert matching[0].startswith(f"cluster.env:{line_of(text, key)}: {key}=")


@pytest.mark.parametrize("flag", ["--api-key topsecret99", "--admin-api-key=topsecret99"])
def test_a_key_in_extra_args_is_refused_without_repeating_it(flag):
    errors = errors_of(edited(EXTRA_SGLANG_ARGS=f'"--enable-metrics {flag}"'))
    assert any("would put a key in argv" in e for e in errors), errors
    assert not any("topsecret99" in e for e in errors), errors


def test_expandable_segments_true_is_refused_with_the_reason():
    text = edited(PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    (error,) = errors_of(text)
    assert error.startswith(f"cluster.env:{line_of(text, 'PYTORCH_CUDA_ALLOC_CONF')}: PYTORCH_CUDA_ALLOC_CONF=")
    assert "NaN logits" in error and "expandable_segments:False" in error


def test_all_errors_are_reported_at_once():
    text = edited(TP_SIZE="4", HEAD_IP="x", DSV41_CACHE_WAYS="99", FOO="1")
    errors = errors_of(text)
    assert len(errors) == 4
    assert any("FOO: unknown key" in e for e in errors)
    # sorted by line
    lines = [int(e.split(":")[1]) for e in errors]
    assert lines == sorted(lines)


def test_unknown_key_is_an_error_but_prefixes_pass_through():
    cfg = load(edited(NCCL_IB_TIMEOUT="22", TORCH_NCCL_BLOCKING_WAIT="1", CUDA_DEVICE_ORDER="PCI_BUS_ID",
                      DSV41_SOMETHING_NEW="x"))
    assert cfg.passthrough == {"NCCL_IB_TIMEOUT": "22", "TORCH_NCCL_BLOCKING_WAIT": "1",
                               "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "DSV41_SOMETHING_NEW": "x"}
    errors = errors_of(edited(MODEL_PATH="/x"))
    assert any(e.startswith("cluster.env:") and "MODEL_PATH: unknown key" in e for e in errors)


def test_missing_worker_pair_is_reported():
    errors = errors_of(edited(WORKER2_HOST=None))
    assert any("WORKER2_HOST: is required with NNODES=3" in e for e in errors)


def test_worker_beyond_nnodes_is_reported():
    errors = errors_of(nodes_text(3) + "\nWORKER3_IP=10.0.0.9\n")
    assert any("WORKER3_IP: names worker 3, but NNODES=3 has workers 1..2" in e for e in errors)


@pytest.mark.parametrize("n", range(2, 9))
def test_two_to_eight_nodes(n):
    cfg = load(nodes_text(n))
    assert [node.rank for node in cfg.nodes] == list(range(n))
    assert cfg.nodes[-1].name == f"spark{n}"


def test_nfs_server_ips_are_optional_without_nfs_share():
    cfg = load(edited(NFS_SHARE="0", NFS_SERVER_IP_1=None, NFS_SERVER_IP_2=None))
    assert all(n.nfs_server is None for n in cfg.nodes)
    errors = errors_of(edited(NFS_SERVER_IP_2=None))
    assert any("NFS_SERVER_IP_2: is required" in e for e in errors)


def test_unreadable_file_is_one_clear_error(tmp_path):
    with pytest.raises(config.ConfigInvalid) as info:
        config.load(tmp_path / "nope.env", HOME)
    assert "cannot read" in str(info.value)


def test_warnings_for_settings_that_do_nothing():
    cfg = load(edited(DSV41_BLOCK_VERIFY="0"))
    assert any("DSV41_BLOCK_VERIFY=0" in w for w in cfg.warnings)


def test_a_ragged_verify_mode_with_the_verify_cap_is_an_error_the_ranks_would_refuse():
    text = SEED_TEXT.rstrip("\n") + "\nSGLANG_RAGGED_VERIFY_MODE=cap-accept\n"
    errors = errors_of(text)
    assert errors == [f"cluster.env:{line_of(text, 'SGLANG_RAGGED_VERIFY_MODE')}: SGLANG_RAGGED_VERIFY_MODE=cap-accept: "
                      "SGLang then schedules verify lengths itself, and the verify cap (DSV41_VERIFY_CAP) caps its "
                      "static verify: every rank would refuse to start; remove SGLANG_RAGGED_VERIFY_MODE or set "
                      "DSV41_VERIFY_CAP=0"]
    assert load(edited(DSV41_VERIFY_CAP="0").rstrip("\n") + "\nSGLANG_RAGGED_VERIFY_MODE=cap-accept\n").passthrough == {
        "SGLANG_RAGGED_VERIFY_MODE": "cap-accept"}
    assert load(SEED_TEXT.rstrip("\n") + "\nSGLANG_RAGGED_VERIFY_MODE=static\n").no_effect == ()


DECODE_KEYS = ["DSV41_WO_A_W8", "DSV41_WO_A_W8_MID", "DSV41_WO_A_W8_DROP", "DSV41_WO_A_W8_DRAFT",
               "DSV41_DRAFT_HEAD_FP8", "DSV41_VERIFY_CAP", "DSV41_DRAFT_TAU", "DSV41_BLOCK_VERIFY",
               "DSV41_FOLDED_FENCE"]


def declared() -> frozenset[str]:
    from adapter import boot

    return frozenset(boot.env_keys())


def test_every_rank_key_of_the_example_has_its_adapter():
    assert load(SEED_TEXT).no_effect == ()


def test_rank_keys_no_adapter_reads_are_reported_with_their_line():
    # What an installed adapter package without the decode adapters would make of the example.
    cfg = config.parse(SEED_TEXT, "cluster.env", HOME, implemented=declared() - set(DECODE_KEYS))
    assert [e.key for e in cfg.no_effect] == DECODE_KEYS
    first = cfg.no_effect[0]
    assert str(first) == (f"cluster.env:{line_of(SEED_TEXT, 'DSV41_WO_A_W8')}: DSV41_WO_A_W8=1: no adapter implements "
                          "this yet; it has no effect")
    # SGLang's and NCCL's own keys are not the adapters' to read.
    reported = {e.key for e in cfg.no_effect}
    assert not reported & {"OFFLOAD_MODE", "DSV41_ENGRAM_PREFETCH", "DSV41_RESIDENT_SCALES", "DSV41_PACKED_DIR",
                           "SGLANG_FLASHINFER_MOE_FUSED_FINALIZE", "NCCL_BUFFSIZE", "PYTORCH_CUDA_ALLOC_CONF"}


def test_what_takes_effect_follows_the_adapters_declarations():
    without_decode = declared() - set(DECODE_KEYS)
    more = config.parse(SEED_TEXT, "cluster.env", HOME, implemented=without_decode | {"DSV41_WO_A_W8"})
    assert [e.key for e in more.no_effect] == DECODE_KEYS[1:]
    fewer = config.parse(SEED_TEXT, "cluster.env", HOME, implemented=declared() - {"DSV41_ENGRAM_PREFETCH"})
    assert [e.key for e in fewer.no_effect] == ["DSV41_ENGRAM_PREFETCH"]
    # A key left at its default is not the file's claim: only keys written in the file are reported.
    unset = config.parse(edited(DSV41_FOLDED_FENCE=None), "cluster.env", HOME, implemented=without_decode)
    assert [e.key for e in unset.no_effect] == DECODE_KEYS[:-1]
