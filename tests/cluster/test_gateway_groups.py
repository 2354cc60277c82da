"""Six stand-in nodes as two TP groups of three (GROUPS) behind the gateway on the head, driven as an
operator would; the scenarios run in file order on one cluster. Run alone:

    flock /tmp/dsv41-nspawn.lock /usr/bin/python3 -m pytest -q -s -p no:cacheprovider -m cluster \\
        tests/cluster/test_gateway_groups.py -x

(names are test_groups_N_..., so `-k "test_1_ or ..."` on tests/cluster does not boot these six nodes)."""

from __future__ import annotations

import json
import socket

import pytest

from testbed.sparks import (boot_groups, build_debs, ctl, gateway_workers, group_phases, group_rank_pids, status,
                            wait_groups_serving)
from tests.cluster.sparks import RequestLoop, StatusWatcher, chat, incidents, unit_pid, wait_for

pytestmark = pytest.mark.cluster

GROUPS = ("g1", "g2")
GATEWAY_PORT = 30000  # the key's default
SERVE_S = 180.0       # six nodes' agents and two bring-ups on two cores


@pytest.fixture(scope="module")
def sparks(rootfs, tmp_path_factory):
    debs = build_debs(tmp_path_factory.mktemp("debs"))
    cluster = boot_groups(rootfs, debs, ROLLOUT_CONFIRM_S="0")
    try:
        yield cluster.nodes
    finally:
        cluster.stop()


def gateway_url(sparks) -> str:
    return f"http://{sparks['spark1'].address}:{GATEWAY_PORT}"


def all_pids(body: dict) -> dict[str, dict[str, int]]:
    return {group: group_rank_pids(body, group) for group in GROUPS}


def test_groups_1_both_groups_serve_behind_the_gateway(sparks):
    head = sparks["spark1"]
    head.run(["systemctl", "start", "dsv41-coordinator.service"], timeout=60)
    body = wait_groups_serving(head, timeout=SERVE_S)
    assert body["phase"] == "serving" and body["endpoint"] == gateway_url(sparks), body["endpoint"]
    views = {g["name"]: g for g in body["groups"]}
    assert list(views) == list(GROUPS)
    assert views["g1"]["nodes"] == ["spark1", "spark2", "spark3"]
    assert views["g2"]["nodes"] == ["spark4", "spark5", "spark6"]
    assert views["g1"]["endpoint"] == f"http://{sparks['spark1'].address}:8888"
    assert views["g2"]["endpoint"] == f"http://{sparks['spark4'].address}:8888"
    gateway = body["gateway"]
    assert gateway["url"] == gateway_url(sparks) and gateway["ready"] and not gateway["error"], gateway
    assert head.run(["systemctl", "is-active", "dsv41-gateway.service"], check=False).stdout.strip() == "active"
    assert gateway_workers(body) == {"g1": True, "g2": True}, gateway
    assert {w["url"] for w in gateway["workers"]} == {views["g1"]["endpoint"], views["g2"]["endpoint"]}
    assert all(pid > 0 for group in GROUPS for pid in group_rank_pids(body, group).values()), body["nodes"]
    code, reply = chat(gateway_url(sparks))
    assert code == 200, reply
    answer = json.loads(reply)
    assert "42" in answer["choices"][0]["message"]["content"] and answer["choices"][0]["finish_reason"] == "stop"
    human = ctl(head, "status").stdout
    assert gateway_url(sparks) in human and "g1" in human and "g2" in human, human


def test_groups_2_a_rank_killed_in_group_2_restarts_group_2_only_and_the_gateway_keeps_answering(sparks):
    head, spark5 = sparks["spark1"], sparks["spark5"]
    before = all_pids(status(head))
    with RequestLoop(gateway_url(sparks)) as client, StatusWatcher(head) as watcher:
        client.wait_count(5, timeout=30)
        spark5.run(["kill", "-9", str(unit_pid(spark5, "dsv41-rank.service"))])
        after = wait_groups_serving(head, timeout=SERVE_S, changed_from={"g2": before["g2"]})
        client.wait_count(30, timeout=60)
    print(client.summary())
    assert all(pid != before["g2"][n] for n, pid in group_rank_pids(after, "g2").items()), (before, after)
    assert group_rank_pids(after, "g1") == before["g1"]
    assert watcher.not_serving("g2"), "group 2 was never seen out of serving"
    exits = incidents(head, "rank_exit")
    assert exits and exits[-1]["DSV41_NODE_NAME"] == "spark5" and exits[-1]["DSV41_GROUP"] == "g2", exits[-1:]
    assert not watcher.not_serving("g1"), [s.phases for s in watcher.not_serving("g1")]
    answers = list(client.answers)
    assert len(answers) >= 30
    assert sum(a.status == 200 for a in answers) >= 0.95 * len(answers), client.summary()


