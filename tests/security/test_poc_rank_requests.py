"""Finding 1: StartRank and EnsureMount requests that passed the agent's validation and ran code as
root on the node. Each request below was accepted by agent/rankspec.py and agent/nfs/spec.py as
they were; the agent must refuse every one, saying what is allowed. (The same requests against the
real agent over gRPC: test_poc_rank_requests_agent.py.)"""

from __future__ import annotations

import os

import pytest

from agent import rankspec, settings
from agent.nfs.errors import Denied, Invalid
from agent.nfs.spec import check_mount, check_mount_allowed
from agent.pathtrust import PathTrust, PathUse
from coordinator import config, plan
from tests.configtext import HOME, edited

pytestmark = pytest.mark.unit

PYTHON = "/opt/sglang/bin/python"
SIM = "/usr/bin/dsv41-sim-rank"
IMAGE = "lmsysorg/sglang:dev-dsv41@sha256:" + "3d" * 32
ADAPTER = "/usr/share/dsv41/rank"
ROOTS = "/srv/dsv41,/var/tmp/DeepSeek-V4.1-Flash"


def agent_settings(**over) -> settings.AgentSettings:
    values = {"NODE_NAME": "spark2", "INSECURE_NO_TLS": "1", "ALLOWED_RUNTIMES": "container,host",
              "ALLOWED_IMAGES": IMAGE, "ALLOWED_PYTHONS": PYTHON, "ALLOWED_EXECUTABLES": SIM,
              "ALLOWED_PATHS": ROOTS, **over}
    return settings.parse("".join(f"{k}={v}\n" for k, v in values.items()), "agent.env", {})


def host(argv, env=None, binds=()):
    return rankspec.check_launch(
        runtime="host", argv=argv, env={"PYTHONPATH": ADAPTER, **(env or {})}, fills={}, binds=list(binds),
        exec_start_pre=[], exec_stop_post=[], stop_timeout_s=10, memory_max=0, memory_high=0, fingerprint="ab",
        rank=1, generation="g", fabric_address="", hcas=[], settings=agent_settings())


def container_plan(**changes):
    cfg = config.parse(edited(IMAGE=IMAGE, MODEL_DIR="/srv/dsv41/DeepSeek-V4.1-Flash", NCCL_HOST_DIR="/srv/dsv41/nccl",
                              ENGRAM_DIR="/srv/dsv41/engram", **changes), "cluster.env", HOME)
    return plan.render_node(cfg, "spark1").rank_spec


def container(argv, env=None):
    spec = container_plan()
    return rankspec.check_launch(
        runtime="container", argv=argv, env=spec.env if env is None else env, fills={}, binds=[],
        exec_start_pre=spec.exec_start_pre, exec_stop_post=spec.exec_stop_post, stop_timeout_s=10, memory_max=0,
        memory_high=0, fingerprint="ab", rank=1, generation="g", fabric_address="", hcas=[],
        settings=agent_settings())


SGLANG = [PYTHON, "-m", "sglang.launch_server", "--model-path", "/srv/dsv41/m"]


def test_the_plans_the_coordinator_renders_still_pass():
    for runtime in ("container", "host"):
        spec = container_plan(RANK_RUNTIME=runtime, RANK_PYTHON=PYTHON)
        launch = rankspec.check_launch(
            runtime=spec.runtime, argv=spec.argv, env=spec.env, fills=spec.agent_fills,
            binds=[(b.source, b.target, b.read_only) for b in spec.binds], exec_start_pre=spec.exec_start_pre,
            exec_stop_post=spec.exec_stop_post, stop_timeout_s=10, memory_max=0, memory_high=0, fingerprint="ab",
            rank=1, generation="g", fabric_address="10.0.0.2", hcas=["rocep1s0f0"], settings=agent_settings())
        # what only the node can tell is handed to the agent: the model and NCCL directories' owners
        assert {u.path for u in launch.trust} >= {"/srv/dsv41/DeepSeek-V4.1-Flash", "/srv/dsv41/nccl"}
        assert {u.path for u in launch.trust if u.code} >= {"/srv/dsv41/nccl", ADAPTER}


@pytest.mark.parametrize("argv, why", [
    ([PYTHON, "-c", "import os; os.system('id > /root/pwned')"], "runs only `/opt/sglang/bin/python -m sglang"),
    ([PYTHON, "/srv/dsv41/m/evil.py"], "runs only"),
    ([PYTHON, "-m", "http.server"], "runs only"),
    ([PYTHON, "-m", "sglang.launch_server", "-c", "x"], "takes the rank's flags"),
    ([SIM, "/srv/dsv41/script.py"], "takes the rank's flags"),
    (["/bin/sh", "-c", "id"], "not allowed on this node"),
])
def test_the_host_runtime_runs_a_fixed_entry_only(argv, why):
    with pytest.raises(rankspec.SpecDenied, match=why):
        host(argv)


