"""GROUPS in cluster.env, each group's view of the configuration, and the rolling decisions."""

from __future__ import annotations

import io
import threading
from dataclasses import dataclass, field, replace

import pytest

from coordinator import config, groups, plan
from coordinator.rolling import Roller, combined_phase, may_take_out, served_again
from coordinator.state import Phase, Snapshot
from dsv41.journal import EventLog
from tests.configtext import HOME, edited, nodes_text

pytestmark = pytest.mark.unit

TWO_GROUPS = '"spark1,spark2,spark3 spark4,spark5,spark6"'


def six(**changes):
    text = edited(nodes_text(6), TP_SIZE="3", GROUPS=TWO_GROUPS, NFS_CLIENTS="10.0.0.0/24")
    return edited(text, **changes)


def load(text):
    return config.parse(text, "/etc/dsv41/cluster.env", HOME)


def errors(text) -> list[str]:
    with pytest.raises(config.ConfigInvalid) as caught:
        load(text)
    return [str(e) for e in caught.value.errors]


def test_an_existing_file_is_one_group_of_every_node():
    cfg = load(nodes_text(3))
    (only,) = groups.groups_of(cfg)
    assert only.name == "g1" and [n.name for n in only.nodes] == ["spark1", "spark2", "spark3"]
    assert not groups.is_grouped(cfg)


def test_two_groups_each_numbered_from_its_head():
    cfg = load(six())
    g1, g2 = groups.groups_of(cfg)
    assert [(n.name, n.rank) for n in g2.nodes] == [("spark4", 0), ("spark5", 1), ("spark6", 2)]
    assert g1.head.share_head and not g2.head.share_head
    view = groups.group_config(cfg, g2)
    assert view.integer("NNODES") == 3 and view.text("HEAD_IP") == "10.0.0.4" and view.head.name == "spark4"
    assert groups.worker_url(cfg, g2) == f"http://10.0.0.4:{cfg.integer('PORT')}"


def test_a_second_groups_head_mounts_the_weights_and_is_its_groups_rank_0():
    cfg = load(six())
    view = groups.group_config(cfg, groups.groups_of(cfg)[1])
    head = plan.render_node(view, "spark4")
    assert head.export is None and head.mount is not None and head.mount.server == "10.0.24.1"
    argv = head.rank_spec.argv
    assert head.rank == 0 and argv[argv.index("--node-rank") + 1] == "0" and argv[argv.index("--nnodes") + 1] == "3"
    assert argv[argv.index("--dist-init-addr") + 1] == f"10.0.0.4:{view.integer('DIST_PORT')}"
    keyed = load(six(API_KEY_FILE="/etc/dsv41/api-key"))
    g2_head = plan.render_node(groups.group_config(keyed, groups.groups_of(keyed)[1]), "spark4")
    assert "DSV41_API_KEY_FILE" in g2_head.rank_spec.env  # each group's rank 0 checks the key
    assert "DSV41_API_KEY_FILE" not in head.rank_spec.env
    first = plan.render_node(groups.group_config(cfg, groups.groups_of(cfg)[0]), "spark1")
    assert first.export is not None and first.mount is None


@pytest.mark.parametrize("value, message", [
    ("spark1,spark2,spark3 spark3,spark5,spark6", "spark3 is in group 1 and group 2: a node serves in one group"),
    ("spark1,spark2,spark3 spark4,spark5,spark9", "group 2 names spark9, which is no node"),
    ("spark1,spark2,spark3 spark4,spark5", "spark6 is in no group"),
    ("spark2,spark1,spark3 spark4,spark5,spark6", "the first group's head must be HEAD_HOST (spark1)"),
    ("spark1,spark2 spark3,spark4,spark5,spark6", "groups must be of one size"),
    ("spark1,spark2,,spark3 spark4,spark5,spark6", "each group is a comma-separated list of node names"),
])
def test_groups_that_cannot_run_are_refused_naming_the_key(value, message):
    found = errors(six(GROUPS=f'"{value}"'))
    assert any("GROUPS" in e and message in e for e in found), found


