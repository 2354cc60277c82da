"""Three real systemd nodes with the .deb packages, driven as an operator would (the scenarios run in
file order: each test starts from the cluster the previous one left; scenario 8 starts the stopped
cluster again with the weights shared over NFS)."""

from __future__ import annotations

import base64
import io
import json
import re
import subprocess
import tarfile
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dsv41.version import VERSION

from testbed.sparks import SIM, boot_sparks, build_debs, ctl, install, rank_pids, status, wait_serving
from tests.cluster.sparks import (coordinator_events, incidents, install_nfs_client_standin, new_incident, unit_pid,
                                  wait_for)
from tests.integration.simcluster import cluster_env
from tests.integration.test_guard_memory import GUARD_BYTES, GUARD_ENV, HEADROOM, RUNAWAY_TOKENS, HeadMemory, run_once
from tests.integration.test_mount_unit import model_dir

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def debs(tmp_path_factory):
    v1 = build_debs(tmp_path_factory.mktemp("debs-v1"))
    v2 = build_debs(tmp_path_factory.mktemp("debs-v2"), suffix="+1")
    return v1, v2


# Scenario 8: the head exports a host directory (nfs-ganesha needs file handles, which the nodes'
# overlay root cannot give, and open_by_handle_at); every node sees it read-only at MODEL_DIR, and
# the workers' NFS client stand-in bind-mounts that copy once the export is really served.
MODEL_DIR, COMMON_MODEL, SHARDS = "/srv/dsv41-model", "/var/tmp/dsv41-model", 3


@pytest.fixture(scope="module")
def sparks(rootfs, debs, tmp_path_factory):
    model = model_dir(tmp_path_factory.mktemp("model"), shards=SHARDS)
    # ROLLOUT_CONFIRM_S=0: see tests.integration.simcluster.cluster_env
    cluster = boot_sparks(rootfs, debs[0], node_options={"binds_ro": [f"{model}:{MODEL_DIR}"],
                                                        "syscalls": ["open_by_handle_at"]},
                          ROLLOUT_CONFIRM_S="0", **GUARD_ENV)
    try:
        yield cluster.nodes
    finally:
        cluster.stop()


def head_of(sparks):
    return sparks["spark1"]


def shared_weights_env(sparks, **extra: str) -> str:
    """cluster.env with the weights exported by the head (nfs-ganesha) and mounted by the workers."""
    head, workers = head_of(sparks), [sparks["spark2"], sparks["spark3"]]
    return cluster_env(sparks, SIM_RANK_COMMAND=SIM, NFS_SHARE="1", NFS_BACKEND="ganesha",
                       NFS_CLIENTS=",".join(w.address for w in workers), NFS_SERVER_IP_1=head.address,
                       NFS_SERVER_IP_2=head.address, MODEL_DIR=MODEL_DIR, COMMON_MODEL=COMMON_MODEL,
                       EXPECTED_SHARDS=str(SHARDS), **{**GUARD_ENV, **extra})


def test_1_start_brings_the_cluster_to_serving(sparks):
    head = head_of(sparks)
    head.run(["systemctl", "start", "dsv41-coordinator.service"], timeout=60)
    body = wait_serving(head)
    assert body["ranks_running"] == 3 and body["ranks_total"] == 3
    human = ctl(head, "status")
    assert human.returncode == 0 and "SERVING" in human.stdout and "3/3 ranks" in human.stdout
    question = json.dumps({"model": "deepseek-v4.1-flash", "messages": [{"role": "user", "content": "19+23?"}]})
    reply = head.run(["python3", "-c", "import sys, urllib.request; r = urllib.request.urlopen(urllib.request.Request("
                      f"'http://{head.address}:8888/v1/chat/completions', data=sys.argv[1].encode(), "
                      "headers={'Content-Type': 'application/json'}), timeout=20); print(r.read().decode())",
                      question])
    answer = json.loads(reply.stdout)
    assert "42" in answer["choices"][0]["message"]["content"]
    assert answer["choices"][0]["finish_reason"] == "stop"
    # The stand-in's runtime has no torch: the collective gate is off, and the bring-up says so.
    off = head.journal(unit="dsv41-coordinator.service", fields=None, matches=["DSV41_EVENT=collective_gate_off"])
    assert off and "COLLECTIVE_GATE=0" in off[-1]["MESSAGE"], off
    assert "collective" not in body


def test_2_a_killed_rank_is_detected_and_the_cluster_restarted(sparks):
    head, spark3 = head_of(sparks), sparks["spark3"]
    before = rank_pids(status(head))
    spark3.run(["kill", "-9", str(unit_pid(spark3, "dsv41-rank.service"))])
    after = wait_serving(head, changed_from=before)
    assert all(after_pid != before[name] for name, after_pid in rank_pids(after).items())
    events = ctl(head, "events").stdout
    assert "spark3 rank_exit" in events and "killed status 9" in events
    logged = head.journal(unit="dsv41-coordinator.service", fields=None, matches=["DSV41_EVENT=incident"])
    assert logged and logged[-1]["DSV41_NODE_NAME"] == "spark3" and logged[-1]["PRIORITY"] == "3"
    assert "died first" in logged[-1]["MESSAGE"]