def test_an_interpreter_cannot_be_listed_as_an_entry_point():
    with pytest.raises(settings.SettingsError, match="runs any code its arguments name"):
        agent_settings(ALLOWED_EXECUTABLES="/usr/bin/python3")
    with pytest.raises(settings.SettingsError, match="runs any code its arguments name"):
        agent_settings(ALLOWED_EXECUTABLES="/bin/bash")


@pytest.mark.parametrize("env, why", [
    ({"LD_LIBRARY_PATH": "/var/lib/dsv41/state"}, "code is never loaded from /var/lib/dsv41"),
    ({"LD_LIBRARY_PATH": "/tmp"}, "code is never loaded from /tmp"),
    ({"LD_LIBRARY_PATH": "/dev/shm/x"}, "code is never loaded from /dev/shm"),
    ({"LD_LIBRARY_PATH": "/home/op/nccl"}, "not under this node's ALLOWED_PATHS"),
    ({"NCCL_NET_PLUGIN": "/var/lib/dsv41/state/libnccl-net.so"}, "code is never loaded from /var/lib/dsv41"),
    ({"CUDA_INJECTION64_PATH": "/tmp/x.so"}, "code is never loaded from /tmp"),
    ({"OPENSSL_CONF": "/var/lib/dsv41/state/openssl.cnf"}, "env OPENSSL_CONF: not allowed for a rank"),
    ({"PYTHONWARNINGS": "ignore::antigravity.x", "BROWSER": "sh -c id"}, "not allowed for a rank"),
    ({"PYTHONPYCACHEPREFIX": "/var/lib/dsv41/state"}, "a cache must be under /var/cache/dsv41/rank"),
    ({"SGLANG_CACHE_DIR": "/tmp/c"}, "a cache must be under /var/cache/dsv41/rank"),
    ({"DOCKER_HOST": "tcp://10.9.9.9:2375"}, "env DOCKER_HOST: not allowed for a rank"),
    ({"DOCKER_CONFIG": "/var/lib/dsv41/state"}, "env DOCKER_CONFIG: not allowed for a rank"),
    ({"PYTHONPATH": "/var/lib/dsv41/state"}, "must be this node's adapter directory"),
    ({"NCCL_DEBUG_FILE": "/etc/cron.d/nccl"}, "a rank may not mount this path"),
    ({"NCCL_TOPO_FILE": "/proc/1/root/x"}, "a rank may not mount this path"),
])
def test_environment_is_an_allow_list_and_loader_paths_are_checked(env, why):
    with pytest.raises(rankspec.SpecDenied, match=why):
        host(SGLANG, env)


def test_paths_in_the_flags_lie_under_the_allowed_roots(tmp_path):
    with pytest.raises(rankspec.SpecDenied, match="a rank may not mount this path"):
        host([PYTHON, "-m", "sglang.launch_server", "--model-path", "/etc/ssh"])
    launch = host(SGLANG + ["--crash-dump-folder", "/srv/dsv41/dumps"])
    assert PathUse("/srv/dsv41/m", "argv /srv/dsv41/m", must_exist=False) in launch.trust
    # Outside the roots only where nothing of the node's is: checked on the node.
    outside = host([PYTHON, "-m", "sglang.launch_server", "--model-path", "/home/op/model"])
    assert outside.targets == ("/home/op/model",)
    (tmp_path / "home" / "op" / "model").mkdir(parents=True)
    (tmp_path / "home" / "op" / "model" / "modeling.py").write_text("import os")
    trust = PathTrust(str(tmp_path), owner=os.getuid())
    assert "exists on this node outside ALLOWED_PATHS" in trust.shadow_problem("/home/op/model")
    assert trust.shadow_problem("/engram") is None


@pytest.mark.parametrize("target", ["/var/lib/docker", "/usr/share/dsv41-agent", "/lib/systemd/system",
                                    "/usr/local/sbin", "/var/spool/cron", "/opt", "/srv"])
def test_no_read_write_bind_onto_system_paths(target):
    spec = container_plan()
    argv = list(spec.argv)
    with pytest.raises(rankspec.SpecDenied, match="the only read-write bind is the cache|read-write binds are refused"):
        container(argv[:2] + ["-v", f"{target}:/x:rw"] + argv[2:])
    with pytest.raises(rankspec.SpecDenied, match="read-write binds are refused"):
        host(SGLANG, binds=[("/srv/dsv41/m", target, False)])
    # read-only, a system path is no bind source either
    with pytest.raises(rankspec.SpecDenied):
        container(argv[:2] + ["-v", f"{target}:/x:ro"] + argv[2:])


