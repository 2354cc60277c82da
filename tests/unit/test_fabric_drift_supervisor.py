"""Fabric drift and the GPU slow state on the coordinator: a node's fabric changes reported while
serving settle into one fabric_changed incident naming the node and the changes, then a restart
that can wait (drain); a change while nothing runs is only journaled; an incident another thread
found (the GPU watch's) is recorded by the supervisor. On the fake clock of tests/unit/test_supervisor.py."""

from __future__ import annotations

import pytest

from coordinator import fabricdrift
from coordinator.fabricdrift import Change, FabricDrift, Reaction, reaction
from coordinator.messages import IncidentSeen
from coordinator.policy import Action
from dsv41.v1 import agent_pb2 as pb
from tests.fakeclock import FakeClock
from tests.unit.test_supervisor import LIVE, cluster, wait_incident, wait_phase, wait_restarted  # noqa: F401

pytestmark = pytest.mark.unit


def report(agent, *changes):
    """The node's agent streams a fabric change, as WatchRank sends one (not a heartbeat)."""
    agent.on_event(pb.RankEvent(rank=agent.rank(), boot_id=agent.boot, fabric_changes=[
        pb.FabricChange(netdev=n, what=w, before=b, after=a) for n, w, b, a in changes]))


def offered(rt):
    """The requests the supervisor offers itself, recorded as they go to the slot."""
    seen = []
    offer = rt._offer
    rt._offer = lambda request: (seen.append(request), offer(request))[1]
    return seen


def test_changes_while_serving_settle_into_one_incident_naming_the_node_then_a_drained_restart(cluster):
    rt, agents, rank0, journal, stream, drive = cluster(**LIVE, FABRIC_SETTLE_S="2")
    rank0.healthy.set()
    rt.run()
    wait_phase(drive, "serving")
    requests = offered(rt)
    report(agents["spark2"], ("host0", "link", "up", "admin down"), ("host0", "address", "10.0.0.2/24", ""))
    drive.run_for(1.0)
    report(agents["spark2"], ("host0", "link", "admin down", "up"), ("host0", "address", "", "10.0.0.2/24"))
    drive.run_for(1.9)  # quiet for less than FABRIC_SETTLE_S since the last change
    assert not [i for i in rt.incidents() if i.kind == "fabric_changed"]
    changed = wait_incident(drive, "fabric_changed", within=0.5)
    assert changed.node == "spark2"
    assert changed.message.startswith("spark2: the fabric changed under the running rank: host0 link up -> admin "
                                      "down; host0 address 10.0.0.2/24 removed; host0 link admin down -> up; host0 "
                                      "address 10.0.0.2/24 added")
    assert [(r.action, r.source, r.drain) for r in requests] == [(Action.RESTART, "fabric", True)]
    wait_restarted(drive, agents)
    assert len([i for i in rt.incidents() if i.kind == "fabric_changed"]) == 1


def test_a_change_while_nothing_runs_is_journaled_only(cluster):
    rt, agents, rank0, journal, stream, drive = cluster(**LIVE, FABRIC_SETTLE_S="0.5")
    rt.run(autostart=False)
    wait_phase(drive, "stopped")
    requests = offered(rt)
    report(agents["spark3"], ("host0", "mtu", "9000", "1500"))
    drive.run_for(1.0)
    assert not rt.incidents() and not requests
    assert "spark3: the fabric changed while no rank runs (host0 mtu 9000 -> 1500)" in stream.getvalue()


def test_a_change_the_group_stopped_after_is_recorded_without_a_restart(cluster):
    rt, agents, rank0, journal, stream, drive = cluster(**LIVE, FABRIC_SETTLE_S="2")
    rank0.healthy.set()
    rt.run()
    wait_phase(drive, "serving")
    requests = offered(rt)
    report(agents["spark3"], ("host0", "mtu", "9000", "1500"))
    drive.run_for(0.5)
    rt.request("stop")
    wait_phase(drive, "stopped")
    changed = wait_incident(drive, "fabric_changed", within=3.0)
    assert changed.node == "spark3" and changed.message.endswith(
        "host0 mtu 9000 -> 1500: NCCL does not reconnect; the group's next bring-up checks it")
    drive.run_for(1.0)
    assert not [r for r in requests if r.source == "fabric"] and rt.snapshot().phase == "stopped" and all(a.starts == 1 for a in agents.values())


def test_an_incident_another_thread_found_is_recorded_by_the_supervisor(cluster):
    rt, agents, rank0, journal, stream, drive = cluster(**LIVE)
    rank0.healthy.set()
    rt.run()
    wait_phase(drive, "serving")
    rt.post(IncidentSeen("spark1", "gpu_slow", "spark1 GPU0 NVIDIA GB10: slow for 121 s (...)"))
    slow = wait_incident(drive, "gpu_slow", within=0.5)
    assert slow.node == "spark1" and slow.message.startswith("spark1 GPU0 NVIDIA GB10: slow for 121 s")
    drive.run_for(1.0)
    assert rt.snapshot().phase == "serving" and all(a.starts == 1 for a in agents.values())  # no restart


def test_what_a_settled_drift_does():
    assert reaction(ranks_run=True, recovery_due=False) is Reaction.RESTART
    assert reaction(ranks_run=True, recovery_due=True) is Reaction.RECORD  # a stop or restart already waits
    assert reaction(ranks_run=False, recovery_due=False) is Reaction.RECORD  # stopped meanwhile: not forgotten


def test_a_flapping_link_is_not_waited_on_for_ever():
    clock = FakeClock()
    drift = FabricDrift(2.0, clock.monotonic)
    flap = [pb.FabricChange(netdev="host0", what="link", before="up", after="no carrier")]
    for _ in range(7):  # a change every 1.2 s: never quiet for 2 s
        drift.note("spark1", flap)
        assert drift.take_settled() == {}
        clock.advance(1.2)
    drift.note("spark1", flap)
    assert list(drift.take_settled()) == ["spark1"]  # 4 x FABRIC_SETTLE_S after the first
    assert drift.take_settled() == {}
    assert Change("rocep1s0f1", "gid_index", "rocep1s0f1 port 1 index 5", "none").describe() == \
        "RoCE v2 GID index of the fabric address rocep1s0f1 port 1 index 5 -> none"
    assert fabricdrift.describe("spark1", [Change("host0", "address", "", "10.77.0.1/24")]).startswith(
        "spark1: the fabric changed under the running rank: host0 address 10.77.0.1/24 added: NCCL does not")
