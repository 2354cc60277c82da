"""The collective bandwidth gate: nccl-tests' bus bandwidth, the floor decision and its message,
NCCL's transport from its INFO lines (recorded outputs, named below), the job's unit built from
the node's RankSpec, and the bring-up step over stand-in agents."""

import io

import pytest

from agent import collective as agent_collective
from agent import rankspec
from coordinator import config, plan
from coordinator.bringup import BringUp, StepContext, StepFailed
from coordinator.bringup import collective as step
from dsv41 import collective
from dsv41.journal import EventLog
from dsv41.v1 import agent_pb2 as pb
from tests.configtext import HOME, SEED_TEXT, edited
from tests.unit.test_rankspec import IMAGE, agent_settings, launch_of
from tests.rpcfailure import AbortContext, Aborted

pytestmark = pytest.mark.unit

# ------------------------------------------------------------------ recorded NCCL INFO lines
# Recorded outputs of NCCL_DEBUG=INFO runs published in public repositories and guides (not from
# these machines; the Sparks' own lines are to be recorded on the GPU machine):
# two Sparks over RoCE (a Spark operator's notes, NCCL 2.30.7)
SPARK_ROCE = [
    "spark-153d:7:19 [0] NCCL INFO Using network IB",
    "spark-153d:7:19 [0] NCCL INFO 8 coll channels, 0 collnet channels, 8 p2p channels",
    "spark-153d:7:19 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/IB/0",
]
# a multi-node job that fell back to TCP sockets (an ESM2 training job's log)
SOCKET_FALLBACK = [
    "esm2-worker-0:53:271 [0] NCCL INFO Channel 00/0 : 2[0] -> 3[0] [receive] via NET/Socket/0",
    "esm2-worker-0:53:271 [0] NCCL INFO Channel 01/0 : 2[0] -> 3[0] [receive] via NET/Socket/0",
    "esm2-worker-0:53:271 [0] NCCL INFO Channel 00/0 : 3[0] -> 0[0] [send] via NET/Socket/0",
]
# a node with two GPUs and an IB rail: shared memory inside the node, IB between (a tutorial's run)
MIXED = [
    "gpuserver1:15326 [0] NCCL INFO Using network IB",
    "gpuserver1:15326 [0] NCCL INFO Channel 00 : 0[0] -> 1[1] via SHM/direct/direct",
    "gpuserver1:15327 [1] NCCL INFO Channel 00/0 : 1[1] -> 2[0] [send] via NET/IB/0",
]
# GPUDirect RDMA over IB, and one node's NVLink/PCIe-only lines (guides on reading NCCL's log)
GDR = ["NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/0/GDRDMA"]
SINGLE_NODE = ["NCCL INFO Channel 00 : 0[0] -> 1[1] via P2P/IPC/read", "NCCL INFO Channel 01 : 0[0] -> 1[1] via SHM"]


def test_nccl_transports_read_from_recorded_info_lines():
    assert collective.inter_node_transport(SPARK_ROCE) == "NET/IB"
    assert collective.inter_node_transport(SOCKET_FALLBACK) == "NET/Socket"
    assert collective.nccl_transports(MIXED) == ("SHM", "NET/IB")
    assert collective.inter_node_transport(MIXED) == "NET/IB"
    assert collective.inter_node_transport(GDR) == "NET/IB"
    assert collective.inter_node_transport(SINGLE_NODE) == ""  # no network between nodes
    assert collective.nccl_transports(SINGLE_NODE) == ("P2P", "SHM")


def test_one_channel_on_sockets_is_what_the_gate_sees():
    assert collective.inter_node_transport(SPARK_ROCE + SOCKET_FALLBACK[:1]) == "NET/Socket"


# ------------------------------------------------------------------ arithmetic and decision

def test_bus_bandwidth_is_nccl_tests_definition():
    # 1 GB in 1 s among 2 ranks: algbw 1 GB/s, busbw x 2(n-1)/n = 1; among 3: x 4/3; among 8: x 7/4
    assert collective.bus_bandwidth_gbps(10**9, 1.0, 2) == pytest.approx(1.0)
    assert collective.bus_bandwidth_gbps(10**9, 1.0, 3) == pytest.approx(4 / 3)
    assert collective.bus_bandwidth_gbps(64 << 20, 0.0146, 2) == pytest.approx(4.596, abs=1e-3)
    with pytest.raises(ValueError):
        collective.bus_bandwidth_gbps(100, 0.0, 2)