def test_tp_size_must_fit_a_group_not_the_whole_cluster():
    assert load(six(TP_SIZE="3"))
    found = errors(six(TP_SIZE="4"))
    assert any("TP_SIZE" in e and "multiple of a group's size, 3 nodes" in e for e in found), found


def test_the_gateways_ports_must_not_collide_on_the_head():
    cfg = load(six())
    port = cfg.integer("PORT")
    found = errors(six(GATEWAY_PORT=str(port)))
    assert any("GATEWAY_PORT" in e and f"port {port} is already PORT" in e for e in found), found
    found = errors(six(GATEWAY_METRICS_LISTEN=f"127.0.0.1:{cfg.integer('AGENT_PORT')}"))
    assert any("GATEWAY_METRICS_LISTEN" in e and "already AGENT_PORT" in e for e in found), found


def test_one_group_needs_no_gateway_port():
    cfg = load(edited(nodes_text(3), GROUPS="spark1,spark2,spark3", GATEWAY_PORT="8888", PORT="8888"))
    assert not groups.is_grouped(cfg)


# ---------------------------------------------------------------- the cluster's phase and the rollout

def test_the_cluster_serves_while_any_group_serves():
    phase, detail = combined_phase([("g1", Phase.SERVING, "ok"), ("g2", Phase.LAUNCH, "starting ranks")])
    assert phase == Phase.SERVING and detail.startswith("1/2 groups serving") and "g2 launch (starting ranks)" in detail
    assert combined_phase([("g1", Phase.STOPPED, ""), ("g2", Phase.STOPPED, "")])[0] == Phase.STOPPED
    assert combined_phase([("g1", Phase.FAILED, "x"), ("g2", Phase.HEALTH, "")])[0] == Phase.HEALTH
    assert combined_phase([("g1", Phase.FAILED, "x"), ("g2", Phase.STOPPED, "")])[0] == Phase.FAILED


def test_the_last_serving_group_is_never_taken_out():
    assert not may_take_out("g1", {"g1": Phase.SERVING, "g2": Phase.LAUNCH})
    assert may_take_out("g1", {"g1": Phase.SERVING, "g2": Phase.SERVING})
    assert may_take_out("g2", {"g1": Phase.SERVING, "g2": Phase.FAILED})  # it serves nothing: nothing is lost


def test_served_again_needs_a_new_serving_run():
    before = Snapshot(phase=Phase.SERVING, since=10.0, serving_since=10.0)
    assert served_again(before, before) is None
    assert served_again(before, replace(before, phase=Phase.DRAINING, since=11.0)) is None
    assert served_again(before, replace(before, since=30.0, serving_since=30.0)) is True
    assert served_again(before, replace(before, phase=Phase.FAILED, since=30.0)) is False


@dataclass
class Member:
    name: str
    snap: Snapshot
    restarts: list = field(default_factory=list)

    def snapshot(self) -> Snapshot:
        return self.snap


class Gateway:
    def __init__(self, members, events):
        self.members, self.events = members, events

    def remove_now(self, group, timeout_s=5.0):
        # While a group is out, every other group must be serving: the gateway always has one.
        assert any(m.snap.phase == Phase.SERVING for m in self.members if m.name != group)
        self.events.append(("out", group))
        return True

    def release(self, group):
        self.events.append(("in", group))

    def routes(self, group):
        # A group is routed from the moment it serves and is not held out, as the manager's poll makes it.
        out = [g for kind, g in self.events if kind == "out"]
        back = [g for kind, g in self.events if kind == "in"]
        member = next(m for m in self.members if m.name == group)
        return member.snap.phase == Phase.SERVING and out.count(group) == back.count(group)


def roll(members, take_out, **kw):
    events = []
    gateway = Gateway(members, events)
    log = EventLog("test", {}, stream=io.StringIO(), use_journal=False)
    roller = Roller(members, gateway, take_out, log, "restart", poll_s=0.001, **kw).start()
    assert roller.done.wait(10.0)
    return events, log