def metrics(head) -> dict:
    """GET http://HEAD:9441/metrics from the test machine, parsed by prometheus_client's parser."""
    with urllib.request.urlopen(f"http://{head.address}:9441/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


ISSUE_FAMILIES = ("dsv41_phase", "dsv41_ranks_running", "dsv41_incidents_total", "dsv41_restarts_total",
                  "dsv41_bringup_step_seconds_bucket", "dsv41_agent_up", "dsv41_node_memory_available_bytes",
                  "dsv41_node_psi_some_avg10", "dsv41_guard_actions_total", "dsv41_guard_lowest_margin_bytes",
                  "dsv41_mount_healthy", "dsv41_pack_complete")


def test_2a_the_metrics_move_when_a_rank_is_killed(sparks):
    head, spark2 = head_of(sparks), sparks["spark2"]
    before = metrics(head)
    assert before[("dsv41_phase", (("phase", "serving"),))] == 1 and before[("dsv41_ranks_running", ())] == 3
    assert before[("dsv41_incidents_total", (("kind", "rank_exit"), ("node", "spark3")))] == 1  # scenario 2
    restarts = before[("dsv41_restarts_total", ())]
    launches = before[("dsv41_bringup_step_seconds_count", (("step", "launch"),))]
    assert restarts >= 1 and launches >= 2
    assert all(before[("dsv41_agent_up", (("node", n),))] == 1 for n in sparks)
    pids = rank_pids(status(head))
    spark2.run(["kill", "-9", str(unit_pid(spark2, "dsv41-rank.service"))])
    phases = set()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        m = metrics(head)
        phases |= {dict(labels)["phase"] for (name, labels), v in m.items() if name == "dsv41_phase" and v == 1}
        if m[("dsv41_bringup_step_seconds_count", (("step", "launch"),))] > launches and \
                m[("dsv41_phase", (("phase", "serving"),))] == 1:
            break
        time.sleep(0.05)
    wait_serving(head, changed_from=pids)
    after = metrics(head)
    assert phases - {"serving"}, f"the phase never left serving: {phases}"
    assert after[("dsv41_incidents_total", (("kind", "rank_exit"), ("node", "spark2")))] == 1
    assert after[("dsv41_restarts_total", ())] == restarts + 1
    assert after[("dsv41_phase", (("phase", "serving"),))] == 1
    found = {name for name, _ in after}
    missing = [f for f in ISSUE_FAMILIES if f not in found]
    # No worker mounts (NFS_SHARE=0) and no packs needed (OFFLOAD_MODE=host) in this configuration;
    # guard actions are counted by scenario 7.
    assert missing == ["dsv41_guard_actions_total", "dsv41_mount_healthy", "dsv41_pack_complete"], missing
    assert 0 < after[("dsv41_guard_lowest_margin_bytes", ())]


def test_3_restarting_an_agent_keeps_its_rank(sparks):
    head, spark2 = head_of(sparks), sparks["spark2"]
    rank = unit_pid(spark2, "dsv41-rank.service")
    agent = unit_pid(spark2, "dsv41-agent.service")
    spark2.run(["systemctl", "restart", "dsv41-agent.service"], timeout=60)
    assert unit_pid(spark2, "dsv41-agent.service") != agent
    assert unit_pid(spark2, "dsv41-rank.service") == rank
    time.sleep(1.0)
    body = status(head)
    assert body["phase"] == "serving" and rank_pids(body)["spark2"] == rank


def test_4_a_killed_coordinator_is_restarted_and_readopts_the_ranks(sparks):
    head = head_of(sparks)
    pids = rank_pids(status(head))
    coordinator = unit_pid(head, "dsv41-coordinator.service")
    head.run(["kill", "-9", str(coordinator)])
    deadline = time.monotonic() + 30
    while unit_pid(head, "dsv41-coordinator.service") in (0, coordinator) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert unit_pid(head, "dsv41-coordinator.service") not in (0, coordinator), "systemd restarted it"
    body = wait_serving(head)
    assert rank_pids(body) == pids
    assert head.journal(unit="dsv41-coordinator.service", matches=["DSV41_EVENT=adopted"])
    for name, node in sparks.items():
        assert unit_pid(node, "dsv41-rank.service") == pids[name]


def test_5_upgrading_the_agents_while_serving_keeps_every_rank(sparks, debs):
    head = head_of(sparks)
    pids = rank_pids(status(head))
    for node in sparks.values():
        agent = unit_pid(node, "dsv41-agent.service")
        # the rank-side packages move together: dsv41-sim depends on dsv41-adapter of its own version
        install(node, debs[1], ["dsv41-adapter", "dsv41-agent", "dsv41-sim"], remote="/var/tmp/debs-v2")
        for package in ("dsv41-adapter", "dsv41-agent", "dsv41-sim"):  # upgraded, none removed by apt
            state = node.run(["dpkg-query", "-W", "-f", "${Status} ${Version}", package], check=False).stdout
            assert state.startswith("install ok installed") and state.endswith("+1"), (package, state)
        assert unit_pid(node, "dsv41-agent.service") != agent  # restarted by the upgrade
        assert unit_pid(node, "dsv41-rank.service") == pids[node.name]
    time.sleep(1.0)
    body = wait_serving(head)
    assert rank_pids(body) == pids


def test_5a_status_shows_ranks_running_the_adapter_older_than_installed(sparks):
    head = head_of(sparks)
    body = status(head)
    pids = rank_pids(body)
    new = f"{VERSION}+1"  # scenario 5's packages; every rank was started before them
    for view in body["nodes"]:
        assert (view["status"]["rank"]["adapter_version"], view["status"]["adapter_version"]) == (VERSION, new), view
    text = ctl(head, "status").stdout
    for name in sparks:
        assert f"{name}: rank runs adapter {VERSION}, {new} is installed: the next restart" in text, text
        assert unit_pid(sparks[name], "dsv41-rank.service") == pids[name]
    stale = {name: (("node", name),) for name in sparks}
    wait_for(lambda: all(metrics(head).get(("dsv41_rank_adapter_stale", key)) == 1 for key in stale.values()), 30,
             "dsv41_rank_adapter_stale is not 1 for every node")
    # The next planned restart loads the installed adapter, and status says nothing more about it.
    assert ctl(head, "restart").returncode == 0
    body = wait_serving(head, changed_from=pids)
    assert all(view["status"]["rank"]["adapter_version"] == new for view in body["nodes"]), body["nodes"]
    assert "rank runs adapter" not in ctl(head, "status").stdout


def test_7_a_runaway_prompt_is_aborted_by_the_memory_guard(sparks):
    head = head_of(sparks)
    pids = rank_pids(status(head))
    memory = HeadMemory(head)
    memory.limit_to(HEADROOM)
    memory.reset_peak()
    results: dict = {}
    normal, runaway = run_once(head, 0, results)
    normal.join(60)
    runaway.join(60)
    assert results["runaway-0"]["choices"][0]["finish_reason"] == "abort"
    assert results["normal-0"]["choices"][0]["finish_reason"] == "stop"
    assert memory.oom_kills() == 0 and memory.lowest_available() >= GUARD_BYTES
    aborts = head.journal(unit="dsv41-coordinator.service", fields=None, matches=["DSV41_EVENT=memory_abort"])
    assert aborts and aborts[-1]["DSV41_VICTIM_RID"] == "runaway-0"
    assert aborts[-1]["DSV41_VICTIM_PROMPT_TOKENS"] == str(RUNAWAY_TOKENS)
    body = status(head)
    assert body["phase"] == "serving" and rank_pids(body) == pids


def test_7a_the_guard_actions_are_in_the_metrics(sparks):
    m = metrics(head_of(sparks))
    assert m[("dsv41_guard_actions_total", (("action", "abort"),))] >= 1  # scenario 7's abort


API_KEY = "sk-bundle-" + "7f3a9c" * 6


def test_7b_the_bundle_holds_every_node_and_no_secret(sparks):
    head = head_of(sparks)
    # Secrets present as on a real head: an API key in use, the cluster CA's and every node's TLS keys.
    head.write_file("/etc/dsv41/api-key", API_KEY + "\n", mode=0o600)
    ctl(head, "pki", "init", check=True)
    for name in ("spark2", "spark3"):
        tar = head.run(["sh", "-c", f"dsv41ctl pki bundle {name} | base64 -w0"], check=True).stdout
        sparks[name].write_file("/var/tmp/pki.tar", base64.b64decode(tar))
        sparks[name].run(["tar", "-xpf", "/var/tmp/pki.tar", "-C", "/"])
    text = head.run(["cat", "/etc/dsv41/cluster.env"]).stdout
    head.write_file("/etc/dsv41/cluster.env", text + "API_KEY_FILE=/etc/dsv41/api-key\n", mode=0o640)
    head.run(["systemctl", "restart", "dsv41-coordinator.service"], timeout=120)
    pids = rank_pids(wait_serving(head))
    spark3 = sparks["spark3"]  # an incident of this coordinator's own for the bundle's events
    spark3.run(["kill", "-9", str(unit_pid(spark3, "dsv41-rank.service"))])
    wait_serving(head, changed_from=pids)
    assert head.host_path("/var/lib/dsv41/state/sglang-api-key").read_text().strip() == API_KEY
    keys = {}
    for name, directory in (("spark1", "/etc/dsv41/pki"), ("spark2", "/etc/dsv41/tls"), ("spark3", "/etc/dsv41/tls")):
        for path in sparks[name].host_path(directory).glob("*.key"):
            keys[f"{name}:{path.name}"] = path.read_bytes()
    assert len(keys) >= 3, keys.keys()

    made = ctl(head, "bundle", "-o", "/root/bundle.tar")
    assert made.returncode == 0, made.stderr
    assert made.stdout.startswith("wrote /root/bundle.tar (") and "from the coordinator" in made.stdout
    assert made.stderr == ""
    assert head.run(["stat", "-c", "%a", "/root/bundle.tar"]).stdout.strip() == "600"
    again = ctl(head, "bundle", "-o", "/root/bundle.tar")
    assert again.returncode == 1 and "exists" in again.stderr
    with tarfile.open(fileobj=io.BytesIO(head.host_path("/root/bundle.tar").read_bytes())) as tar:
        content = {m.name.split("/", 1)[1]: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    for name in sparks:
        for part in ("proc/meminfo", "proc/buddyinfo", "proc/pressure/memory", "agent-status.json",
                     "journal/dsv41-agent.service.log", "journal/dsv41-rank.service.log", "rank-last-lines.log",
                     "kernel.log"):
            assert f"nodes/{name}/{part}" in content, (name, part, sorted(content))
        assert content[f"nodes/{name}/proc/meminfo"].startswith(b"MemTotal:")
        assert json.loads(content[f"nodes/{name}/agent-status.json"])["node"] == name
        assert b" dsv41-rank.service" in content[f"nodes/{name}/rank-last-lines.log"]
        assert json.loads(content[f"cluster/plans/{name}.json"])["node"] == name
    assert "nodes/spark1/journal/dsv41-coordinator.service.log" in content
    assert json.loads(content["cluster/status.json"])["phase"] == "serving"
    assert b"spark3 rank_exit: rank on spark3 died first" in content["cluster/events.txt"]
    assert json.loads(content["cluster/events.json"])[-1]["kind"] == "rank_exit"
    prints = json.loads(content["cluster/fingerprints.json"])
    assert prints["launched"] == prints["running"] and set(prints["running"]) == set(sparks)
    everything = b"\n".join(content.values())
    assert API_KEY.encode() not in everything
    for label, pem in keys.items():
        body = [line for line in pem.splitlines() if line and not line.startswith(b"-----")]
        assert body and not any(line in everything for line in body), f"{label} is in the bundle"
    assert not re.search(rb"-----BEGIN [A-Z ]*PRIVATE KEY-----\s*[A-Za-z0-9+/]", everything)


def test_6_stop_leaves_no_rank_on_any_node(sparks):
    head = head_of(sparks)
    head.run(["systemctl", "stop", "dsv41-coordinator.service"], timeout=120)
    for node in sparks.values():
        assert node.show("dsv41-rank.service", "ActiveState")["ActiveState"] == "inactive"
        assert node.run(["pgrep", "-f", "dsv41-sim-rank"], check=False).stdout.strip() == ""
    confirmed = head.journal(unit="dsv41-coordinator.service", fields=None,
                             matches=["DSV41_EVENT=rank_stop_confirmed"])
    assert {e["DSV41_NODE_NAME"] for e in confirmed} >= {"spark1", "spark2", "spark3"}


def test_6a_the_bundle_is_made_from_the_agents_when_the_coordinator_is_not_running(sparks):
    head = head_of(sparks)
    assert head.show("dsv41-coordinator.service", "ActiveState")["ActiveState"] == "inactive"  # scenario 6
    made = ctl(head, "bundle", "-o", "/root/down.tar")
    assert made.returncode == 0, made.stderr
    assert "from the agents (the coordinator is not running)" in made.stdout
    with tarfile.open(fileobj=io.BytesIO(head.host_path("/root/down.tar").read_bytes())) as tar:
        content = {m.name.split("/", 1)[1]: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    assert all(f"nodes/{name}/journal/dsv41-agent.service.log" in content for name in sparks)
    assert json.loads(content["cluster/status.json"])["coordinator_running"] is False
    assert "rank_exit" in {e["kind"] for e in json.loads(content["cluster/events.json"])}  # from its history
    assert API_KEY.encode() not in b"\n".join(content.values())


def test_8_unexporting_the_weights_while_workers_have_them_mounted_is_refused(sparks):
    head, workers = head_of(sparks), [sparks["spark2"], sparks["spark3"]]
    (HeadMemory(head).dir / "memory.limit_in_bytes").write_text("-1")  # scenario 7's limit
    for worker in workers:
        install_nfs_client_standin(worker)
    head.write_file("/etc/dsv41/cluster.env", shared_weights_env(sparks), mode=0o640)
    assert ctl(head, "config", "check").returncode == 0
    head.run(["systemctl", "start", "dsv41-coordinator.service"], timeout=60)
    body = wait_serving(head)
    pids = rank_pids(body)
    mounts = {n["name"]: n["status"]["mount"] for n in body["nodes"]}
    for worker in workers:  # the agent's own health check of the nfs4 mount unit
        assert mounts[worker.name]["state"] == "HEALTHY", mounts[worker.name]
        assert f"config.json and {SHARDS} of {SHARDS} shards readable" in mounts[worker.name]["detail"]
        assert worker.show(mounts[worker.name]["unit"], "ActiveState")["ActiveState"] == "active"
        mounted = worker.run(["journalctl", "--no-pager", "-o", "cat", "-u", mounts[worker.name]["unit"]]).stdout
        assert f"{head.address}:/dsv41-native is served over NFSv4 (nfs-ls)" in mounted, mounted

    def served(worker) -> bool:
        return worker.run(["nfs-ls", f"nfs://{head.address}/dsv41-native?version=4"], check=False).returncode == 0

    refused = ctl(head, "share", "unexport")
    assert refused.returncode == 1 and refused.stdout == ""
    assert "mounted by spark2 (healthy), spark3 (healthy)" in refused.stderr, refused.stderr
    assert "ranks run on spark1 (rank active)" in refused.stderr
    assert "dsv41ctl stop" in refused.stderr and "--force" in refused.stderr
    assert all(served(w) for w in workers)
    assert head.show("dsv41-nfs-ganesha.service", "ActiveState")["ActiveState"] == "active"
    deadline = time.monotonic() + 5  # the head's agent refused it (journald writes asynchronously)
    while not head.journal(unit="dsv41-agent.service", matches=["DSV41_EVENT=export_remove_refused"]):
        assert time.monotonic() < deadline, "no export_remove_refused event from the head's agent"
        time.sleep(0.2)
    body = status(head)
    assert body["phase"] == "serving" and rank_pids(body) == pids

    # Stopping the ranks leaves the workers' mounts: still refused, until --unmount removes them.
    assert ctl(head, "stop", "--wait", "45").returncode == 0
    again = ctl(head, "share", "unexport")
    assert again.returncode == 1 and "mounted by spark2 (healthy), spark3 (healthy)" in again.stderr
    assert "ranks run" not in again.stderr and served(workers[0])
    done = ctl(head, "share", "unexport", "--unmount")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"unexported {MODEL_DIR} on spark1 (unmounted on spark2; unmounted on spark3)"
    assert head.show("dsv41-nfs-ganesha.service", "LoadState")["LoadState"] == "not-found"
    assert not served(workers[0])
    assert all(w.run(["findmnt", COMMON_MODEL], check=False).returncode != 0 for w in workers)
    unserved = workers[0].run(["mount", "-t", "nfs4", f"{head.address}:/dsv41-native", COMMON_MODEL], check=False)
    assert unserved.returncode != 0 and "is not served to this client" in unserved.stderr  # the stand-in checks
    # The next start exports and mounts again through the share step.
    assert ctl(head, "start", "--wait", "45").returncode == 0
    assert status(head)["phase"] == "serving" and all(served(w) for w in workers)

    # --force unexports under mounted workers, says what it left behind and records an incident.
    assert ctl(head, "stop", "--wait", "45").returncode == 0
    forced = ctl(head, "share", "unexport", "--force")
    assert forced.returncode == 0, forced.stderr
    left = ("the mounts on spark2, spark3 are stale now; the next bring-up (start after stop, or restart) exports "
            "and mounts again")
    assert forced.stdout.strip() == f"unexported {MODEL_DIR} on spark1 (forced): {left}"
    assert head.show("dsv41-nfs-ganesha.service", "LoadState")["LoadState"] == "not-found"
    assert not served(workers[0])
    assert all(w.run(["findmnt", COMMON_MODEL], check=False).returncode == 0 for w in workers)  # left mounted
    events = ctl(head, "events").stdout.splitlines()
    assert any(f" spark1 export_forced: unexported {MODEL_DIR} on spark1 (forced): {left}" in e for e in events), events



def test_9_an_agent_lost_while_the_share_step_waits_for_a_mount_fails_that_step_and_the_restart_goes_on(sparks):
    head, spark3 = head_of(sparks), sparks["spark3"]
    assert ctl(head, "share", "unexport", "--unmount").returncode == 0  # scenario 8 left stale mounts
    spark3.run(["touch", "/run/dsv41-test-hold-mount"])  # its mount stays in progress, as with a slow server
    try:
        assert ctl(head, "start").returncode == 0

        def spark3_mounting() -> bool:
            body = status(head)
            mount = {n["name"]: n.get("status", {}).get("mount", {}) for n in body.get("nodes", [])}["spark3"]
            return body.get("phase") == "share" and mount.get("state") == "MOUNTING"
        deadline = time.monotonic() + 60
        while not spark3_mounting():
            assert time.monotonic() < deadline, status(head)
            time.sleep(0.2)
        spark3.run(["systemctl", "stop", "dsv41-agent.service"], timeout=60)
        deadline = time.monotonic() + 30
        while not coordinator_events(head, "share_failed"):
            assert time.monotonic() < deadline, status(head)
            time.sleep(0.2)
        failed = coordinator_events(head, "share_failed")[-1]
        assert failed["DSV41_NODE_NAME"] == "spark3"
        assert "agent at " in failed["MESSAGE"], failed["MESSAGE"]
        # a stopped agent: its port refuses, or the connection it had drops (coordinator.transport's words)
        assert (" refusing connections: dsv41-agent not running" in failed["MESSAGE"]
                or " dropped the connection" in failed["MESSAGE"]), failed["MESSAGE"]
        attempts = head.journal(unit="dsv41-coordinator.service", fields=None,
                                matches=["DSV41_EVENT=restart_attempt"])
        assert attempts and "share: spark3: agent at" in attempts[-1]["MESSAGE"]
        assert "spark3 share_failed" in ctl(head, "events").stdout
    finally:
        spark3.run(["rm", "-f", "/run/dsv41-test-hold-mount"])
        spark3.run(["systemctl", "start", "dsv41-agent.service"], timeout=60)
    body = wait_serving(head, timeout=120)  # the next attempt's preflight waited for spark3's agent
    assert body["restart_attempt"] >= 1


def test_10_systemctl_stop_during_a_long_model_load_returns_within_20_s_and_leaves_no_rank(sparks):
    head = head_of(sparks)
    assert ctl(head, "stop", "--wait", "45").returncode == 0
    head.write_file("/etc/dsv41/cluster.env", shared_weights_env(sparks, DSV41_SIM_LOAD_S="90",
                                                                 HEALTH_TIMEOUT_S="600"), mode=0o640)
    head.run(["systemctl", "restart", "dsv41-coordinator.service"], timeout=60)
    deadline = time.monotonic() + 60
    while status(head).get("phase") != "health":
        assert time.monotonic() < deadline, status(head)
        time.sleep(0.2)
    t0 = time.monotonic()
    head.run(["systemctl", "stop", "dsv41-coordinator.service"], timeout=120)
    took = time.monotonic() - t0
    assert took < 20, f"systemctl stop took {took:.1f} s"
    assert head.show("dsv41-coordinator.service", "Result")["Result"] == "success"  # not killed at TimeoutStopSec
    for node in sparks.values():
        assert node.show("dsv41-rank.service", "ActiveState")["ActiveState"] in ("inactive", "failed")
        assert node.run(["pgrep", "-f", "dsv41-sim-rank"], check=False).stdout.strip() == ""


# Scenarios 11-14: the failures Spark clusters have, against the NCCL-like stand-in (a silent peer
# is waited for; --watchdog-timeout is the example configuration's 1800 s, so only the
# coordinator's lease and hang check can end them in time).
LEASE_S, HANG_S = 3.0, 5.0


def lease_env(sparks) -> str:
    """cluster.env of scenarios 11-16: short leases and hang allowance. A slow prefill (2000
    tokens/s, 1 KiB a token) keeps scenario 12's long prompt in flight for ~20 s."""
    return cluster_env(sparks, SIM_RANK_COMMAND=SIM, NODE_LEASE_S=str(LEASE_S), HANG_TIMEOUT_S=str(HANG_S),
                       CANARY_INTERVAL_S="5", DSV41_SIM_PREFILL_TOKENS_PER_S="2000", DSV41_SIM_BYTES_PER_TOKEN="1024")


def test_11_a_frozen_worker_is_lost_naming_it_and_the_cluster_serves_again_once_thawed(sparks):
    head, spark2 = head_of(sparks), sparks["spark2"]
    head.write_file("/etc/dsv41/cluster.env", lease_env(sparks), mode=0o640)
    # restart, not start: run after scenario 1 alone (-k), the coordinator runs with another file
    head.run(["systemctl", "restart", "dsv41-coordinator.service"], timeout=60)
    before = rank_pids(wait_serving(head, timeout=120))
    seen = len(incidents(head, "node_lost"))
    frozen_at = time.monotonic()
    spark2.freeze()
    try:
        lost = new_incident(head, "node_lost", seen, timeout=4 * LEASE_S)
        assert time.monotonic() - frozen_at <= 2 * LEASE_S + 1.0  # within two leases (and a tick)
        assert lost["DSV41_NODE_NAME"] == "spark2", lost["MESSAGE"]
        assert lost["MESSAGE"].startswith("spark2: spark2 lost: not heard from since ")
        body = wait_for(lambda: (b := status(head)).get("phase") == "waiting" and b, 60, "not waiting for spark2")
        assert body["phase_detail"].startswith("waiting for spark2: ")
        view = next(n for n in body["nodes"] if n["name"] == "spark2")
        assert view["lease_age_s"] >= LEASE_S  # dsv41ctl status shows how long since it was heard
    finally:
        thawed_at = time.monotonic()
        spark2.thaw()
    body = wait_serving(head, timeout=90, changed_from=before)
    took = time.monotonic() - thawed_at
    assert took < 60, f"serving {took:.1f} s after the thaw"
    human = ctl(head, "status").stdout
    assert "heard " in human and "last forward step" in human


def test_12_a_worker_rank_stopped_during_a_request_is_hung_naming_it_and_the_cluster_serves_again(sparks):
    head, spark3 = head_of(sparks), sparks["spark3"]
    before = rank_pids(status(head))
    seen = len(incidents(head, "rank_hung"))
    request = json.dumps({"model": "deepseek-v4.1-flash", "max_tokens": 64,  # a 40k-token prompt: ~20 s of prefill
                          "messages": [{"role": "user", "content": "word " * 32000}]})
    head.write_file("/var/tmp/long-request.json", request)
    client = head.run(["sh", "-c", "nohup python3 -c \"import urllib.request; urllib.request.urlopen("
                       f"urllib.request.Request('http://{head.address}:8888/v1/chat/completions', "
                       "data=open('/var/tmp/long-request.json', 'rb').read(), "
                       "headers={'Content-Type': 'application/json'}), timeout=120)\" >/dev/null 2>&1 &"], check=False)
    assert client.returncode == 0
    wait_for(lambda: json.loads(head.run(["python3", "-c", "import urllib.request; print(urllib.request.urlopen("
                                          f"'http://{head.address}:8888/dsv41/inflight').read().decode())"]).stdout)
             ["requests"], 20, "the request never showed in flight")
    stopped_at = time.monotonic()
    spark3.run(["systemctl", "kill", "--signal=SIGSTOP", "dsv41-rank.service"])
    hung = new_incident(head, "rank_hung", seen, timeout=HANG_S + 15)
    assert time.monotonic() - stopped_at <= HANG_S + 5.0
    assert hung["DSV41_NODE_NAME"] == "spark3", hung["MESSAGE"]
    assert "no forward step for" in hung["MESSAGE"]
    wait_serving(head, timeout=90, changed_from=before)


def test_13_a_powered_off_worker_is_lost_first_waited_for_and_serves_again_after_it_boots(sparks):
    head, spark3 = head_of(sparks), sparks["spark3"]
    before = rank_pids(status(head))
    lost_seen, booted_seen = len(incidents(head, "node_lost")), len(incidents(head, "node_rebooted"))
    exits_seen = len(incidents(head, "rank_exit"))
    spark3.power_cut()
    cut_at = time.monotonic()
    lost = new_incident(head, "node_lost", lost_seen, timeout=4 * LEASE_S)
    # A node without power says nothing: its peers' ranks wait in their collective (as NCCL's do),
    # so it is found by its lease, named, and nothing else is blamed.
    assert time.monotonic() - cut_at <= 2 * LEASE_S + 1.0
    assert lost["DSV41_NODE_NAME"] == "spark3", lost["MESSAGE"]
    assert lost["MESSAGE"].startswith("spark3: spark3 lost: not heard from since "), lost["MESSAGE"]
    assert len(incidents(head, "rank_exit")) == exits_seen
    wait_for(lambda: status(head).get("phase") == "waiting", 60, "not waiting for spark3")
    assert status(head)["phase_detail"].startswith("waiting for spark3: ")
    spark3.power_on()
    rebooted = new_incident(head, "node_rebooted", booted_seen, timeout=60)
    assert rebooted["DSV41_NODE_NAME"] == "spark3"
    wait_serving(head, timeout=120, changed_from=before)


def test_14_a_worker_cut_off_for_30_s_is_lost_then_serves_again_once_its_link_is_back(sparks):
    head, spark2 = head_of(sparks), sparks["spark2"]
    before = rank_pids(status(head))
    seen = len(incidents(head, "node_lost"))
    spark2.link(up=False)
    try:
        lost = new_incident(head, "node_lost", seen, timeout=4 * LEASE_S)
        assert lost["DSV41_NODE_NAME"] == "spark2"
        time.sleep(30)
        assert status(head)["phase"] == "waiting"
    finally:
        spark2.link(up=True)
    wait_serving(head, timeout=120, changed_from=before)


# Scenarios 15-15a: the coordinator's own restarts are no outage. They come after scenario 6's
# `systemctl stop` (which must still stop every rank); with -k they may follow it directly, so
# scenario 15 starts the coordinator when it is not running.
def coordinator_stop_events(head) -> tuple[dict, dict]:
    """The last coordinator_stopping and coordinator_stopped events in the head's journal."""
    stopping, stopped = (head.journal(unit="dsv41-coordinator.service", fields=None, matches=[f"DSV41_EVENT={e}"])
                         for e in ("coordinator_stopping", "coordinator_stopped"))
    return stopping[-1], stopped[-1]


def assert_restarted_keeping(sparks, head, coordinator: int, pids: dict, adopted_before: int) -> None:
    assert unit_pid(head, "dsv41-coordinator.service") not in (0, coordinator), "a new coordinator runs"
    body = wait_serving(head)
    assert rank_pids(body) == pids
    for name, node in sparks.items():
        assert unit_pid(node, "dsv41-rank.service") == pids[name], name
    stopping, stopped = coordinator_stop_events(head)
    assert stopping["DSV41_JOB_TYPE"] == "restart" and stopping["DSV41_RANKS_KEPT"] == "yes", stopping
    assert stopping["PRIORITY"] == "6" and "the stop half of a restart" in stopping["MESSAGE"]
    assert stopped["MESSAGE"].startswith("ranks left serving"), stopped["MESSAGE"]
    adopted = head.journal(unit="dsv41-coordinator.service", matches=["DSV41_EVENT=adopted"])
    assert len(adopted) > adopted_before, "the new coordinator re-adopted the ranks"


def test_15_systemctl_restart_of_the_coordinator_keeps_every_rank_serving(sparks):
    head = head_of(sparks)
    head.run(["systemctl", "start", "dsv41-coordinator.service"], timeout=60)  # already running: nothing
    pids = rank_pids(wait_serving(head, timeout=120))
    coordinator = unit_pid(head, "dsv41-coordinator.service")
    adopted = len(head.journal(unit="dsv41-coordinator.service", matches=["DSV41_EVENT=adopted"]))
    head.run(["systemctl", "restart", "dsv41-coordinator.service"], timeout=120)
    assert head.show("dsv41-coordinator.service", "ExecMainStatus")["ExecMainStatus"] == "0"
    assert_restarted_keeping(sparks, head, coordinator, pids, adopted)


def test_15a_upgrading_the_coordinator_while_serving_restarts_it_and_keeps_every_rank(sparks, debs):
    head = head_of(sparks)
    pids = rank_pids(wait_serving(head))
    coordinator = unit_pid(head, "dsv41-coordinator.service")
    old = head.run(["dpkg-query", "-W", "-f", "${Version}", "dsv41-coordinator"]).stdout
    assert not old.endswith("+1"), f"scenario 5 upgrades the agents only; the coordinator is at {old}"
    adopted = len(head.journal(unit="dsv41-coordinator.service", matches=["DSV41_EVENT=adopted"]))
    install(head, debs[1], ["dsv41-coordinator"], remote="/var/tmp/debs-v2-coordinator")
    state = head.run(["dpkg-query", "-W", "-f", "${Status} ${Version}", "dsv41-coordinator"]).stdout
    assert state == f"install ok installed {old}+1", state
    assert_restarted_keeping(sparks, head, coordinator, pids, adopted)


def serving_with(head, env: str) -> dict:
    """The cluster serving with this cluster.env: the coordinator restarted when the file changes,
    started when an earlier scenario stopped it or the cluster (scenario 6)."""
    if head.run(["cat", "/etc/dsv41/cluster.env"], check=False).stdout != env:
        head.write_file("/etc/dsv41/cluster.env", env, mode=0o640)
        head.run(["systemctl", "restart", "dsv41-coordinator.service"], timeout=60)
    else:
        head.run(["systemctl", "start", "dsv41-coordinator.service"], timeout=60)

    def phase():
        try:
            return status(head).get("phase")
        except (ValueError, subprocess.SubprocessError):  # not answering yet
            return None
    if wait_for(phase, 60, "the coordinator does not answer dsv41ctl status") == "stopped":
        assert ctl(head, "start").returncode == 0
    return wait_serving(head, timeout=120)


def pause_events(head) -> list[dict]:
    return head.journal(unit="dsv41-coordinator.service", fields=None, matches=["DSV41_EVENT=coordinator_paused"])


def test_16_the_head_frozen_20_s_keeps_every_rank_and_records_one_pause(sparks):
    # The coordinator, the head's agent and rank 0 stop together; the workers' ranks wait in their
    # collective as NCCL's would. A pause of the coordinator is no verdict on the nodes.
    head = head_of(sparks)
    before = rank_pids(serving_with(head, lease_env(sparks)))
    units = {name: unit_pid(node, "dsv41-rank.service") for name, node in sparks.items()}
    seen = {kind: len(incidents(head, kind)) for kind in ("node_lost", "rank_hung", "node_rebooted", "rank_exit")}
    paused_seen = len(pause_events(head))
    head.freeze()
    try:
        time.sleep(20.0)
    finally:
        head.thaw()
    thawed_at = time.monotonic()
    wait_for(lambda: pause_events(head)[paused_seen:], 4 * LEASE_S, "no coordinator_paused event")
    time.sleep(max(0.0, thawed_at + 3 * LEASE_S + HANG_S - time.monotonic()))  # past leases and the hang allowance
    body = status(head)
    assert body["phase"] == "serving", body.get("phase_detail")
    assert rank_pids(body) == before
    assert {name: unit_pid(node, "dsv41-rank.service") for name, node in sparks.items()} == units
    assert {kind: len(incidents(head, kind)) for kind in seen} == seen, ctl(head, "events").stdout
    (event,) = pause_events(head)[paused_seen:]
    assert 19.0 <= float(event["DSV41_PAUSED_S"]) <= 26.0, event["MESSAGE"]
    assert event["DSV41_ANSWERED"] == "spark1,spark2,spark3" and not event.get("DSV41_SILENT"), event["MESSAGE"]
    assert event["MESSAGE"].startswith("the coordinator did not run for "), event["MESSAGE"]


def test_17_incidents_survive_a_coordinator_restart(sparks):
    head = head_of(sparks)
    # Metrics on (the packaged default, as in scenario 1's file): the counters are read across the restart.
    serving_with(head, cluster_env(sparks, SIM_RANK_COMMAND=SIM, NODE_LEASE_S=str(LEASE_S),
                                   HANG_TIMEOUT_S=str(HANG_S), METRICS_LISTEN=None))

    def shown_events() -> list[str]:
        return ctl(head, "events", "--last", "1000", check=True).stdout.splitlines()

    def incident_counters() -> dict:
        return {labels: v for (name, labels), v in metrics(head).items() if name == "dsv41_incidents_total"}
    # Incidents of the coordinators so far (scenario 2's rank exit at least); the line an earlier
    # restart put between them is not an incident.
    before = [line for line in shown_events() if " coordinator_started: " not in line]
    assert any(" spark3 rank_exit: " in line for line in before), before
    counted = incident_counters()
    last = status(head)["last_incident"]
    assert counted and last["kind"]
    path = "/var/lib/dsv41/coordinator/incidents.jsonl"
    assert head.run(["stat", "-c", "%a %U", path]).stdout.split() == ["600", "root"]
    assert len(head.host_path(path).read_text().splitlines()) >= len(before)

    coordinator = unit_pid(head, "dsv41-coordinator.service")
    head.run(["kill", "-9", str(coordinator)])
    wait_for(lambda: unit_pid(head, "dsv41-coordinator.service") not in (0, coordinator), 30,
             "systemd did not restart the killed coordinator")
    wait_serving(head, timeout=120)
    after = shown_events()
    started = [n for n, line in enumerate(after) if " coordinator_started: " in line]
    assert len(started) == 1, after  # one line: where this coordinator began
    assert after[:started[0]] == before
    assert f"the {len(before)} incident(s) above are from before it" in after[started[0]]
    assert status(head)["last_incident"] == last

    def counters_back():
        try:
            return incident_counters()
        except OSError:  # the new coordinator's metrics endpoint is not listening yet
            return None
    again = wait_for(counters_back, 30, "no metrics from the restarted coordinator")
    assert all(again.get(labels, 0) >= value for labels, value in counted.items()), (counted, again)


def rank_environment(node) -> str:
    return node.show("dsv41-rank.service", "Environment")["Environment"]


def reload_coordinator(head):
    return head.run(["systemctl", "reload", "dsv41-coordinator.service"], check=False, timeout=150)


def test_19_config_apply_refuses_an_invalid_file_applies_a_guard_change_live_and_restarts_the_ranks_once(sparks):
    head = head_of(sparks)
    good = cluster_env(sparks, SIM_RANK_COMMAND=SIM, NODE_LEASE_S=str(LEASE_S), HANG_TIMEOUT_S=str(HANG_S))
    head.write_file("/etc/dsv41/cluster.env", good, mode=0o640)
    if status(head).get("phase") != "serving":
        head.run(["systemctl", "restart", "dsv41-coordinator.service"], timeout=60)
    wait_serving(head, timeout=120)
    assert reload_coordinator(head).returncode == 0  # whatever ran before, this file runs now
    pids = rank_pids(wait_serving(head, timeout=120))
    # An invalid line: the reload fails, says where, and nothing changes.
    bad = good + "TP_SIZE=3\n"
    head.write_file("/etc/dsv41/cluster.env", bad, mode=0o640)
    assert reload_coordinator(head).returncode != 0
    refused = ctl(head, "config", "apply")
    assert refused.returncode == 1
    assert f"cluster.env:{len(bad.splitlines())}: TP_SIZE: defined twice" in refused.stderr, refused.stderr
    time.sleep(1.0)
    body = status(head)
    assert body["phase"] == "serving" and rank_pids(body) == pids
    # A guard threshold: applied live, every rank keeps its PID.
    guard_change = good + "MEMORY_GUARD_GB=2\n"
    head.write_file("/etc/dsv41/cluster.env", guard_change, mode=0o640)
    diff = ctl(head, "config", "diff")
    assert "MEMORY_GUARD_GB" in diff.stdout and "applies at once" in diff.stdout, diff.stdout
    assert reload_coordinator(head).returncode == 0
    body = wait_serving(head, timeout=30)
    assert rank_pids(body) == pids
    started = head.journal(unit="dsv41-coordinator.service", fields=None, matches=["DSV41_EVENT=memory_guard_started"])
    assert started[-1]["DSV41_GUARD_BYTES"] == str(int(2e9)), started[-1]
    for name, node in sparks.items():
        assert unit_pid(node, "dsv41-rank.service") == pids[name]
    # A rank-side change: one restart of the group, with the new environment.
    restarts = len(coordinator_events_named(head, "config_restart"))
    rank_change = guard_change + "DSV41_SIM_DECODE_TOKENS_PER_S=150\n"
    head.write_file("/etc/dsv41/cluster.env", rank_change, mode=0o640)
    assert "restarts the ranks" in ctl(head, "config", "diff").stdout
    assert reload_coordinator(head).returncode == 0
    new_pids = rank_pids(wait_serving(head, timeout=120))
    assert all(new_pids[n] != pids[n] for n in pids)
    assert len(coordinator_events_named(head, "config_restart")) == restarts + 1
    assert "DSV41_SIM_DECODE_TOKENS_PER_S=150" in rank_environment(sparks["spark2"])


def test_19a_a_rank_change_that_fails_at_start_is_rolled_back_to_the_previous_configuration(sparks):
    head = head_of(sparks)
    before = rank_pids(wait_serving(head, timeout=60))
    good = head.run(["cat", "/etc/dsv41/cluster.env"]).stdout
    seen = len(incidents(head, "rolled_back"))
    head.write_file("/etc/dsv41/cluster.env", good + "DSV41_SIM_PREFILL_TOKENS_PER_S=fast\n", mode=0o640)
    assert reload_coordinator(head).returncode == 0
    rolled = new_incident(head, "rolled_back", seen, timeout=180)
    assert "DSV41_SIM_PREFILL_TOKENS_PER_S" in rolled["MESSAGE"], rolled["MESSAGE"]
    body = wait_for(lambda: (b := status(head)).get("phase") == "serving" and rank_pids(b) != before and b, 180,
                    "not serving again with the configuration before the change")
    assert "DSV41_SIM_PREFILL_TOKENS_PER_S" not in rank_environment(sparks["spark3"])
    assert "DSV41_SIM_DECODE_TOKENS_PER_S=150" in rank_environment(sparks["spark3"])
    # cluster.env still holds the change: diff and status say so.
    assert "DSV41_SIM_PREFILL_TOKENS_PER_S" in ctl(head, "config", "diff").stdout
    assert "holds a change that was rolled back" in status(head)["config_note"]
    head.write_file("/etc/dsv41/cluster.env", good, mode=0o640)
    assert ctl(head, "config", "apply").returncode == 0
    assert rank_pids(status(head)) == rank_pids(body)


def coordinator_events_named(head, event: str) -> list[dict]:
    return head.journal(unit="dsv41-coordinator.service", fields=None, matches=[f"DSV41_EVENT={event}"])


# A streaming chat request run on the head in the background: its HTTP status and every SSE line
# go to a JSON file when it ends.
STREAM_CLIENT = """
import json, sys, urllib.error, urllib.request
url, body, out = sys.argv[1:4]
result = {}
try:
    with urllib.request.urlopen(urllib.request.Request(url, data=open(body, 'rb').read(),
                                headers={'Content-Type': 'application/json'}), timeout=300) as r:
        result['status'] = r.status
        result['lines'] = [line.decode().strip() for line in r if line.strip()]
except urllib.error.HTTPError as e:
    result = {'status': e.code, 'body': e.read().decode()}
except Exception as e:
    result = {'status': 0, 'error': repr(e)}
open(out + '.tmp', 'w').write(json.dumps(result))
import os; os.rename(out + '.tmp', out)
"""


def test_20_a_drained_restart_lets_a_streaming_request_finish_and_refuses_new_ones_naming_the_drain(sparks):
    head = head_of(sparks)
    before = rank_pids(wait_serving(head))
    started_before = len(coordinator_events_named(head, "drain_started"))
    url = f"http://{head.address}:8888/v1/chat/completions"
    head.write_file("/var/tmp/stream-client.py", STREAM_CLIENT)
    head.write_file("/var/tmp/drain-request.json", json.dumps({  # a 40k-token prompt: ~20 s of prefill
        "model": "deepseek-v4.1-flash", "stream": True, "rid": "drained-stream-1",
        "messages": [{"role": "user", "content": "word " * 32000 + " what is 19+23?"}]}))
    head.run(["rm", "-f", "/var/tmp/drain-result.json"])
    assert head.run(["sh", "-c", f"nohup python3 /var/tmp/stream-client.py {url} /var/tmp/drain-request.json "
                     "/var/tmp/drain-result.json >/dev/null 2>&1 &"], check=False).returncode == 0

    def inflight():
        return json.loads(head.run(["python3", "-c", "import urllib.request; print(urllib.request.urlopen("
                                    f"'http://{head.address}:8888/dsv41/inflight').read().decode())"]).stdout)
    wait_for(lambda: [r for r in inflight()["requests"] if r["rid"] == "drained-stream-1"], 20,
             "the streaming request never showed in flight")
    asked = ctl(head, "restart", "--drain")
    assert asked.returncode == 0 and "DRAIN_TIMEOUT_S" in asked.stdout, asked.stdout + asked.stderr
    wait_for(lambda: status(head).get("phase") == "draining", 10, "the coordinator did not start draining")
    refused = head.run(["python3", "-c", "import json, sys, urllib.error, urllib.request\n"
                        "try:\n"
                        f"    urllib.request.urlopen(urllib.request.Request('{url}', data=sys.argv[1].encode(), "
                        "headers={'Content-Type': 'application/json'}), timeout=20)\n"
                        "    print(json.dumps({'status': 200}))\n"
                        "except urllib.error.HTTPError as e:\n"
                        "    print(json.dumps({'status': e.code, 'retry_after': e.headers.get('Retry-After'), "
                        "'body': json.loads(e.read())}))",
                        json.dumps({"model": "deepseek-v4.1-flash", "messages": [{"role": "user", "content": "hi"}]})])
    answer = json.loads(refused.stdout)
    assert answer["status"] == 503 and answer["retry_after"] == "60", answer
    assert "draining for a restart: dsv41ctl restart --drain" in answer["body"]["error"]["message"]
    result = json.loads(wait_for(lambda: head.run(["cat", "/var/tmp/drain-result.json"], check=False).stdout, 90,
                                 "the streaming request did not end"))
    assert result["status"] == 200, result
    assert result["lines"][-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in result["lines"][:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert "42" in "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    after = wait_serving(head, timeout=120, changed_from=before)
    assert all(after_pid != before[name] for name, after_pid in rank_pids(after).items())
    started = coordinator_events_named(head, "drain_started")[started_before:]
    assert started and started[-1]["DSV41_IN_FLIGHT"] == "1" and started[-1]["DSV41_REASON"] == "dsv41ctl restart --drain"
    done = coordinator_events_named(head, "drain_done")
    assert done and done[-1]["DSV41_FINISHED"] == "1", done


# Scenario 21: a node's fabric changing while serving (another tool adding an address to its fabric
# netdev, then removing it) is an incident naming the node and the change, then serving again after
# a drained restart; a streaming request in flight at the change finishes (scenario 20's client).


def test_21_a_fabric_address_added_while_serving_is_an_incident_naming_the_node_then_serving_again(sparks):
    head, spark2 = head_of(sparks), sparks["spark2"]
    before = rank_pids(serving_with(head, lease_env(sparks)))  # a slow prefill: 2000 tokens/s
    seen = len(incidents(head, "fabric_changed"))
    # ~10 s of prefill, then its answer streamed: in flight when the restart comes (FABRIC_SETTLE_S=5).
    head.write_file("/var/tmp/drift-request.json", json.dumps({
        "model": "deepseek-v4.1-flash", "max_tokens": 256, "stream": True,
        "messages": [{"role": "user", "content": "word " * 20000}]}))
    head.write_file("/var/tmp/stream-client.py", STREAM_CLIENT)
    head.run(["rm", "-f", "/var/tmp/drift-stream.json"])
    drains_before = len(coordinator_events_named(head, "drain_started"))
    client = head.run(["sh", "-c", f"nohup python3 /var/tmp/stream-client.py http://{head.address}:8888/v1/chat/"
                       "completions /var/tmp/drift-request.json /var/tmp/drift-stream.json >/dev/null 2>&1 &"],
                      check=False)
    assert client.returncode == 0
    wait_for(lambda: json.loads(head.run(["python3", "-c", "import urllib.request; print(urllib.request.urlopen("
                                          f"'http://{head.address}:8888/dsv41/inflight').read().decode())"]).stdout)
             ["requests"], 20, "the request never showed in flight")
    spark2.run(["ip", "addr", "add", "10.77.0.2/24", "dev", "host0"])
    changed = new_incident(head, "fabric_changed", seen, timeout=30)
    assert changed["DSV41_NODE_NAME"] == "spark2", changed["MESSAGE"]
    assert "the fabric changed under the running rank: host0 address 10.77.0.2/24 added" in changed["MESSAGE"]
    reported = spark2.journal(unit="dsv41-agent.service", fields=None, matches=["DSV41_EVENT=fabric_changed"])
    assert reported and "host0 address 10.77.0.2/24 added" in reported[-1]["MESSAGE"]
    after = wait_serving(head, timeout=120, changed_from=before)
    assert all(after_pid != before[name] for name, after_pid in rank_pids(after).items())
    # The request in flight was drained, not cut: the restart drained it first, and it ended whole.
    drained = coordinator_events_named(head, "drain_started")[drains_before:]
    assert drained and drained[0]["DSV41_IN_FLIGHT"] == "1", drained
    assert drained[0]["DSV41_REASON"] == "the fabric of spark2 changed", drained
    assert coordinator_events_named(head, "drain_done")[-1]["DSV41_FINISHED"] == "1"
    result = json.loads(wait_for(lambda: head.run(["cat", "/var/tmp/drift-stream.json"], check=False).stdout, 120,
                                 "the streaming client never finished"))
    assert result["status"] == 200 and result["lines"][-1] == "data: [DONE]", result
    finish = json.loads(result["lines"][-2][len("data: "):])["choices"][0]["finish_reason"]
    assert finish in ("stop", "length"), result["lines"][-2]
    # Undoing it is a change too: one more incident and restart, then serving as before.
    spark2.run(["ip", "addr", "del", "10.77.0.2/24", "dev", "host0"])
    removed = new_incident(head, "fabric_changed", seen + 1, timeout=30)
    assert removed["DSV41_NODE_NAME"] == "spark2" and "host0 address 10.77.0.2/24 removed" in removed["MESSAGE"]
    wait_serving(head, timeout=120, changed_from=rank_pids(after))
    assert len(incidents(head, "fabric_changed")) == seen + 2