def result(pairs: dict[str, float], group: float, backend="nccl", transport="NET/IB") -> collective.Result:
    figures = [collective.Figure(name, tuple(name.split("–")), 1 << 26, 0.01, gbps) for name, gbps in pairs.items()]
    figures.append(collective.Figure(collective.GROUP, ("spark1", "spark2", "spark3"), 1 << 26, 0.01, group))
    return collective.Result(backend, transport, tuple(figures))


FLOORS = collective.Floors(3.5, 2.5, "NET/IB")


def test_the_slowest_pair_below_the_floor_is_named_with_its_figure():
    verdict = collective.judge(result({"spark1–spark2": 4.6, "spark1–spark3": 0.71, "spark2–spark3": 1.2}, 0.9),
                               FLOORS)
    assert not verdict.ok
    assert verdict.reason == "spark1–spark3: 0.71 GB/s, floor 3.5 GB/s (COLLECTIVE_PAIR_MIN_GBPS)"


def test_the_group_floor_and_the_transport_fail_when_the_pairs_pass():
    verdict = collective.judge(result({"spark1–spark2": 4.6}, 2.0), FLOORS)
    assert verdict.reason == "all 3 nodes: 2.00 GB/s, floor 2.5 GB/s (COLLECTIVE_GROUP_MIN_GBPS)"
    socket = collective.judge(result({"spark1–spark2": 4.6}, 4.0, transport="NET/Socket"), FLOORS)
    assert not socket.ok and socket.reason.startswith("NCCL chose NET/Socket, not NET/IB")
    assert collective.judge(result({"spark1–spark2": 4.6}, 4.0), FLOORS).ok
    # gloo has no NCCL transport to check
    assert collective.judge(result({"spark1–spark2": 4.6}, 4.0, "gloo", ""), FLOORS).ok


def test_the_result_line_round_trips_and_the_last_one_counts():
    line = result({"spark1–spark2": 4.6}, 4.0).to_line()
    assert line.startswith(collective.RESULT_PREFIX) and "\n" not in line
    assert collective.parse_result_line(["noise", "old " + result({}, 1.0).to_line(), line]) == \
        result({"spark1–spark2": 4.6}, 4.0)
    assert collective.parse_result_line(["no result here"]) is None


# ------------------------------------------------------------------ the agent's job unit

def spec_for(changes: dict, node: str = "spark2"):
    cfg = config.parse(edited(IMAGE=IMAGE, **changes), "cluster.env", HOME)
    node_plan = next(p for p in plan.render_cluster(cfg, dspark_tables=True) if p.node == node)
    return cfg, node_plan, launch_of(node_plan, agent_settings(ADAPTER_DIR=plan.ADAPTER_DIR))


def props_of(launch, facts=None):
    return {key: value for key, _, value in agent_collective.job_properties(
        launch, facts or {"roce_gid_index": "3"}, ["--rank", "1"], "spark2", "/var/cache/dsv41/rank", 60)}


def test_the_container_job_is_the_ranks_docker_run_with_the_jobs_command():
    _, node_plan, launch = spec_for({})
    props = props_of(launch)
    (exe, argv, _), = props["ExecStart"]
    rank_argv = list(node_plan.rank_spec.argv)
    image_at = rank_argv.index("python3")
    assert argv[:image_at] == rank_argv[:image_at]  # the same docker run, binds, -e and image
    assert argv[image_at:] == ["python3", "-m", "adapter.collective_bench", "--rank", "1"]
    env = dict(e.split("=", 1) for e in props["Environment"])
    assert env["NCCL_IB_GID_INDEX"] == "3"  # the GID index the agent fills in, as for the rank
    assert "DSV41_SOURCE" not in env  # the adapters' patches stay out of the job
    assert props["SyslogIdentifier"] == "dsv41-collective-test"
    assert b"DSV41_UNIT=dsv41-collective-test" in props["LogExtraFields"]
    assert not any(f.startswith(b"DSV41_FINGERPRINT") for f in props["LogExtraFields"])
    assert props["RuntimeMaxUSec"] == 90 * rankspec.USEC
    assert props["ProtectSystem"] == "strict" and props["NoNewPrivileges"] is True  # the rank's sandbox


def test_the_host_job_runs_the_ranks_python():
    _, _, launch = spec_for({"RANK_RUNTIME": "host", "RANK_PYTHON": "/opt/sglang/bin/python"})
    (exe, argv, _), = props_of(launch)["ExecStart"]
    assert argv == ["/opt/sglang/bin/python", "-m", "adapter.collective_bench", "--rank", "1"]


def test_the_stand_in_engine_cannot_run_the_job():
    _, _, launch = spec_for({"RANK_RUNTIME": "host", "RANK_ENGINE": "sim"})
    with pytest.raises(agent_collective.JobRefused, match="COLLECTIVE_GATE=0"):
        props_of(launch)


