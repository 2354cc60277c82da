"""Operator actions preempt a bring-up, and an agent lost in the middle of a step fails that step:
the coordinator against three real agents (each in its own booted systemd node) with the stand-in
engine, which answers /health 503 while it "loads" (DSV41_SIM_LOAD_S) as SGLang does for minutes."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from dsv41.v1 import control_pb2 as cpb
from tests.integration.simcluster import Coordinator, chat, ctl, no_rank_anywhere
from tests.integration.simfixtures import coordinator, nodes  # noqa: F401

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_pack_checkpoint import write_checkpoint  # noqa: E402

pytestmark = pytest.mark.integration
SLOW_LOAD = {"DSV41_SIM_LOAD_S": "90", "HEALTH_TIMEOUT_S": "300"}


def wait_until(predicate, timeout: float, step: float = 0.05) -> float:
    """Seconds until predicate() held; AssertionError at the timeout."""
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, f"not within {timeout} s"
        time.sleep(step)
    return time.monotonic() - t0


def launches(c: Coordinator) -> int:
    return c.log.read_text().count("DSV41_EVENT=rank_launched")


def test_a_stop_during_health_leaves_no_rank_on_any_node_within_10_s(nodes, coordinator):
    c = coordinator(**SLOW_LOAD)
    c.wait_phase("health", timeout=60)
    t0 = time.monotonic()
    stopped = ctl(c, "stop")
    assert stopped.returncode == 0, stopped.stderr
    answered = time.monotonic() - t0
    wait_until(lambda: no_rank_anywhere(nodes), timeout=10)
    took = time.monotonic() - t0
    print(f"dsv41ctl stop answered after {answered:.2f} s; no rank after {took:.2f} s")
    status = c.wait_phase("stopped", timeout=5)
    assert status.phase_detail == "requested by dsv41ctl stop"
    assert took < 10, f"ranks gone after {took:.1f} s"
    time.sleep(1.0)
    assert c.status().phase == "stopped" and launches(c) == 3  # one bring-up, cancelled


def test_sigterm_during_health_returns_within_20_s_and_leaves_no_rank(nodes, coordinator):
    c = coordinator(**SLOW_LOAD)
    c.wait_phase("health", timeout=60)
    t0 = time.monotonic()
    assert c.terminate(timeout=20) == 0
    took = time.monotonic() - t0
    assert took < 20, f"the coordinator took {took:.1f} s to stop"
    assert no_rank_anywhere(nodes)
    log = c.log.read_text()
    confirmed = [line for line in log.splitlines() if "DSV41_EVENT=rank_stop_confirmed" in line]
    told = [line for line in log.splitlines() if "DSV41_EVENT=rank_stop" in line or "DSV41_EVENT=node_unheard" in line]
    assert [line.split(":")[0].lstrip("<6>") for line in confirmed] == ["spark1", "spark2", "spark3"], told


def test_a_restart_then_a_stop_queued_during_a_bring_up_ends_stopped_without_a_second_bring_up(nodes, coordinator):
    c = coordinator(**SLOW_LOAD)
    c.wait_phase("health", timeout=60)
    stub = c.stub()
    assert stub.Restart(cpb.RestartRequest(), timeout=30).ok
    assert stub.Stop(cpb.StopRequest(), timeout=30).ok
    c.wait_phase("stopped", timeout=30)
    assert no_rank_anywhere(nodes)
    time.sleep(2.0)
    assert c.status().phase == "stopped"
    assert launches(c) == 3, c.log.read_text()[-3000:]


def test_an_agent_stopped_during_pack_fails_the_pack_step_naming_the_node_and_the_restart_goes_on(
        nodes, coordinator, tmp_path):
    model = write_checkpoint(tmp_path / "model", {1: 1001, 14: 4001})
    for node in nodes.values():
        node.run(["sh", "-c", "rm -rf /var/tmp/model /var/tmp/engram && mkdir -p /var/tmp/engram"])
        node.copy_in(model, "/var/tmp/model")
    c = coordinator(OFFLOAD_MODE="nvme", SKIP_PREPARE="0", RESTART_BACKOFF_S="4", PREFLIGHT_TIMEOUT_S="120")
    c.wait_phase("pack", timeout=60)
    # Gone before the step starts the node's pack job, or by its next poll (every 2 s): either way
    # the pack step fails naming the node. Not waited for: the agent's own shutdown goes on for seconds
    # after its port closed (the server's grace, its threads), and on a loaded machine the restart's
    # 4 s backoff could pass meanwhile.
    nodes["spark2"].run(["systemctl", "stop", "--no-block", "dsv41-agent.service"])
    try:
        status = c.wait_phase("restarting", "failed", timeout=30)
        assert status.phase == "restarting", status.phase_detail
        assert status.phase_detail.startswith("attempt 1/3 in 4 s after: pack: spark2: agent at "), status.phase_detail
        # a stopped agent: its port refuses, or the connection it had drops (coordinator.transport's words)
        assert (" refusing connections: dsv41-agent not running" in status.phase_detail
                or " dropped the connection" in status.phase_detail), status.phase_detail
        assert (status.last_incident.kind, status.last_incident.node) == ("pack_failed", "spark2")
        events = ctl(c, "events")
        assert "spark2 pack_failed" in events.stdout, events.stdout
        assert "internal error" not in c.log.read_text()
        # the next attempt waits for the agent
        status = c.wait_phase("waiting", timeout=15)
        assert status.phase_detail.startswith("waiting for spark2: agent at ")
    finally:
        nodes["spark2"].run(["systemctl", "start", "dsv41-agent.service"])
    status = c.wait_phase("serving", "failed", timeout=120)
    assert status.phase == "serving", status.phase_detail
    assert status.restart_attempt == 1
    assert "42" in chat(nodes["spark1"].address)["choices"][0]["message"]["content"]
    ctl(c, "stop")
    c.wait_phase("stopped", timeout=30)
    for node in nodes.values():
        node.run(["rm", "-rf", "/var/tmp/engram/"], check=False)
        node.run(["mkdir", "-p", "/var/tmp/engram", "/var/tmp/model"])