def test_the_container_must_run_hardened():
    argv = list(container_plan().argv)
    assert container(argv).runtime == "container"
    for flag, value in rankspec.REQUIRED_DOCKER_FLAGS:
        i = next(i for i in range(len(argv) - 1) if argv[i] == flag and argv[i + 1] == value)
        with pytest.raises(rankspec.SpecDenied, match=f"must run with {flag} {value}"):
            container(argv[:i] + argv[i + 2:])
    image = argv.index(IMAGE)
    with pytest.raises(rankspec.SpecDenied, match="the container runs `python3 -m sglang.launch_server FLAGS`"):
        container(argv[:image + 1] + ["sh", "-c", "id"])
    with pytest.raises(rankspec.SpecDenied, match="--security-opt seccomp=unconfined: not allowed"):
        container(argv[:2] + ["--security-opt", "seccomp=unconfined"] + argv[2:])


def test_mounts_are_nosuid_nodev_from_an_allowed_server_under_the_allowed_roots():
    good = dict(what="10.0.22.1:/", where="/var/tmp/DeepSeek-V4.1-Flash", type="nfs4",
                options="nfsvers=4.2,ro,nosuid,nodev,hard", server="10.0.22.1", expected_shards=48)
    check_mount_allowed(check_mount(**good), ("/var/tmp/DeepSeek-V4.1-Flash",), ("10.0.22.1",))
    with pytest.raises(Invalid, match="must include nosuid, nodev"):
        check_mount(**{**good, "options": "nfsvers=4.2,ro,hard"})
    for where in ("/opt/dsv41", "/usr/local/lib/x", "/usr/local/bin"):
        with pytest.raises((Invalid, Denied)):
            check_mount_allowed(check_mount(**{**good, "where": where}), ("/var/tmp/DeepSeek-V4.1-Flash",),
                                ("10.0.22.1",))
    with pytest.raises(Denied, match="not in this node's ALLOWED_MOUNT_SERVERS"):
        check_mount_allowed(check_mount(**{**good, "what": "10.9.9.9:/", "server": "10.9.9.9"}),
                            ("/var/tmp/DeepSeek-V4.1-Flash",), ("10.0.22.1",))


def test_a_directory_someone_else_could_write_is_refused_with_the_fix(tmp_path):
    # The test's own uid plays root; another uid plays the user who owns a directory on the path.
    me = os.getuid()
    (tmp_path / "srv" / "model").mkdir(parents=True)
    (tmp_path / "srv").chmod(0o755)
    (tmp_path / "srv" / "model").chmod(0o755)
    trust = PathTrust(str(tmp_path), owner=me)
    assert trust.problem(PathUse("/srv/model", "model")) is None
    (tmp_path / "srv").chmod(0o775)
    why = trust.problem(PathUse("/srv/model", "bind source"))
    assert why.startswith("bind source /srv/model: /srv is writable by group (mode 0775)") and "chmod go-w /srv" in why
    (tmp_path / "srv").chmod(0o1777)  # like /var/tmp: accepted above data, never above code
    assert trust.problem(PathUse("/srv/model", "model")) is None
    assert "writable by group and other (mode 1777)" in trust.problem(PathUse("/srv/model", "lib", code=True))
    (tmp_path / "srv").chmod(0o755)
    other = PathTrust(str(tmp_path), owner=me + 1)  # now every file is someone else's
    assert f"/ is owned by uid {me}, not root" in other.problem(PathUse("/srv/model", "model"))
    link = tmp_path / "evil"
    link.symlink_to("srv/model")
    assert trust.problem(PathUse("/evil", "model")) is None  # root's link: followed, and its target checked
    if os.geteuid() == 0:  # CI runs as root: a link a user owns is not followed
        os.lchown(link, 65534, 65534)
        assert "/evil is a symbolic link owned by uid 65534" in trust.problem(PathUse("/evil", "model"))
    assert "does not exist" in trust.problem(PathUse("/srv/none", "model"))


def test_paths_are_compared_as_the_kernel_resolves_them():
    for env in ({"LD_LIBRARY_PATH": "/srv/dsv41/lib/../../../tmp"}, {"NCCL_TOPO_FILE": "//etc/shadow"},
                {"DSV41_SOURCE": "/srv/dsv41/m/../../../etc"}):
        with pytest.raises((rankspec.SpecInvalid, rankspec.SpecDenied)):
            host(SGLANG, env)
