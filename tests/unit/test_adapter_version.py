"""Which adapter a running rank loaded, against the one installed now: recorded on the rank's unit
at its start, read back by an agent restarted after an upgrade (which re-adopts the rank without
restarting it), outside the plan's fingerprint; shown by `dsv41ctl status` and a gauge only where
both are known and differ."""

from __future__ import annotations

import io
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.rank import RankManager
from agent.rankspec import NO_FLOOR, fingerprint_from_fields, unit_properties
from agent.rpc_rank import rank_pb
from coordinator import ctl_cluster
from coordinator.metrics.collector import ClusterCollector
from coordinator.metrics.nodes import NodeView
from coordinator.metrics.recorder import Recorder
from coordinator.runtime import Snapshot
from dsv41.adapterversion import (InstalledAdapter, adapter_stale, adapter_version_field, adapter_version_from_fields,
                                  version_from_source)
from dsv41.journal import EventLog
from dsv41.v1 import agent_pb2 as apb
from dsv41.v1 import control_pb2 as pb
from dsv41.version import VERSION

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
INVOCATION = bytes.fromhex("cd" * 16)


def test_the_version_is_read_from_the_text_of_version_py_without_running_it():
    assert version_from_source((REPO / "dsv41" / "version.py").read_text()) == VERSION
    assert version_from_source('"""doc"""\nVERSION = "0.9.0+1"\n') == "0.9.0+1"
    assert version_from_source('VERSION = "1:0.9.0-2~rc1"\n') == "1:0.9.0-2~rc1"  # any Debian version
    for text in ("VERSION = 1\n", "", "VERSION = (\n", 'OTHER = "1.0"\n', 'VERSION = "x; rm -rf /"\n',
                 'VERSION = "0.9.0 extra"\n', f'VERSION = "{"9" * 80}"\n'):
        assert version_from_source(text) == "", text


def test_the_installed_version_is_the_adapter_directorys_and_follows_a_replaced_file(tmp_path):
    installed = InstalledAdapter(str(tmp_path))
    assert installed.path == str(tmp_path / "dsv41" / "version.py")
    assert installed.version() == ""  # no adapter there
    (tmp_path / "dsv41").mkdir()
    version_py = tmp_path / "dsv41" / "version.py"
    version_py.write_text('VERSION = "0.9.0"\n')
    assert installed.version() == "0.9.0"
    replacement = tmp_path / "dsv41" / "version.py.dpkg-new"  # dpkg replaces the file by a rename
    replacement.write_text('VERSION = "0.9.0+1"\n')
    os.replace(replacement, version_py)
    assert installed.version() == "0.9.0+1"


def test_only_a_known_version_on_both_sides_that_differs_is_stale():
    assert adapter_stale("0.9.0", "0.9.0+1")
    assert not adapter_stale("0.9.0", "0.9.0")
    assert not adapter_stale("", "0.9.0+1")  # a rank started before agents recorded it
    assert not adapter_stale("0.9.0", "")  # an adapter directory without a version file


def launch(fingerprint="ab12"):
    return SimpleNamespace(rank=1, fingerprint=fingerprint, generation="g", runtime="host",
                           argv=("/usr/bin/dsv41-sim-rank", "--port", "30000"), env={}, fills={},
                           stop_timeout_s=10, exec_start_pre=(), exec_stop_post=(), binds=(), memory_max=0,
                           memory_high=0, cache_dir="", floor=NO_FLOOR)


def test_the_unit_carries_the_version_beside_the_fingerprint_and_the_plan_is_unchanged():
    props = {name: value for name, _, value in unit_properties(launch(), {}, "spark2", "/var/lib/dsv41", "0.9.0")}
    fields = props["LogExtraFields"]
    assert b"DSV41_ADAPTER_VERSION=0.9.0" in fields
    assert adapter_version_from_fields(fields) == "0.9.0"
    assert fingerprint_from_fields(fields) == "ab12"  # the plan's, whatever adapter is installed
    assert not any(e.startswith("DSV41_ADAPTER_VERSION=") for e in props["Environment"])  # not the rank's env
    unknown = {name: value for name, _, value in unit_properties(launch(), {}, "spark2", "/var/lib/dsv41")}
    assert adapter_version_from_fields(unknown["LogExtraFields"]) == ""
    assert adapter_version_field("not a version") == []  # never a malformed journal field


class UnitSystemd:
    """systemd as RankManager sees it, over one transient unit: StartTransientUnit keeps the
    properties it was given, as systemd reports them back (LogExtraFields as bytes)."""

    def __init__(self):
        self.props: dict | None = None
        self.started_with: dict = {}

    def on_properties_changed(self, callback) -> None:
        pass

    def on_reconnect(self, callback) -> None:
        pass

    def properties(self, name: str, interfaces) -> dict | None:
        return None if self.props is None else dict(self.props)

    def start_transient(self, name: str, properties, timeout_s: float):
        self.started_with = {key: value for key, _, value in properties}
        self.props = {"LoadState": "loaded", "ActiveState": "active", "SubState": "running", "MainPID": 4242,
                      "InvocationID": INVOCATION, "LogExtraFields": list(self.started_with["LogExtraFields"])}
        return SimpleNamespace(result="done", job="/job/1")


class Journal:
    def __init__(self):
        self.entries: list[tuple[str, str, dict]] = []

    def log(self) -> EventLog:
        return EventLog("dsv41-agent", {}, sender=lambda **e: self.entries.append(
            (e["DSV41_EVENT"], e["MESSAGE"], e)))