# ------------------------------------------------------------------ the step over stand-in agents

class Agent:
    def __init__(self, node, reply):
        self.node, self.target, self.reply, self.specs = node, f"{node}:7441", reply, []

    def run_collective_test(self, spec, timeout):
        self.specs.append(spec)
        return self.reply


def figures_pb(pairs: dict[str, float], group: float):
    out = [pb.CollectiveTestFigure(group=n, nodes=n.split("–"), message_bytes=1 << 26, seconds=0.01, busbw_gbps=g)
           for n, g in pairs.items()]
    return out + [pb.CollectiveTestFigure(group="all", nodes=["spark1", "spark2", "spark3"], busbw_gbps=group)]


def run_step(replies: dict[str, pb.CollectiveTestResult], **changes):
    cfg = config.parse(edited(**changes), "cluster.env", HOME)
    out = io.StringIO()
    log = EventLog("test", {}, stream=out, use_journal=False)
    agents = {n: Agent(n, r) for n, r in replies.items()}
    bring = BringUp(plans=tuple(plan.render_cluster(cfg, dspark_tables=True)), generation="g1")
    ctx = StepContext("collective", cfg, agents, log, bring, wait=pytest.fail,
                      call=lambda fn, to_end=False: fn(), monotonic=lambda: 0.0, set_detail=lambda d: None)
    try:
        step.run(ctx, 120)
    finally:
        ctx.out = out.getvalue()
    return ctx, agents


GOOD = figures_pb({"spark1–spark2": 4.6, "spark1–spark3": 4.5, "spark2–spark3": 4.4}, 3.9)


def test_the_step_runs_every_node_at_the_heads_dist_port_and_keeps_the_figures():
    replies = {n: pb.CollectiveTestResult(node=n, ok=True, backend="nccl", transport="NET/IB", figures=GOOD)
               for n in ("spark1", "spark2", "spark3")}
    ctx, agents = run_step(replies)
    spec = agents["spark3"].specs[0]
    assert (spec.master_port, spec.backend, list(spec.nodes)) == (20000, "nccl", ["spark1", "spark2", "spark3"])
    assert spec.master_addr == ctx.cfg.text("HEAD_IP") and spec.rank.rank == 2
    report = ctx.bring.collective
    assert report.ok and report.pair_floor_gbps == 3.5 and report.transports["spark2"] == "NET/IB"
    assert "spark1–spark3 4.50 GB/s" in ctx.out


def test_a_slow_pair_fails_the_step_naming_it():
    slow = figures_pb({"spark1–spark2": 4.6, "spark1–spark3": 0.71, "spark2–spark3": 4.4}, 3.0)
    replies = {n: pb.CollectiveTestResult(node=n, ok=True, backend="nccl", transport="NET/IB", figures=slow)
               for n in ("spark1", "spark2", "spark3")}
    with pytest.raises(StepFailed, match="spark1–spark3: 0.71 GB/s, floor 3.5 GB/s"):
        run_step(replies)


def test_a_node_on_sockets_fails_the_step_naming_it():
    replies = {n: pb.CollectiveTestResult(node=n, ok=True, backend="nccl", figures=GOOD,
                                          transport="NET/Socket" if n == "spark3" else "NET/IB")
               for n in ("spark1", "spark2", "spark3")}
    with pytest.raises(StepFailed, match="spark3: NCCL chose NET/Socket"):
        run_step(replies)


def test_a_job_that_printed_no_result_fails_the_step_with_its_log():
    replies = {n: pb.CollectiveTestResult(node=n, ok=True, backend="gloo", figures=GOOD) for n in ("spark1", "spark2")}
    replies["spark3"] = pb.CollectiveTestResult(node="spark3", ok=False, detail="printed no result (exit 1)")
    with pytest.raises(StepFailed) as info:
        run_step(replies, COLLECTIVE_BACKEND="gloo")
    assert info.value.node == "spark3" and "printed no result" in info.value.reason


def test_the_gate_is_skipped_when_off_and_gloo_is_chosen_for_cpu_ranks():
    assert step.STEP.skip(config.parse(edited(COLLECTIVE_GATE="0"), "cluster.env", HOME))
    assert not step.STEP.skip(config.parse(SEED_TEXT, "cluster.env", HOME))
    assert step.STEP.skip_warning[0] == "collective_gate_off"
    cpu = edited(RANK_DEVICE="cpu", OFFLOAD_MODE="host", SPEC_ALGO="NONE", RANK_RUNTIME="host",
                 RANK_PYTHON="/opt/sglang/bin/python")
    assert step.backend(config.parse(cpu, "cluster.env", HOME)) == "gloo"
    assert step.backend(config.parse(SEED_TEXT, "cluster.env", HOME)) == "nccl"
    assert step.floors(config.parse(edited(NCCL_IB_DISABLE="1"), "cluster.env", HOME)).transport == ""


