"""The coordinator against three real agents (each in its own booted systemd node) with the
stand-in engine: bring-up, failure paths, rank death, re-adoption, stop."""

from __future__ import annotations

import json
import time

import pytest

from tests.integration.simcluster import chat, ctl, no_rank_anywhere, rank_pids
from tests.integration.simfixtures import coordinator, nodes  # noqa: F401

pytestmark = pytest.mark.integration


def test_bring_up_to_serving_and_status_json_field_by_field(nodes, coordinator):
    c = coordinator()
    status = c.wait_phase("serving", "failed")
    assert status.phase == "serving", status.phase_detail
    head = nodes["spark1"]
    reply = chat(head.address)
    assert "42" in reply["choices"][0]["message"]["content"]
    proc = ctl(c, "status", "--json")
    assert proc.returncode == 0, proc.stderr
    body = json.loads(proc.stdout)
    assert body["phase"] == "serving" and body["coordinator_running"] is True
    assert body["ranks_running"] == 3 and body["ranks_total"] == 3
    assert body["endpoint"] == f"http://{head.address}:8888"
    assert body["generation"] and body["config_path"] == str(c.config)
    assert [n["name"] for n in body["nodes"]] == ["spark1", "spark2", "spark3"]
    for view, (name, node) in zip(body["nodes"], nodes.items()):
        assert view["agent_reachable"] is True and view["address"] == node.address
        assert view["status"]["node"] == name
        assert view["status"]["rank"]["active_state"] == "active"
        assert view["status"]["rank"]["fingerprint"] == view["plan_fingerprint"]
        assert int(view["status"]["rank"]["main_pid"]) == rank_pids({name: node})[name]
        assert int(view["status"]["memory"]["available_bytes"]) > 0
        assert view["fabric"]["ok"] is True
    human = ctl(c, "status")
    assert human.returncode == 0 and "SERVING" in human.stdout and "3/3 ranks" in human.stdout
    assert all(len(line) <= 80 for line in human.stdout.splitlines())


def test_a_killed_worker_rank_is_detected_and_the_cluster_restarted(nodes, coordinator):
    c = coordinator()
    c.wait_phase("serving")
    before = rank_pids(nodes)
    t0 = time.monotonic()
    nodes["spark3"].run(["kill", "-9", str(before["spark3"])])
    status = c.wait_phase("stopping", "restarting", "preflight", "launch", "health", timeout=5)
    detected = time.monotonic() - t0
    assert detected < 2.0, f"rank death noticed after {detected:.2f} s"
    status = c.wait_phase("serving", "failed", timeout=60)
    assert status.phase == "serving", status.phase_detail
    after = rank_pids(nodes)
    assert all(after[n] != before[n] for n in nodes)
    events = ctl(c, "events")
    assert "spark3 rank_exit" in events.stdout and "signal" in events.stdout
    assert status.last_incident.node == "spark3"


def test_a_restarted_coordinator_readopts_without_restarting_ranks(nodes, coordinator):
    c = coordinator()
    c.wait_phase("serving")
    before = rank_pids(nodes)
    c.kill()
    assert rank_pids(nodes) == before  # a killed coordinator leaves the ranks serving
    down = ctl(c, "status")
    assert down.returncode == 1 and "coordinator: not running" in down.stdout
    c2 = coordinator()
    status = c2.wait_phase("serving", "failed", timeout=30)
    assert status.phase == "serving" and "re-adopted" in status.phase_detail
    assert rank_pids(nodes) == before


def test_stop_confirms_on_every_node_that_no_rank_is_left(nodes, coordinator):
    c = coordinator()
    c.wait_phase("serving")
    assert c.terminate() == 0
    assert no_rank_anywhere(nodes)
    log = c.log.read_text()
    confirmed = [line for line in log.splitlines() if "DSV41_EVENT=rank_stop_confirmed" in line]
    assert [line.split(":")[0].lstrip("<6>") for line in confirmed] == ["spark1", "spark2", "spark3"]
    assert all("rank unit absent" in line or "rank unit inactive" in line for line in confirmed)
    assert confirmed[0].startswith("<6>spark1: stop clean")  # rank 0 first, and it drained


@pytest.mark.parametrize("extra, step, node, fragment", [
    ({"FABRIC_IFACE": "nope0"}, "fabric", "spark1", "nope0"),
    ({"OFFLOAD_MODE": "nvme"}, "pack", "spark1", "dsv41ctl pack"),
    ({"DSV41_SIM_LOAD_S": "600", "HEALTH_TIMEOUT_S": "3"}, "health", "spark1", "not healthy after 3 s"),
    ({"RANK_MEMORY_GIB": "1000"}, "preflight", "spark1", "RANK_MEMORY_GIB"),
])
def test_each_failed_step_names_the_cause_and_leaves_no_rank(nodes, coordinator, extra, step, node, fragment):
    c = coordinator(**extra)
    status = c.wait_phase("failed", "serving", timeout=60)
    assert status.phase == "failed"
    assert status.phase_detail.startswith(f"{step}: {node}: "), status.phase_detail
    assert fragment in status.phase_detail
    assert no_rank_anywhere(nodes)


def test_an_unreachable_agent_is_waited_for_and_fails_only_at_node_wait_timeout_naming_the_node(nodes, coordinator):
    nodes["spark3"].run(["systemctl", "stop", "dsv41-agent.service"])
    try:
        # long enough to see the phase waiting: a status call waits up to 3 s for the down agent
        c = coordinator(NODE_WAIT_TIMEOUT_S="10")
        status = c.wait_phase("waiting", "failed", "serving", timeout=60)
        assert status.phase == "waiting" and status.phase_detail.startswith("waiting for spark3: agent at ")
        status = c.wait_phase("failed", "serving", timeout=60)
        assert status.phase == "failed" and status.phase_detail.startswith("preflight: spark3: agent at ")
        assert status.phase_detail.endswith("(still unreachable after 10 s)"), status.phase_detail
        assert no_rank_anywhere(nodes)
        proc = ctl(c, "status")
        assert proc.returncode == 1 and "spark3" in proc.stdout and "down" in proc.stdout
    finally:
        nodes["spark3"].run(["systemctl", "start", "dsv41-agent.service"])


def test_a_bring_up_waits_without_a_limit_for_an_agent_that_comes_up_late(nodes, coordinator):
    """The coordinator started before a worker finished booting: phase waiting names it, and once
    its agent answers the cluster serves, with no restart attempt spent."""
    nodes["spark3"].run(["systemctl", "stop", "dsv41-agent.service"])
    try:
        c = coordinator()
        status = c.wait_phase("waiting", "failed", "serving", timeout=30)
        assert status.phase == "waiting", (status.phase, status.phase_detail)
        assert status.phase_detail.startswith("waiting for spark3: agent at "), status.phase_detail
        time.sleep(3)
        assert c.status().phase == "waiting"
    finally:
        nodes["spark3"].run(["systemctl", "start", "dsv41-agent.service"])
    status = c.wait_phase("serving", "failed", timeout=90)
    assert status.phase == "serving", status.phase_detail
    assert status.restart_attempt == 0
    assert "42" in chat(nodes["spark1"].address)["choices"][0]["message"]["content"]