def test_a_restarted_agent_reads_back_the_version_its_rank_started_with_and_says_it_is_stale():
    systemd, installed, journal = UnitSystemd(), ["0.9.0"], Journal()
    agent = RankManager(systemd, "spark2", journal.log(), "/tmp", installed_adapter=lambda: installed[0])
    outcome, state = agent.start(launch(), {}, False, 10.0)
    assert outcome == "STARTED" and state.adapter_version == "0.9.0"
    assert b"DSV41_ADAPTER_VERSION=0.9.0" in systemd.started_with["LogExtraFields"]
    assert rank_pb(state).adapter_version == "0.9.0"
    installed[0] = "0.9.0+1"  # the packages are upgraded: the agent restarts, the rank does not
    restarted = RankManager(systemd, "spark2", journal.log(), "/tmp", installed_adapter=lambda: installed[0])
    adopted = restarted.adopt()
    assert adopted.running and adopted.main_pid == 4242 and adopted.adapter_version == "0.9.0"
    stale = [(message, fields) for kind, message, fields in journal.entries if kind == "rank_adapter_stale"]
    assert [m for m, _ in stale] == ["dsv41-rank.service runs adapter 0.9.0, 0.9.0+1 is installed: the next "
                                     "restart of the ranks loads it"]
    assert stale[0][1]["PRIORITY"] == "5" and stale[0][1]["DSV41_ADAPTER_INSTALLED"] == "0.9.0+1"
    # The same plan asked again is the running rank: an upgrade alone restarts nothing.
    assert restarted.start(launch(), {}, False, 10.0)[0] == "ALREADY_RUNNING"


def test_a_rank_started_before_agents_recorded_the_version_is_unknown_and_not_stale():
    systemd, journal = UnitSystemd(), Journal()
    systemd.props = {"LoadState": "loaded", "ActiveState": "active", "SubState": "running", "MainPID": 7,
                     "InvocationID": INVOCATION, "LogExtraFields": [b"DSV41_FINGERPRINT=ab12"]}
    agent = RankManager(systemd, "spark2", journal.log(), "/tmp", installed_adapter=lambda: "0.9.0+1")
    assert agent.adopt().adapter_version == ""
    assert not [kind for kind, _, _ in journal.entries if kind == "rank_adapter_stale"]
    assert "adapter unknown" in [m for kind, m, _ in journal.entries if kind == "rank_adopted"][0]


def cluster(running=("0.9.0", "0.9.0", ""), installed=("0.9.0+1", "0.9.0", "0.9.0+1"), reachable=(True,) * 3):
    views = []
    for i, (ran, now, ok) in enumerate(zip(running, installed, reachable)):
        view = pb.NodeView(name=f"spark{i + 1}", rank=i, agent_reachable=ok)
        if ok:
            view.status.CopyFrom(apb.NodeStatus(adapter_version=now, rank=apb.RankState(
                active_state="active", main_pid=100 + i, adapter_version=ran)))
        else:
            view.agent_error = "UNAVAILABLE: connection refused"
        views.append(view)
    return pb.ClusterStatus(phase="serving", ranks_running=3, ranks_total=3, nodes=views, coordinator_running=True)


def test_status_names_each_node_whose_rank_runs_an_older_adapter_and_nothing_else():
    out = io.StringIO()
    ctl_cluster.render_status(cluster(), out, now=1e9)
    text = out.getvalue()
    lines = text[text.index("  spark1: rank runs"):].splitlines()  # under the table
    # spark2 matches; spark3's rank has no record: neither is a warning
    assert text.count("rank runs adapter") == 1
    assert lines == ["  spark1: rank runs adapter 0.9.0, 0.9.0+1 is installed: the next restart of the",
                     "    ranks loads it"]
    assert all(len(line) <= 80 for line in out.getvalue().splitlines())


def test_status_shows_no_adapter_line_when_every_rank_runs_what_is_installed():
    same = cluster(running=("0.9.0+1",) * 3, installed=("0.9.0+1",) * 3)
    out = io.StringIO()
    ctl_cluster.render_status(same, out, now=1e9)
    assert "adapter" not in out.getvalue()
    assert ctl_cluster.stale_adapter_lines(same.nodes) == []
    stopped = cluster()
    stopped.nodes[0].status.rank.active_state = "inactive"
    assert ctl_cluster.stale_adapter_lines(stopped.nodes) == []  # nothing runs the old code


def test_status_lines_for_every_stale_node_and_not_for_an_unreachable_one():
    st = cluster(running=("0.9.0",) * 3, installed=("0.9.0+1",) * 3, reachable=(True, True, False))
    assert ctl_cluster.stale_adapter_lines(st.nodes) == [
        f"spark{i}: rank runs adapter 0.9.0, 0.9.0+1 is installed: the next restart of the ranks loads it"
        for i in (1, 2)]


def test_the_gauge_is_1_for_a_stale_rank_0_for_a_current_one_and_absent_when_unknown():
    st = cluster()
    views = {v.name: NodeView(v.name, True, v.status) for v in st.nodes}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ClusterCollector(Snapshot, [v.name for v in st.nodes], Recorder(), lambda: views, None, 0, ()))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    gauge = {s.labels["node"]: s.value for s in families["dsv41_rank_adapter_stale"].samples}
    assert gauge == {"spark1": 1, "spark2": 0}