def test_a_rolling_restart_takes_one_group_out_at_a_time():
    members = [Member(f"g{i}", Snapshot(phase=Phase.SERVING, since=1.0, serving_since=1.0)) for i in (1, 2, 3)]

    def take_out(member):
        member.restarts.append(True)
        member.snap = replace(member.snap, phase=Phase.DRAINING, since=2.0)
        # It serves again a moment later, as a supervisor's restart does.
        threading.Timer(0.02, lambda: setattr(member, "snap", replace(member.snap, phase=Phase.SERVING,
                                                                        since=5.0, serving_since=5.0))).start()

    events, _ = roll(members, take_out)
    assert events == [("out", "g1"), ("in", "g1"), ("out", "g2"), ("in", "g2"), ("out", "g3"), ("in", "g3")]
    assert all(m.restarts for m in members)


def test_a_group_that_does_not_serve_again_ends_the_rollout():
    members = [Member(f"g{i}", Snapshot(phase=Phase.SERVING, since=1.0, serving_since=1.0)) for i in (1, 2)]

    def take_out(member):
        member.restarts.append(True)
        member.snap = replace(member.snap, phase=Phase.FAILED, since=5.0)

    events, _ = roll(members, take_out)
    assert events == [("out", "g1"), ("in", "g1")] and not members[1].restarts


def test_the_only_serving_group_is_held_until_another_serves():
    members = [Member("g1", Snapshot(phase=Phase.SERVING, since=1.0, serving_since=1.0)),
               Member("g2", Snapshot(phase=Phase.FAILED, since=1.0))]
    clock = [0.0]

    def monotonic():
        clock[0] += 1.0
        return clock[0]

    out = io.StringIO()
    events = []
    log = EventLog("test", {}, stream=out, use_journal=False)
    roller = Roller(members, Gateway(members, events), lambda m: m.restarts.append(True), log, "restart",
                    monotonic=monotonic, poll_s=0.001, other_wait_s=50.0).start()
    assert roller.done.wait(10.0)
    assert events == [] and not members[0].restarts
    assert "g1 left serving: it is the only group serving" in out.getvalue()


def test_a_group_serving_but_not_yet_routed_by_the_gateway_does_not_let_the_next_one_out():
    members = [Member(f"g{i}", Snapshot(phase=Phase.SERVING, since=1.0, serving_since=1.0)) for i in (1, 2)]
    events = []
    gateway = Gateway(members, events)
    gateway.routes = lambda group: group == "g2"  # g1 serves again, but the gateway never lists it

    def take_out(member):
        member.restarts.append(True)
        member.snap = replace(member.snap, since=5.0, serving_since=5.0)

    clock = [0.0]

    def monotonic():
        clock[0] += 1.0
        return clock[0]

    out = io.StringIO()
    log = EventLog("test", {}, stream=out, use_journal=False)
    roller = Roller(members, gateway, take_out, log, "restart", monotonic=monotonic, poll_s=0.001,
                    other_wait_s=50.0).start()
    assert roller.done.wait(10.0)
    assert [m.name for m in members if m.restarts] == ["g1"] and ("out", "g2") not in events
    assert "g2 left serving: it is the only group serving" in out.getvalue()


def test_cancel_stops_a_rollout_waiting_for_a_group():
    members = [Member(f"g{i}", Snapshot(phase=Phase.SERVING, since=1.0, serving_since=1.0)) for i in (1, 2)]
    taken = threading.Event()
    log = EventLog("test", {}, stream=io.StringIO(), use_journal=False)
    roller = Roller(members, Gateway(members, []), lambda m: taken.set(), log, "restart", poll_s=0.001).start()
    assert taken.wait(5.0)
    roller.cancel()
    assert roller.done.wait(5.0) and not members[1].restarts


# ---------------------------------------------------------------- the facade over the groups' supervisors

