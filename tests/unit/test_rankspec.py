"""The agent's validation of rank requests, including the contract with the coordinator's plans."""

import pytest

from agent import rankspec, settings
from tests.configtext import HOME, SEED_TEXT, edited
from coordinator import config, plan

pytestmark = pytest.mark.unit

IMAGE = "sha256:" + "ab" * 32  # the local build dsv41-3x-spark:local, by its ID
# The seed's paths: the model and packs under the operator's home, the workers' mount point.
ROOTS = "/home/op/NewModels,/home/op/dsv41-engram,/home/op/nccl-2.30.7,/var/tmp/DeepSeek-V4.1-Flash"


def agent_settings(**over):
    values = {"NODE_NAME": "spark2", "INSECURE_NO_TLS": "1", "ALLOWED_RUNTIMES": "container,host",
              "ALLOWED_IMAGES": IMAGE, "ALLOWED_PYTHONS": "/opt/sglang/bin/python",
              "ALLOWED_EXECUTABLES": "/usr/bin/dsv41-sim-rank", "ALLOWED_PATHS": ROOTS, **over}
    return settings.parse("".join(f"{k}={v}\n" for k, v in values.items()), "agent.env", {})


def launch_of(node_plan, s=None):
    spec = node_plan.rank_spec
    return rankspec.check_launch(
        runtime=spec.runtime, argv=spec.argv, env=spec.env, fills=spec.agent_fills,
        binds=[(b.source, b.target, b.read_only) for b in spec.binds], exec_start_pre=spec.exec_start_pre,
        exec_stop_post=spec.exec_stop_post, stop_timeout_s=spec.stop_timeout_s, memory_max=0, memory_high=0,
        fingerprint=node_plan.fingerprint, rank=node_plan.rank, generation="g1",
        fabric_address=node_plan.address, hcas=node_plan.fabric.hcas, settings=s or agent_settings())


@pytest.mark.parametrize("changes", [{}, {"RANK_RUNTIME": "host", "RANK_PYTHON": "/opt/sglang/bin/python"},
                                     {"RANK_RUNTIME": "host", "RANK_ENGINE": "sim"}])
def test_every_plan_the_coordinator_renders_is_accepted(changes):
    cfg = config.parse(edited(IMAGE=IMAGE, **changes), "cluster.env", HOME)
    for node_plan in plan.render_cluster(cfg, dspark_tables=True):
        s = agent_settings(ADAPTER_DIR=plan.ADAPTER_DIR)
        launch = launch_of(node_plan, s)
        assert launch.fills == dict(node_plan.rank_spec.agent_fills)


@pytest.mark.parametrize("changes", [{}, {"RANK_RUNTIME": "host", "RANK_PYTHON": "/opt/sglang/bin/python"},
                                     {"RANK_RUNTIME": "host", "RANK_ENGINE": "sim"}])
def test_the_gateways_launch_the_coordinator_sends_is_accepted(changes):
    from coordinator.agents import launch_pb
    cfg = config.parse(edited(IMAGE=IMAGE, API_KEY_FILE="/etc/dsv41/api-key", **changes), "cluster.env", HOME)
    launch, fingerprint = plan.gateway_launch(cfg)
    spec = launch_pb(launch, fingerprint=fingerprint)
    checked = rankspec.check_launch(
        runtime=spec.runtime, argv=list(spec.argv), env=dict(spec.env), fills=dict(spec.agent_fills),
        binds=[(b.source, b.target, b.read_only) for b in spec.binds],
        exec_start_pre=[list(c.argv) for c in spec.exec_start_pre],
        exec_stop_post=[list(c.argv) for c in spec.exec_stop_post], stop_timeout_s=spec.stop_timeout_s,
        memory_max=0, memory_high=0, fingerprint=spec.fingerprint, rank=spec.rank, generation=spec.cluster_generation,
        fabric_address=spec.fabric_address, hcas=list(spec.hcas),
        settings=agent_settings(ADAPTER_DIR=plan.ADAPTER_DIR, NODE_NAME="spark1"))
    assert set(checked.env) == {"PYTHONPATH", "DSV41_API_KEY_FILE"}


def test_the_image_must_be_allowed_on_the_node():
    cfg = config.parse(SEED_TEXT, "cluster.env", HOME)  # IMAGE=dsv41-3x-spark:local, a tag
    node_plan = plan.render_node(cfg, "spark2")
    with pytest.raises(rankspec.SpecDenied, match="image dsv41-3x-spark:local: not allowed on this node"):
        launch_of(node_plan, agent_settings())
    with pytest.raises(settings.SettingsError, match="'other:tag' is not an image pinned by digest"):
        agent_settings(ALLOWED_IMAGES="other:tag")


