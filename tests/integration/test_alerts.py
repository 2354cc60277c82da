"""The coordinator's alerts and metrics against three real agents with the stand-in engine: the
incident hook receives a rank-exit incident; a failing and a hanging hook leave the coordinator
unaffected; the metrics count the incident and the restart and show the phase move."""

from __future__ import annotations

import json
import os
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.agentnode import free_port
from tests.integration.simcluster import Coordinator, boot, cluster_env
from tests.integration.test_coordinator import rank_pids

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def nodes(rootfs):
    cluster = boot(rootfs)
    try:
        yield cluster.nodes
    finally:
        cluster.stop()


@pytest.fixture
def coordinator(nodes, tmp_path):
    made = []

    def start(**extra) -> Coordinator:
        c = Coordinator(tmp_path, cluster_env(nodes, **extra)).start()
        made.append(c)
        return c
    yield start
    for c in made:
        if c.proc.poll() is None:
            c.terminate()
    for node in nodes.values():
        node.run(["systemctl", "stop", "dsv41-rank.service"], check=False)
        node.run(["systemctl", "reset-failed"], check=False)


def hook(tmp_path, body: str) -> str:
    hooks = tmp_path / "hooks"
    hooks.mkdir(exist_ok=True)
    os.chmod(hooks, 0o755)
    path = hooks / "alert"
    path.write_text("#!/bin/sh\n" + body)
    os.chmod(path, 0o755)  # owned by root (the tests run as root), writable by nobody else
    return str(path)


def wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def kill_rank(nodes, name: str) -> dict:
    before = rank_pids(nodes)
    nodes[name].run(["kill", "-9", str(before[name])])
    return before


def restarted(c: Coordinator, nodes, before: dict, timeout: float = 60.0) -> None:
    """Serving again with new ranks everywhere."""
    def done():
        status = c.status()
        return status.phase == "serving" and all(rank_pids(nodes)[n] not in (0, before[n]) for n in nodes)
    wait(done, timeout, "the cluster serving again with new ranks")


def test_the_hook_gets_a_rank_exit_incident_and_the_metrics_count_it(nodes, coordinator, tmp_path):
    out = tmp_path / "hook-out"
    out.mkdir()
    os.chmod(out, 0o777)
    path = hook(tmp_path, f'n=$(date +%s%N)\nenv | grep ^DSV41_INCIDENT_ > {out}/$n.env\ncat > {out}/$n.json\n')
    port = free_port()
    c = coordinator(INCIDENT_HOOK=path, METRICS_LISTEN=f"127.0.0.1:{port}", METRICS_POLL_S="0.5")
    c.wait_phase("serving")

    def scrape() -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    first = wait(lambda: (m := scrape()).get(("dsv41_agent_up", (("node", "spark3"),))) == 1 and m, 10,
                 "the first status poll")
    assert first[("dsv41_phase", (("phase", "serving"),))] == 1
    assert first[("dsv41_ranks_running", ())] == 3
    assert first[("dsv41_bringup_step_seconds_count", (("step", "launch"),))] == 1
    assert first.get(("dsv41_incidents_total", (("kind", "rank_exit"), ("node", "spark3"))), 0) == 0
    assert first[("dsv41_node_memory_available_bytes", (("node", "spark2"),))] > 0
    assert ("dsv41_node_psi_some_avg10", (("node", "spark1"), ("resource", "memory"))) in first
    before = kill_rank(nodes, "spark3")
    phases = set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the phase gauge through the restart
        m = scrape()
        phases |= {dict(labels)["phase"] for (name, labels), v in m.items() if name == "dsv41_phase" and v == 1}
        if m.get(("dsv41_bringup_step_seconds_count", (("step", "launch"),))) == 2 and "serving" in phases - {None} \
                and m[("dsv41_phase", (("phase", "serving"),))] == 1:
            break
        time.sleep(0.05)
    restarted(c, nodes, before)
    after = scrape()
    assert phases - {"serving"}, f"no other phase seen during the restart: {phases}"
    assert after[("dsv41_incidents_total", (("kind", "rank_exit"), ("node", "spark3")))] == 1
    assert after[("dsv41_restarts_total", ())] == 1
    assert after[("dsv41_bringup_step_seconds_count", (("step", "launch"),))] == 2
    assert after[("dsv41_phase", (("phase", "serving"),))] == 1

    got = wait(lambda: sorted(out.glob("*.json")), 20, "the hook's run")
    body = json.loads(got[0].read_text())
    assert body["kind"] == "rank_exit" and body["node"] == "spark3"
    assert body["message"].startswith("rank on spark3 died first: ") and "status 9" in body["message"]
    assert abs(body["at_unix_s"] - time.time()) < 120 and body["at"].endswith("+00:00")
    env = dict(line.split("=", 1) for line in got[0].with_suffix(".env").read_text().splitlines())
    assert env["DSV41_INCIDENT_KIND"] == "rank_exit" and env["DSV41_INCIDENT_NODE"] == "spark3"
    assert env["DSV41_INCIDENT_MESSAGE"] == body["message"] and env["DSV41_INCIDENT_AT"] == body["at"]
    wait(lambda: "DSV41_EVENT=incident_hook_done" in c.log.read_text(), 10, "the hook's journal event")
    assert wait(lambda: scrape().get(("dsv41_incident_hook_runs_total", (("outcome", "ok"),))) == 1, 10,
                "the hook's run counted")


@pytest.mark.parametrize("body, outcome", [
    ("echo the webhook refused >&2\nexit 22\n", "exit 22"),
    ("exec sleep 600\n", "killed after 30 s"),
])
def test_a_failing_or_hanging_hook_leaves_the_coordinator_unaffected(nodes, coordinator, tmp_path, body, outcome):
    c = coordinator(INCIDENT_HOOK=hook(tmp_path, body), INCIDENT_HOOK_TIMEOUT_S="30")
    c.wait_phase("serving")
    before = kill_rank(nodes, "spark2")
    t0 = time.monotonic()
    c.wait_phase("stopping", "restarting", "preflight", "launch", "health", timeout=5)
    assert time.monotonic() - t0 < 2.0  # the exit is handled at once, whatever the hook does
    restarted(c, nodes, before)
    assert time.monotonic() - t0 < 30  # serving again before a hanging hook's timeout ends it
    started = time.monotonic()
    assert c.status().phase == "serving" and time.monotonic() - started < 5  # the control socket answers
    def failure_logged() -> str:
        text = c.log.read_text()
        return text if "DSV41_EVENT=incident_hook_failed" in text else ""
    log = wait(failure_logged, 60, "the hook's failure in the journal")
    failed = [line for line in log.splitlines() if "DSV41_EVENT=incident_hook_failed" in line]
    assert len(failed) == 1 and f"failed: {outcome}" in failed[0] and "for rank_exit on spark2" in failed[0]
    if "exit 22" in outcome:
        assert "it said: the webhook refused" in failed[0]
    assert c.proc.poll() is None  # still running
    assert c.terminate() == 0
