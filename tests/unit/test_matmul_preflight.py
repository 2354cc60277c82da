"""The pre-launch matrix-product check's path: the agent's RunMatmulCheck over a stand-in systemd
(the same unit machinery as the collective test), and preflight's decision over stand-in agents."""

from __future__ import annotations

import io

import pytest

from agent import matmul as agent_matmul
from coordinator import config, plan
from coordinator.bringup import BringUp, StepContext, StepFailed
from coordinator.bringup import matmul as preflight_matmul
from dsv41.journal import EventLog
from dsv41.matmul import MatmulResult, result_line
from dsv41.v1 import agent_pb2 as pb
from tests.configtext import HOME, edited
from tests.rpcfailure import AbortContext, Aborted
from tests.unit.test_collective import Rank, RankRpcs, Systemd, spec_for
from tests.unit.test_rankspec import agent_settings

pytestmark = pytest.mark.unit

LINE = result_line(MatmulResult(96.4, "NVIDIA GB10", "bfloat16", 8192, 20, 0.228))


def rpc(systemd, lines, running=False, spec=None):
    _, _, launch = spec_for({})
    events = EventLog("test", {}, stream=io.StringIO(), use_journal=False)
    now = [0.0]

    def sleep(seconds):
        now[0] += seconds
    server = agent_matmul.MatmulCheckRpcs(agent_settings(ADAPTER_DIR=plan.ADAPTER_DIR), systemd, events,
                                          Rank(running), RankRpcs(launch), read_lines=lambda invocation: lines,
                                          monotonic=lambda: now[0], sleep=sleep)
    return server.RunMatmulCheck(spec or pb.MatmulCheckSpec(rank=pb.RankSpec(rank=1), iterations=20, timeout_s=60),
                                 AbortContext())


def test_the_rpc_runs_the_job_in_the_ranks_runtime_and_returns_its_figures():
    systemd = Systemd(["active", "inactive"])
    reply = rpc(systemd, ["torch warning", LINE])
    assert reply.ok and reply.tflops == 96.4 and reply.device == "NVIDIA GB10" and reply.size == 8192
    (name, props), = systemd.started
    assert name == "dsv41-matmul-check.service"
    argv = props["ExecStart"][0][1]
    assert argv[argv.index("python3"):] == ["python3", "-m", "adapter.matmul_check", "--size", "0",
                                            "--iterations", "20"]
    assert props["SyslogIdentifier"] == "dsv41-matmul-check"


def test_the_rpc_refuses_while_the_rank_runs_and_bad_arguments():
    with pytest.raises(Aborted, match="the rank is running: the matrix-product check"):
        rpc(Systemd([None]), [], running=True)
    with pytest.raises(Aborted, match="iterations 1..10000"):
        rpc(Systemd([None]), [], spec=pb.MatmulCheckSpec(rank=pb.RankSpec(rank=1), iterations=0, timeout_s=60))


def test_a_job_without_its_line_gives_its_exit_and_last_lines():
    reply = rpc(Systemd(["active", "failed"]), ["matmul_check: torch is not importable in this runtime"])
    assert not reply.ok and "exit status 1" in reply.detail and "torch is not importable" in reply.detail


def test_the_stand_in_engine_is_refused_naming_the_switch():
    _, _, launch = spec_for({"RANK_RUNTIME": "host", "RANK_ENGINE": "sim"})
    from agent import rankjob
    with pytest.raises(rankjob.JobRefused, match="PREFLIGHT_TFLOPS_MIN=0"):
        rankjob.job_properties(agent_matmul.JOB, launch, {}, [], "spark2", "/var/cache/dsv41/rank", 60)


class Agent:
    def __init__(self, node, reply):
        self.node, self.target, self.reply, self.specs = node, f"{node}:7441", reply, []

    def run_matmul_check(self, spec, timeout):
        self.specs.append(spec)
        return self.reply


def check(replies: dict[str, pb.MatmulCheckResult], **changes) -> tuple[dict[str, Agent], str]:
    cfg = config.parse(edited(**changes), "cluster.env", HOME)
    out = io.StringIO()
    agents = {n: Agent(n, r) for n, r in replies.items()}
    ctx = StepContext("preflight", cfg, agents, EventLog("test", {}, stream=out, use_journal=False),
                      BringUp(plans=tuple(plan.render_cluster(cfg, dspark_tables=True)), generation="g1"),
                      wait=pytest.fail, call=lambda fn, to_end=False: fn(), monotonic=lambda: 0.0,
                      set_detail=lambda d: None)
    preflight_matmul.check(ctx)
    return agents, out.getvalue()


def reply(node: str, tflops: float) -> pb.MatmulCheckResult:
    return pb.MatmulCheckResult(node=node, ok=True, tflops=tflops, device="NVIDIA GB10", dtype="bfloat16", size=8192,
                                iterations=20, seconds=0.2)


def test_off_by_default_no_node_is_asked():
    agents, out = check({n: reply(n, 1.0) for n in ("spark1", "spark2", "spark3")})
    assert not any(a.specs for a in agents.values()) and out == ""


def test_every_node_is_asked_with_its_rank_spec_and_the_figures_are_logged():
    agents, out = check({n: reply(n, 95.0 - i) for i, n in enumerate(("spark1", "spark2", "spark3"))},
                        PREFLIGHT_TFLOPS_MIN="60")
    spec = agents["spark3"].specs[0]
    assert spec.rank.rank == 2 and spec.iterations == 20 and spec.timeout_s == 120
    assert "matrix-product check: spark1 95, spark2 94, spark3 93 TFLOPS (floor 60)" in out


def test_the_slowest_node_below_the_floor_fails_preflight_naming_it():
    replies = {"spark1": reply("spark1", 95.0), "spark2": reply("spark2", 41.0), "spark3": reply("spark3", 58.0)}
    with pytest.raises(StepFailed) as info:
        check(replies, PREFLIGHT_TFLOPS_MIN="60")
    assert info.value.node == "spark2"
    assert info.value.reason.startswith("41.0 TFLOPS on NVIDIA GB10 (bfloat16 8192³ x 20), floor 60 TFLOPS")


def test_a_node_whose_job_failed_fails_preflight_with_its_log():
    replies = {n: reply(n, 95.0) for n in ("spark1", "spark2")}
    replies["spark3"] = pb.MatmulCheckResult(node="spark3", ok=False, detail="printed no result (exit status 1)")
    with pytest.raises(StepFailed) as info:
        check(replies, PREFLIGHT_TFLOPS_MIN="60")
    assert info.value.node == "spark3" and "matrix-product check: printed no result" in info.value.reason