def test_groups_3_a_restart_goes_group_by_group_and_every_request_succeeds(sparks):
    head = sparks["spark1"]
    before = all_pids(status(head))
    with RequestLoop(gateway_url(sparks)) as client, StatusWatcher(head) as watcher:
        client.wait_count(3, timeout=30)
        restart = ctl(head, "restart")
        assert restart.returncode == 0, restart.stdout + restart.stderr
        after = wait_groups_serving(head, timeout=2 * SERVE_S, changed_from=before)
        client.wait_count(len(client.answers) + 3, timeout=30)
    print(client.summary())
    print("the groups and the gateway's workers through the restart:")
    print(watcher.timeline(client.answers[0].at_s))
    for group in GROUPS:
        now = group_rank_pids(after, group)
        assert all(pid != before[group][n] for n, pid in now.items()), (group, before[group], now)
        assert watcher.not_serving(group), f"{group} was never seen out of serving"
    # One at a time: never a sample without a serving group, and the two groups' spells out of
    # serving do not overlap.
    assert not watcher.none_serving(), [(round(s.at_s, 1), s.phases) for s in watcher.none_serving()]
    spells = {group: (watcher.not_serving(group)[0].at_s, watcher.not_serving(group)[-1].at_s) for group in GROUPS}
    first, second = sorted(spells.values())
    assert first[1] < second[0], spells
    assert not client.failures(), client.summary() + "\n" + watcher.timeline(client.answers[0].at_s)


def test_groups_3b_a_configuration_the_ranks_restart_for_rolls_group_by_group(sparks):
    head = sparks["spark1"]
    before = all_pids(status(head))
    good = head.run(["cat", "/etc/dsv41/cluster.env"]).stdout
    with RequestLoop(gateway_url(sparks)) as client, StatusWatcher(head) as watcher:
        client.wait_count(3, timeout=30)
        head.write_file("/etc/dsv41/cluster.env", good + "DSV41_SIM_DECODE_TOKENS_PER_S=150\n", mode=0o640)
        assert "restarts the ranks" in ctl(head, "config", "diff").stdout
        applied = ctl(head, "config", "apply")
        assert applied.returncode == 0, applied.stdout + applied.stderr
        after = wait_groups_serving(head, timeout=2 * SERVE_S, changed_from=before)
        client.wait_count(len(client.answers) + 3, timeout=30)
    print(client.summary())
    print(watcher.timeline(client.answers[0].at_s))
    for group in GROUPS:
        now = group_rank_pids(after, group)
        assert all(pid != before[group][n] for n, pid in now.items()), (group, before[group], now)
    for name in ("spark2", "spark5"):  # a worker of each group runs the new environment
        environ = sparks[name].show("dsv41-rank.service", "Environment")["Environment"]
        assert "DSV41_SIM_DECODE_TOKENS_PER_S=150" in environ, name
    assert not watcher.none_serving(), [(round(s.at_s, 1), s.phases) for s in watcher.none_serving()]
    assert not client.failures(), client.summary() + "\n" + watcher.timeline(client.answers[0].at_s)
    rolled = head.journal(unit="dsv41-coordinator.service", fields=None, matches=["DSV41_EVENT=rolling_done"])
    assert rolled and "configuration change (DSV41_SIM_DECODE_TOKENS_PER_S)" in rolled[-1]["MESSAGE"], rolled[-1:]


def test_groups_4_stop_ends_every_rank_and_the_gateway(sparks):
    head = sparks["spark1"]
    stop = ctl(head, "stop", "--wait", "90")
    assert stop.returncode == 0, stop.stdout + stop.stderr
    for node in sparks.values():
        assert unit_pid(node, "dsv41-rank.service") == 0, node.name
        assert node.show("dsv41-rank.service", "ActiveState")["ActiveState"] in ("inactive", "failed"), node.name
    body = status(head)
    assert body["phase"] == "stopped" and all(p == "stopped" for p in group_phases(body).values()), group_phases(body)
    wait_for(lambda: head.run(["systemctl", "is-active", "dsv41-gateway.service"], check=False).stdout.strip()
             == "inactive", 30, "the gateway's unit is still active after stop")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((head.address, GATEWAY_PORT), timeout=5).close()
