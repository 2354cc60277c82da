"""The model gateway's unit on the head (agent/gateway.py): built from the head's RankSpec as the
rank jobs are (the rank's container or Python, or GATEWAY_PYTHON on the host), long-running and
restarted on failure, its fingerprint in its environment; SetGateway's keep / restart / stop over a
stand-in systemd; and the wrapper's handling of the key (adapter/gateway.py) over a stand-in parser."""

from __future__ import annotations

import argparse
import io

import grpc
import pytest

from adapter import gateway as wrapper
from agent import gateway, rankspec
from agent.rankjob import JobRefused
from coordinator import config, plan
from dsv41.journal import EventLog
from dsv41.v1 import agent_pb2 as pb
from tests.configtext import HOME, edited
from tests.unit.test_rankspec import IMAGE, agent_settings, launch_of
from tests.rpcfailure import AbortContext, Aborted

pytestmark = pytest.mark.unit

ROUTER = "/opt/router/bin/python"
ARGS = ["--host", "10.0.0.1", "--port", "30000", "--policy", "round_robin"]


def settings(**over):
    return agent_settings(ADAPTER_DIR=plan.ADAPTER_DIR, ALLOWED_PYTHONS=f"/opt/sglang/bin/python,{ROUTER}", **over)


def head_launch(**changes):
    cfg = config.parse(edited(IMAGE=IMAGE, API_KEY_FILE="/etc/dsv41/api-key", **changes), "cluster.env", HOME)
    head = plan.render_cluster(cfg, dspark_tables=True)[0]
    return launch_of(head, settings())


def props_of(launch, python="", args=ARGS, stop_timeout_s=75):
    run = gateway.gateway_launch(launch, python, args, settings())
    props, fp = gateway.gateway_properties(run, {"roce_gid_index": "3"}, "spark1", "/var/cache/dsv41/rank",
                                           stop_timeout_s)
    return {key: value for key, _, value in props}, fp


def env_of(props) -> dict[str, str]:
    return dict(e.split("=", 1) for e in props["Environment"])


# ------------------------------------------------------------------ the unit's properties

def test_the_container_gateway_is_the_ranks_docker_run_under_its_own_name():
    launch = head_launch()
    props, fp = props_of(launch)
    (exe, argv, _), = props["ExecStart"]
    image_at = argv.index(IMAGE)
    assert argv[image_at + 1:] == ["python3", "-m", "adapter.gateway", *ARGS]
    assert argv[argv.index("--name") + 1] == "dsv41-gateway"  # never the rank's container
    assert argv[argv.index("--cidfile") + 1] == "/run/dsv41-gateway/container.id"
    assert props["RuntimeDirectory"] == ["dsv41-gateway"]
    # Its clean-up removes its own container, never the rank's that runs beside it.
    assert [c[1] for c in props["ExecStartPre"]] == [["/usr/bin/docker", "rm", "--force", "dsv41-gateway"]]
    assert [c[1] for c in props["ExecStopPost"]] == [["/usr/bin/docker", "rm", "--force", "dsv41-gateway"]]
    assert "dsv41-rank" not in " ".join(argv)
    env = env_of(props)
    assert env["DSV41_API_KEY_FILE"] == plan.CONTAINER_API_KEY_PATH and "-e" in argv
    assert f"{plan.API_KEY_NODE_PATH}:{plan.CONTAINER_API_KEY_PATH}:ro" in argv
    assert env["NCCL_IB_GID_INDEX"] == "3" and "DSV41_SOURCE" not in env
    assert env[gateway.FINGERPRINT_ENV] == fp


def test_the_unit_is_long_running_restarted_on_failure_and_named_for_the_journal():
    props, _ = props_of(head_launch(), stop_timeout_s=75)
    assert "RuntimeMaxUSec" not in props
    assert props["Restart"] == "on-failure" and props["RestartUSec"] == 2 * rankspec.USEC
    assert props["TimeoutStopUSec"] == 75 * rankspec.USEC
    assert props["SyslogIdentifier"] == "dsv41-gateway"
    assert props["LogExtraFields"] == [b"DSV41_NODE=spark1", b"DSV41_UNIT=dsv41-gateway"]  # no floor, no plan
    assert props["ProtectSystem"] == "strict" and props["NoNewPrivileges"] is True  # the rank's sandbox
    assert "model gateway" in props["Description"]


def test_the_host_gateway_runs_the_ranks_python():
    props, _ = props_of(head_launch(RANK_RUNTIME="host", RANK_PYTHON="/opt/sglang/bin/python"))
    (exe, argv, _), = props["ExecStart"]
    assert argv == ["/opt/sglang/bin/python", "-m", "adapter.gateway", *ARGS]
    env = env_of(props)
    assert env["PYTHONPATH"] == plan.ADAPTER_DIR and env["DSV41_API_KEY_FILE"] == plan.API_KEY_NODE_PATH
    assert "RuntimeDirectory" not in props and "ExecStartPre" not in props