def test_container_argv_cannot_smuggle_flags():
    cfg = config.parse(edited(IMAGE=IMAGE), "cluster.env", HOME)
    node_plan = plan.render_node(cfg, "spark2")
    argv = list(node_plan.rank_spec.argv)
    for bad, message in [(["--privileged"], "--privileged is not one a rank needs"),
                         (["-v", "/:/host:rw"], "the only read-write bind is the cache"),
                         (["-v", "/var/run/docker.sock:/s:ro"], "not under this node's ALLOWED_PATHS"),
                         (["--network", "bridge"], "--network bridge: not allowed"),
                         (["--cidfile", "/var/lib/dsv41/state/id"], "--cidfile /var/lib/dsv41/state/id: not allowed")]:
        tampered = argv[:2] + bad + argv[2:]
        with pytest.raises((rankspec.SpecDenied, rankspec.SpecInvalid), match=message):
            rankspec.check_launch(runtime="container", argv=tampered, env=node_plan.rank_spec.env,
                                  fills={}, binds=[], exec_start_pre=[], exec_stop_post=[], stop_timeout_s=10,
                                  memory_max=0, memory_high=0, fingerprint="ab", rank=1, generation="",
                                  fabric_address="", hcas=[], settings=agent_settings())


def test_the_plan_has_the_container_write_its_id_where_the_memory_floor_reads_it():
    cfg = config.parse(edited(IMAGE=IMAGE), "cluster.env", HOME)
    node_plan = plan.render_node(cfg, "spark2")
    argv = list(node_plan.rank_spec.argv)
    i = argv.index("--cidfile")
    assert argv[i + 1] == plan.CONTAINER_ID_FILE == rankspec.CIDFILE
    launch = launch_of(node_plan, agent_settings(ADAPTER_DIR=plan.ADAPTER_DIR))
    props = {name: value for name, _, value in rankspec.unit_properties(launch, {}, "spark2", "/var/lib/dsv41")}
    assert props["RuntimeDirectory"] == ["dsv41-rank"]  # the directory of /run/dsv41-rank/container.id
    # A plan from a coordinator older than the agent has none: still started (the packages upgrade
    # independently); the floor then signals only the client.
    older = rankspec.check_launch(runtime="container", argv=argv[:i] + argv[i + 2:], env=node_plan.rank_spec.env,
                                  fills={}, binds=[], exec_start_pre=[], exec_stop_post=[], stop_timeout_s=10,
                                  memory_max=0, memory_high=0, fingerprint="ab", rank=1, generation="",
                                  fabric_address="", hcas=[], settings=agent_settings(ADAPTER_DIR=plan.ADAPTER_DIR))
    assert "--cidfile" not in older.argv


def test_unit_properties_carry_what_the_design_asks_for():
    cfg = config.parse(edited(RANK_RUNTIME="host", RANK_PYTHON="/opt/sglang/bin/python"), "cluster.env", HOME)
    node_plan = plan.render_node(cfg, "spark1")
    launch = launch_of(node_plan, agent_settings(ADAPTER_DIR=plan.ADAPTER_DIR))
    env = rankspec.fill_env(launch, {"roce_gid_index": "3"})
    props = {name: (sig, value) for name, sig, value in rankspec.unit_properties(launch, env, "spark1", "/var/lib/dsv41")}
    assert props["KillMode"] == ("s", "mixed")
    assert props["LimitMEMLOCK"] == ("t", 2**64 - 1)
    assert props["TimeoutStopUSec"] == ("t", 120 * 1_000_000)
    assert props["ExecStart"][1][0][1][:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
    assert "NCCL_IB_GID_INDEX=3" in props["Environment"][1]
    fields = props["LogExtraFields"][1]
    assert b"DSV41_NODE=spark1" in fields and b"DSV41_RANK=0" in fields
    assert "RuntimeDirectory" not in props  # the host runtime has no container id to write
    assert rankspec.fingerprint_from_fields(fields) == node_plan.fingerprint
    assert props["BindReadOnlyPaths"][1] == [("/home/op/NewModels/DeepSeek-V4.1-Flash",
                                              "/var/tmp/DeepSeek-V4.1-Flash", False, 0),
                                             ("/home/op/dsv41-engram", "/engram", False, 0)]
    # sandboxed; writes only its cache, which is also its home and working directory
    assert props["NoNewPrivileges"] == ("b", True) and props["ProtectSystem"] == ("s", "strict")
    assert props["ReadWritePaths"] == ("as", ["/var/cache/dsv41/rank"])
    assert "HOME=/var/cache/dsv41/rank" in props["Environment"][1]
    assert "PYTHONSAFEPATH=1" in props["Environment"][1]


@pytest.mark.parametrize("name", ["LD_PRELOAD", "LD_AUDIT", "PYTHONSTARTUP", "BASH_ENV", "PATH", "LD_FOO"])
def test_dangerous_environment_is_denied(name):
    with pytest.raises(rankspec.SpecDenied, match=name):
        rankspec.check_env({name: "x"}, agent_settings(), "host")


def test_settings_require_tls_unless_explicitly_insecure():
    with pytest.raises(settings.SettingsError, match="TLS_CA/TLS_CERT/TLS_KEY are required"):
        settings.parse("NODE_NAME=a\n", "agent.env", {})
    with pytest.raises(settings.SettingsError, match="NODE_NAME: is required"):
        settings.parse("INSECURE_NO_TLS=1\n", "agent.env", {})
    with pytest.raises(settings.SettingsError, match="FOO: unknown key"):
        settings.parse("NODE_NAME=a\nINSECURE_NO_TLS=1\nFOO=1\n", "agent.env", {})