class FakeRuntime:
    def __init__(self, nodes, snap):
        self.clients = {n: object() for n in nodes}
        self.snap, self.requests, self.runs, self.posted = snap, [], [], []
        self.started_unix_s = 100.0

    def snapshot(self):
        return self.snap

    def request(self, action, reason=None, source="dsv41ctl", drain=False):
        self.requests.append((action, drain))

    def run(self, autostart=True, restart_for=(), rollout=None):
        self.runs.append((autostart, restart_for))

    def post(self, message):
        self.posted.append(message)

    def incidents(self):
        return []

    def liveness_views(self):
        return {n: (1.0, 2.0, 3) for n in self.clients}


class FakeGateway:
    def __init__(self):
        self.calls = []

    def start(self):
        self.calls.append("start")

    def stop_unit(self):
        self.calls.append("stop_unit")

    def remove_now(self, group, timeout_s=5.0):
        self.calls.append(("out", group))
        return True

    def release(self, group):
        self.calls.append(("in", group))

    def routes(self, group):
        return True

    def view(self):
        from coordinator.gateway import GatewayView
        return GatewayView(url="http://10.0.0.1:30000", unit_state="active", ready=True,
                           workers=(("g1", "http://10.0.0.1:8888", True),), error="")


def grouped(g1_phase=Phase.SERVING, g2_phase=Phase.LAUNCH):
    from coordinator.grouped import GroupedRuntime, GroupRun
    cfg = load(six())
    g1, g2 = groups.groups_of(cfg)
    runs = [GroupRun(g1, FakeRuntime(["spark1", "spark2", "spark3"], Snapshot(
                phase=g1_phase, since=5.0, serving_since=5.0, generation="aaa", fingerprints={"spark1": "f1"}))),
            GroupRun(g2, FakeRuntime(["spark4", "spark5", "spark6"], Snapshot(
                phase=g2_phase, since=7.0, generation="bbb", fingerprints={"spark4": "f4"})))]
    out = GroupedRuntime(cfg, runs, EventLog("test", {}, stream=io.StringIO(), use_journal=False), FakeGateway())
    return out, runs


def test_the_facade_merges_the_groups_and_routes_only_serving_groups():
    rt, runs = grouped()
    snap = rt.snapshot()
    assert snap.phase == Phase.SERVING and snap.fingerprints == {"spark1": "f1", "spark4": "f4"}
    assert snap.generation == "g1:aaa g2:bbb" and set(rt.clients) == {f"spark{i}" for i in range(1, 7)}
    assert rt.base_url == "http://10.0.0.1:30000"
    for run in runs:
        run.started = True
    assert rt.routable() == {"g1": f"http://10.0.0.1:{rt.cfg.integer('PORT')}"}
    from coordinator.messages import IncidentSeen
    rt.post(IncidentSeen("spark5", "gpu_slow", "slow"))  # to the group the node is in
    assert runs[1].runtime.posted and not runs[0].runtime.posted


def test_stop_and_start_go_to_every_group_and_the_gateway_unit():
    rt, runs = grouped()
    rt.request("stop")
    assert all(r.runtime.requests == [("stop", False)] for r in runs)
    for _ in range(100):  # the unit is stopped off the caller's thread
        if "stop_unit" in rt.gateway.calls:
            break
        threading.Event().wait(0.01)
    assert "stop_unit" in rt.gateway.calls
    rt.request("start")
    assert rt.gateway.calls[-1] == "start" and all(r.runtime.requests[-1] == ("start", False) for r in runs)


def test_status_names_each_group_and_the_gateway():
    from coordinator.grouped import fill_status
    from dsv41.v1 import control_pb2 as cpb
    rt, _ = grouped()
    status = cpb.ClusterStatus(phase="serving", nodes=[cpb.NodeView(name="spark5", rank=4)])
    fill_status(status, rt)
    assert [(g.name, g.phase, list(g.nodes)) for g in status.groups] == [
        ("g1", "serving", ["spark1", "spark2", "spark3"]), ("g2", "launch", ["spark4", "spark5", "spark6"])]
    assert status.nodes[0].group == "g2" and status.nodes[0].rank == 1  # its rank within its group
    assert status.endpoint == "http://10.0.0.1:30000" and status.gateway.ready
    assert [(w.group, w.healthy) for w in status.gateway.workers] == [("g1", True)]