def test_gateway_python_runs_on_the_host_with_the_host_view_of_a_container_ranks_environment():
    props, _ = props_of(head_launch(), python=ROUTER)
    (exe, argv, _), = props["ExecStart"]
    assert argv == [ROUTER, "-m", "adapter.gateway", *ARGS]
    env = env_of(props)
    assert env["PYTHONPATH"] == plan.ADAPTER_DIR
    assert env["DSV41_API_KEY_FILE"] == plan.API_KEY_NODE_PATH  # the key file's bind source
    assert env["HOME"] == "/var/cache/dsv41/rank" and props["ReadWritePaths"] == ["/var/cache/dsv41/rank"]
    assert not {"ExecStartPre", "ExecStopPost", "RuntimeDirectory", "BindPaths"} & set(props)


def test_gateway_python_serves_a_stand_in_head_whose_runtime_has_no_python():
    sim = head_launch(RANK_RUNTIME="host", RANK_ENGINE="sim")
    with pytest.raises(JobRefused, match="needs a Python with sglang_router \\(set GATEWAY_PYTHON"):
        props_of(sim)
    props, _ = props_of(sim, python=ROUTER)
    assert props["ExecStart"][0][1][:3] == [ROUTER, "-m", "adapter.gateway"]


def test_gateway_python_must_be_an_allowed_python():
    with pytest.raises(rankspec.SpecDenied, match="ALLOWED_PYTHONS"):
        props_of(head_launch(), python="/usr/local/bin/python3")
    with pytest.raises(rankspec.SpecInvalid, match="absolute path"):
        props_of(head_launch(), python="python3")


def test_the_fingerprint_is_stable_and_follows_the_args_and_the_environment():
    launch = head_launch()
    _, fp = props_of(launch)
    assert props_of(launch)[1] == fp and len(fp) == 16
    assert props_of(launch, args=[*ARGS, "--retry-max-retries", "3"])[1] != fp
    assert props_of(launch, python=ROUTER)[1] != fp
    other_env = head_launch(NCCL_DEBUG="INFO")
    assert props_of(other_env)[1] != fp
    props, _ = props_of(launch)
    assert gateway.fingerprint_of({"Environment": props["Environment"]}) == fp
    assert gateway.fingerprint_of(None) == ""


@pytest.mark.parametrize("args", [["--api-key", "K"], ["--api-key=K"], ["--api-k", "K"],
                                  ["--control-plane-api-keys", "a:b:admin:K"]])
def test_a_key_in_the_args_is_refused(args):
    with pytest.raises(rankspec.SpecInvalid, match="the key comes from DSV41_API_KEY_FILE"):
        gateway.check_args(["--port", "30000", *args])


def test_args_are_flags_on_one_line():
    assert gateway.check_args(ARGS) == tuple(ARGS)
    with pytest.raises(rankspec.SpecInvalid, match="flags"):
        gateway.check_args(["30000"])
    with pytest.raises(rankspec.SpecInvalid, match="one line"):
        gateway.check_args(["--host", "a\nb"])


# ------------------------------------------------------------------ SetGateway over a stand-in systemd

class Systemd:
    """One unit: started with its properties, stopped, reset; active until stopped."""

    def __init__(self, state=None):
        self.unit = state  # the unit's properties, or None when not loaded
        self.calls: list[str] = []

    def properties(self, name, interfaces):
        assert name == gateway.UNIT
        return None if self.unit is None else dict(self.unit)

    def start_transient(self, name, props, timeout_s):
        assert self.unit is None or self.unit["ActiveState"] == "inactive", "StartTransientUnit: unit exists"
        self.calls.append("start")
        values = {k: v for k, _, v in props}
        self.unit = {"ActiveState": "active", "MainPID": 4242, "InvocationID": b"\xab\xcd",
                     "Environment": values["Environment"], "TimeoutStopUSec": values["TimeoutStopUSec"]}
        return type("Job", (), {"result": "done"})()

    def stop(self, name, timeout_s):
        self.calls.append(f"stop {timeout_s:.0f}")
        self.unit = None

    def reset_failed(self, name):
        self.calls.append("reset")
        if self.unit and self.unit["ActiveState"] == "failed":
            self.unit = None


class RankRpcs:
    def __init__(self, launch, problems=()):
        self.launch, self.problems = launch, list(problems)

    def checked_launch(self, spec, context):
        return self.launch

    def node_facts(self, launch, context):
        return {"roce_gid_index": "3"}

    def launch_problems(self, launch):
        self.checked = launch.trust
        return self.problems


def server(systemd, problems=()):
    out = io.StringIO()
    events = EventLog("test", {}, stream=out, use_journal=False)
    rpcs = gateway.GatewayRpcs(settings(), systemd, events, RankRpcs(head_launch(), problems),
                               monotonic=lambda: 0.0, sleep=lambda s: None)
    return rpcs, out


def spec(run=True, args=ARGS, python=""):
    return pb.GatewaySpec(rank=pb.RankSpec(rank=0), python=python, args=args, run=run, stop_timeout_s=75)