# ------------------------------------------------------------------ the agent's RPC over a stand-in systemd

class Systemd:
    """Answers the job unit's properties in turn: running, then ended (or never ended)."""

    def __init__(self, states):
        self.states, self.started, self.stopped, self.resets = list(states), [], [], 0

    def properties(self, name, interfaces):
        if not self.started:
            return None
        state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        return None if state is None else {"ActiveState": state, "InvocationID": b"\x01\x02",
                                           "Result": "exit-code", "ExecMainStatus": 1}

    def start_transient(self, name, props, timeout_s):
        self.started.append((name, dict((k, v) for k, _, v in props)))
        return type("Job", (), {"result": "done"})()

    def stop(self, name, timeout_s):
        self.stopped.append(name)

    def reset_failed(self, name):
        self.resets += 1


class Rank:
    def __init__(self, running):
        self.running = running

    def status(self):
        return type("Status", (), {"running": self.running})()


class RankRpcs:
    def __init__(self, launch):
        self.launch = launch

    def checked_launch(self, spec, context):
        return self.launch

    def node_facts(self, launch, context):
        return {"roce_gid_index": "3"}


def rpc(systemd, lines, running=False, clock=None):
    _, node_plan, launch = spec_for({})
    s = agent_settings(ADAPTER_DIR=plan.ADAPTER_DIR)
    events = EventLog("test", {}, stream=io.StringIO(), use_journal=False)
    now = clock or [0.0]

    def sleep(seconds):
        now[0] += seconds
    server = agent_collective.CollectiveTestRpcs(s, systemd, events, Rank(running), RankRpcs(launch),
                                                 read_lines=lambda invocation: lines, monotonic=lambda: now[0],
                                                 sleep=sleep)
    spec = pb.CollectiveTestSpec(rank=pb.RankSpec(rank=1), master_addr="10.0.0.1", master_port=20000,
                                 nodes=["spark1", "spark2", "spark3"], backend="nccl", message_bytes=1 << 26,
                                 iterations=10, warmup_iterations=3, timeout_s=60)
    return server.RunCollectiveTest(spec, AbortContext())


def test_the_rpc_runs_the_job_unit_and_returns_its_result_line():
    systemd = Systemd(["active", "active", None])
    line = result({"spark1–spark2": 4.6}, 4.0).to_line()
    reply = rpc(systemd, ["NCCL INFO ...", line])
    assert reply.ok and reply.transport == "NET/IB" and reply.figures[0].busbw_gbps == 4.6
    (name, props), = systemd.started
    assert name == "dsv41-collective-test.service"
    assert "--master-addr" in props["ExecStart"][0][1] and not systemd.stopped


def test_the_rpc_refuses_while_the_rank_runs():
    with pytest.raises(Aborted, match="the rank is running"):
        rpc(Systemd([None]), [], running=True)


def test_a_job_that_prints_no_result_gives_its_exit_and_last_lines():
    reply = rpc(Systemd(["active", "failed"]), ["Traceback (most recent call last):", "RuntimeError: gloo timeout"])
    assert not reply.ok and "result exit-code, exit status 1" in reply.detail and "gloo timeout" in reply.detail


def test_a_job_past_its_deadline_is_stopped():
    systemd = Systemd(["active"])
    reply = rpc(systemd, [])
    assert systemd.stopped == ["dsv41-collective-test.service"] and not reply.ok and "timeout" in reply.detail


def test_status_prints_the_gates_figures_and_its_failure():
    from coordinator.ctl_cluster import collective_line
    report = pb.CollectiveTestReport(ok=False, reason="spark1–spark3: 0.71 GB/s, floor 3.5 GB/s", backend="nccl",
                                     transports={"spark1": "NET/IB"}, pair_floor_gbps=3.5, group_floor_gbps=2.5,
                                     figures=figures_pb({"spark1–spark3": 0.71}, 3.0))
    text, ok = collective_line(report)
    assert not ok
    assert text == ("collective gate (nccl via NET/IB): spark1–spark3 0.71 GB/s, all 3.00 GB/s (floors 3.5 per "
                    "pair, 2.5 GB/s the group); FAILED: spark1–spark3: 0.71 GB/s, floor 3.5 GB/s")