def test_the_metrics_name_each_group_and_the_gateway():
    from coordinator.metrics.groups import GroupCollector
    rt, _ = grouped()
    families = {f.name: f for f in GroupCollector(
        lambda: [(run.name, snap.phase, snap.serving_since) for run, snap in rt.group_snapshots()],
        rt.gateway.view).collect()}
    phases = {(s.labels["group"], s.labels["phase"]): s.value for s in families["dsv41_group_phase"].samples}
    assert phases[("g1", "serving")] == 1 and phases[("g2", "launch")] == 1 and phases[("g2", "serving")] == 0
    assert [s.value for s in families["dsv41_gateway_up"].samples] == [1]
    assert [(s.labels, s.value) for s in families["dsv41_gateway_worker_healthy"].samples] == [
        ({"group": "g1", "url": "http://10.0.0.1:8888"}, 1)]


def test_the_gateways_runtime_does_not_change_with_what_the_ranks_run():
    cfg = load(six(API_KEY_FILE="/etc/dsv41/api-key"))
    changed = load(six(API_KEY_FILE="/etc/dsv41/api-key", DSV41_SIM_DECODE_TOKENS_PER_S="150",
                       EXTRA_SGLANG_ARGS='"--watchdog-timeout 301"'))
    view, view2 = (groups.group_config(c, groups.groups_of(c)[0]) for c in (cfg, changed))
    launch, fingerprint = plan.gateway_launch(view)
    assert (launch, fingerprint) == plan.gateway_launch(view2) and len(fingerprint) == 16
    assert set(launch.env) == {"PYTHONPATH", "DSV41_API_KEY_FILE"} and not launch.agent_fills
    assert {b.target for b in launch.binds} <= {launch.env["PYTHONPATH"], launch.env["DSV41_API_KEY_FILE"]}
    if launch.runtime == "container":  # each -e names a variable the unit has
        named = [launch.argv[i + 1] for i, word in enumerate(launch.argv) if word == "-e"]
        assert sorted(named) == sorted(launch.env)
    assert plan.render_node(view, "spark1").rank_spec != plan.render_node(view2, "spark1").rank_spec


def test_every_plan_rendered_from_the_whole_file_is_the_one_its_group_runs():
    cfg = load(six())
    by_group = {n.name: plan.render_node(groups.group_config(cfg, g), n.name)
                for g in groups.groups_of(cfg) for n in g.nodes}
    assert {p.node: p for p in plan.render_cluster(cfg)} == by_group
    spark5 = plan.render_node(cfg, "spark5")
    assert spark5.rank == 1 and spark5.rank_spec.argv[spark5.rank_spec.argv.index("--nnodes") + 1] == "3"


def test_a_rolling_configuration_change_keeps_the_groups_not_reached_serving_and_a_stop_reaches_them():
    rt, runs = grouped(g1_phase=Phase.STARTING, g2_phase=Phase.STARTING)  # supervisors not looked yet
    rt.run(autostart=True, restart_for=("EXTRA_SGLANG_ARGS",))
    for _ in range(500):
        if runs[0].runtime.runs:
            break
        threading.Event().wait(0.01)
    assert runs[0].runtime.runs == [(True, ("EXTRA_SGLANG_ARGS",))] and not runs[1].started
    assert runs[1].snapshot().phase == Phase.SERVING and "previous configuration" in runs[1].snapshot().detail
    assert "g2" in rt.routable() and "g1" not in rt.routable()  # g1 restarts; g2 answers meanwhile
    rt.request("stop")
    assert runs[1].started and runs[1].runtime.runs == [(False, ())]  # supervised, not brought up
    assert runs[1].runtime.requests == [("stop", False)] and runs[0].runtime.requests == [("stop", False)]