def running(fp):
    return {"ActiveState": "active", "MainPID": 99, "InvocationID": b"\x01",
            "Environment": [f"{gateway.FINGERPRINT_ENV}={fp}"], "TimeoutStopUSec": 75 * rankspec.USEC}


def test_a_gateway_not_running_is_started_and_its_fingerprint_kept_with_the_unit():
    systemd = Systemd()
    rpcs, out = server(systemd)
    state = rpcs.SetGateway(spec(), AbortContext())
    assert systemd.calls == ["reset", "start"]
    assert (state.message, state.active_state, state.main_pid, state.invocation_id) == \
        ("started", "active", 4242, "abcd")
    assert state.fingerprint == props_of(head_launch())[1]
    assert "gateway_started" in out.getvalue()


def test_the_same_gateway_running_is_kept():
    systemd = Systemd()
    rpcs, out = server(systemd)
    first = rpcs.SetGateway(spec(), AbortContext())
    systemd.calls.clear()
    again = rpcs.SetGateway(spec(), AbortContext())
    assert systemd.calls == [] and again.message == "kept" and again.fingerprint == first.fingerprint
    assert "gateway_kept" in out.getvalue()


def test_a_changed_gateway_is_stopped_then_started():
    systemd = Systemd(running("0123456789abcdef"))
    rpcs, _ = server(systemd)
    state = rpcs.SetGateway(spec(args=[*ARGS, "--retry-max-retries", "3"]), AbortContext())
    assert systemd.calls == ["stop 90", "reset", "reset", "start"]  # the grace period + 15 s to stop
    assert state.message == "restarted" and state.fingerprint != "0123456789abcdef"


def test_a_failed_gateway_is_reset_and_started():
    systemd = Systemd({**running("0123456789abcdef"), "ActiveState": "failed"})
    rpcs, _ = server(systemd)
    state = rpcs.SetGateway(spec(), AbortContext())
    assert systemd.calls == ["reset", "start"] and state.message == "started"


def test_run_false_stops_it_and_answers_inactive():
    systemd = Systemd(running("0123456789abcdef"))
    rpcs, out = server(systemd)
    state = rpcs.SetGateway(spec(run=False), AbortContext())
    assert systemd.calls == ["stop 90", "reset"]
    assert (state.active_state, state.message, state.main_pid) == ("inactive", "stopped", 0)
    assert "gateway_stopped" in out.getvalue()
    systemd.calls.clear()
    assert rpcs.SetGateway(spec(run=False), AbortContext()).active_state == "inactive" and systemd.calls == []


def test_a_key_in_the_args_is_refused_before_anything_starts():
    systemd = Systemd()
    rpcs, _ = server(systemd)
    with pytest.raises(Aborted) as info:
        rpcs.SetGateway(spec(args=["--api-key", "K"]), AbortContext())
    assert info.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT and systemd.calls == []


def test_gateway_python_is_checked_as_code_root_alone_may_have_written():
    systemd = Systemd()
    rpcs, _ = server(systemd, problems=[f"{ROUTER}: owned by uid 1000, not root"])
    with pytest.raises(Aborted) as info:
        rpcs.SetGateway(spec(python=ROUTER), AbortContext())
    assert info.value.args[0] == grpc.StatusCode.PERMISSION_DENIED and systemd.calls == []
    assert rpcs._rank_rpcs.checked[0].path == ROUTER and rpcs._rank_rpcs.checked[0].code


def test_a_stop_timeout_out_of_range_is_refused():
    rpcs, _ = server(Systemd())
    with pytest.raises(Aborted, match="stop_timeout_s 0"):
        rpcs.SetGateway(pb.GatewaySpec(rank=pb.RankSpec(rank=0), args=ARGS, run=True), AbortContext())


# ------------------------------------------------------------------ the wrapper's key (adapter/gateway.py)

def parse(argv):
    """Stands in for sglang_router's parse_router_args: the two fields the wrapper reads."""
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None)
    p.add_argument("--control-plane-api-keys", nargs="*", default=[])
    return p.parse_args(argv)


def test_the_wrapper_sets_the_key_from_the_file(tmp_path):
    path = tmp_path / "key"
    path.write_text("sekrit-key-1234\n")
    path.chmod(0o600)
    args = wrapper.router_args(["--port", "31000"], {"DSV41_API_KEY_FILE": str(path)}, parse)
    assert (args.port, args.api_key) == (31000, "sekrit-key-1234")
    assert wrapper.router_args([], {}, parse).api_key is None  # no key file: no key


@pytest.mark.parametrize("argv", [["--api-key", "K"], ["--api-k=K"], ["--control-plane-api-keys", "a:b:admin:K"]])
def test_the_wrapper_refuses_a_key_on_the_command_line(argv):
    with pytest.raises(wrapper.Refused, match="the key comes from DSV41_API_KEY_FILE"):
        wrapper.router_args(argv, {}, parse)


def test_the_wrapper_refuses_a_key_file_it_cannot_use(tmp_path):
    with pytest.raises(wrapper.Refused, match="no such file"):
        wrapper.router_args([], {"DSV41_API_KEY_FILE": str(tmp_path / "missing")}, parse)
