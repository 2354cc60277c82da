"""The testbed's view of two TP groups: the cluster.env it writes loads as two groups, and the status
helpers the cluster tier and the demo wait with read the groups and the gateway right."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from coordinator import config
from coordinator.groups import groups_of, worker_url
from testbed.sparks import (GATEWAY_PYTHON, SIM, gateway_workers, group_rank_pids, groups_serving, groups_setting,
                            sim_cluster_env, spark_names)

pytestmark = pytest.mark.unit


def nodes(count: int) -> dict:
    return {name: SimpleNamespace(address=f"192.168.241.{11 + i}") for i, name in enumerate(spark_names(count))}


def test_two_groups_of_three_load_as_the_gateway_expects():
    six = nodes(6)
    text = sim_cluster_env(six, SIM, GROUPS=groups_setting(list(six), 3), TP_SIZE="3", GATEWAY_PYTHON=GATEWAY_PYTHON)
    assert 'GROUPS="spark1,spark2,spark3 spark4,spark5,spark6"\n' in text
    cfg = config.parse(text, "cluster.env", {})
    groups = groups_of(cfg)
    assert [[n.name for n in g.nodes] for g in groups] == [["spark1", "spark2", "spark3"], ["spark4", "spark5", "spark6"]]
    assert worker_url(cfg, groups[1]) == "http://192.168.241.14:8888"
    assert cfg.settings["GATEWAY_PYTHON"] == GATEWAY_PYTHON


def test_three_nodes_still_load_as_one_group():
    cfg = config.parse(sim_cluster_env(nodes(3), SIM), "cluster.env", {})
    assert cfg.settings["NNODES"] == 3 and len(groups_of(cfg)) == 1


def test_groups_setting_refuses_a_remainder():
    with pytest.raises(ValueError, match="5 nodes cannot be cut into groups of 3"):
        groups_setting(spark_names(5), 3)


def body(g2_phase="serving", g2_pid=41, healthy=True, ready=True) -> dict:
    pids = {"spark1": 11, "spark2": 12, "spark3": 13, "spark4": g2_pid, "spark5": 42, "spark6": 43}
    return {
        "phase": "serving",
        "groups": [{"name": "g1", "phase": "serving", "nodes": ["spark1", "spark2", "spark3"]},
                   {"name": "g2", "phase": g2_phase, "nodes": ["spark4", "spark5", "spark6"]}],
        "gateway": {"ready": ready, "workers": [{"group": "g1", "url": "u1", "healthy": True},
                                                {"group": "g2", "url": "u2", "healthy": healthy}]},
        "nodes": [{"name": n, "status": {"rank": {"main_pid": str(pid)}}} for n, pid in pids.items()],
    }


def test_group_rank_pids_reads_the_groups_nodes_only():
    assert group_rank_pids(body(), "g2") == {"spark4": 41, "spark5": 42, "spark6": 43}
    assert gateway_workers(body(healthy=False)) == {"g1": True, "g2": False}


def test_groups_serving_needs_every_group_and_the_gateways_healthy_workers():
    assert groups_serving(body(), 2)
    assert not groups_serving(body(), 3)
    assert not groups_serving(body(g2_phase="launch"), 2)
    assert not groups_serving(body(healthy=False), 2)
    assert groups_serving(body(healthy=False), 2, gateway=False)
    assert not groups_serving(body(ready=False), 2)
    assert not groups_serving({"phase": "serving", "nodes": []}, 2)  # a coordinator without groups


def test_groups_serving_with_changed_from_waits_for_new_pids():
    before = {"g2": group_rank_pids(body(), "g2")}
    assert not groups_serving(body(), 2, changed_from=before)
    assert groups_serving(body(g2_pid=99), 2, changed_from=before)
