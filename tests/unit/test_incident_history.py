"""The coordinator's incident history on disk (coordinator/incidentlog.py), and a coordinator started
over one: its incidents, status's last incident, the metrics' counters and `dsv41ctl events` carry
on; the incident hook is not run again for them."""

from __future__ import annotations

import io
import json
import socket
import stat
import urllib.request

import pytest

from coordinator import config
from coordinator.control import COORDINATOR_STARTED, ControlService
from coordinator.incidentlog import IncidentHistory, read_incidents
from coordinator.metrics.exporter import Metrics
from coordinator.metrics.recorder import Recorder
from coordinator.runtime import ClusterRuntime
from coordinator.state import Incident, IncidentKind
from dsv41.journal import EventLog
from dsv41.v1 import control_pb2 as pb
from tests.configtext import HOME, SEED_TEXT, edited
from tests.fakeclock import FakeClock

pytestmark = pytest.mark.unit


def journal():
    stream = io.StringIO()
    return EventLog("test", {}, stream=stream, use_journal=False), stream


def incident(n: int, kind: IncidentKind = IncidentKind.RANK_EXIT, node: str = "spark3") -> Incident:
    return Incident(1_796_000_000.0 + n, node, kind, f"rank on {node} died first: killed status 9 (#{n})")


def history(tmp_path, keep: int = 1000, name: str = "incidents.jsonl"):
    log, stream = journal()
    return IncidentHistory(str(tmp_path / name), log, keep=keep), stream


def test_appended_incidents_are_read_back_in_order_by_the_next_coordinator(tmp_path):
    first, out = history(tmp_path)
    assert first.load().incidents == [] and "no incident history at" in out.getvalue()
    recorded = [incident(1), incident(2, IncidentKind.NODE_LOST, "spark2"), incident(3)]
    for i in recorded:
        first.append(i)
    path = tmp_path / "incidents.jsonl"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[1] == {"v": 1, "at_unix_s": 1_796_000_002.0, "node": "spark2", "kind": "node_lost",
                        "message": recorded[1].message}
    loaded = history(tmp_path)[0].load()
    assert loaded.incidents == recorded
    assert loaded.incidents[1].kind is IncidentKind.NODE_LOST
    assert loaded.counts == {("rank_exit", "spark3"): 2, ("node_lost", "spark2"): 1}


def test_the_file_is_rewritten_with_the_newest_at_twice_the_bound_and_the_counts_carry_on(tmp_path):
    h, _ = history(tmp_path, keep=3)
    h.load()
    path = tmp_path / "incidents.jsonl"
    for n in range(1, 12):
        h.append(incident(n, node="spark3" if n % 2 else "spark2"))
        assert len(path.read_text().splitlines()) <= 2 * 3  # the header line of counts included
    # 11 appended: rewritten at the 6th (4..6 kept) and the 9th (7..9 kept), then 10 and 11 appended
    assert [round(i.at_unix_s) - 1_796_000_000 for i in read_incidents(str(path))] == [7, 8, 9, 10, 11]
    loaded = history(tmp_path, keep=3)[0].load()  # the newest 3 only
    assert [round(i.at_unix_s) - 1_796_000_000 for i in loaded.incidents] == [9, 10, 11]
    assert loaded.counts == {("rank_exit", "spark3"): 6, ("rank_exit", "spark2"): 5}
    assert json.loads(path.read_text().splitlines()[0])["dropped"] == [
        {"kind": "rank_exit", "node": "spark2", "count": 4}, {"kind": "rank_exit", "node": "spark3", "count": 4}]


def test_a_history_over_its_bound_is_cut_to_the_newest_at_load(tmp_path):
    big, _ = history(tmp_path, keep=100)
    big.load()
    for n in range(10):
        big.append(incident(n))
    loaded = history(tmp_path, keep=4)[0].load()
    assert [i.message for i in loaded.incidents] == [incident(n).message for n in range(6, 10)]
    assert loaded.counts == {("rank_exit", "spark3"): 10}
    assert len((tmp_path / "incidents.jsonl").read_text().splitlines()) == 5  # counts + 4


def test_a_torn_last_line_is_skipped_with_one_warning_and_appends_go_on_after_it(tmp_path):
    h, _ = history(tmp_path)
    h.load()
    h.append(incident(1))
    h.append(incident(2))
    path = tmp_path / "incidents.jsonl"
    with open(path, "ab") as f:
        f.write(b'{"v": 1, "at_unix_s": 1796000003.0, "node": "spa')  # a crash in the middle of a write
    again, out = history(tmp_path)
    assert again.load().incidents == [incident(1), incident(2)]
    warnings = [line for line in out.getvalue().splitlines() if "incident_history_bad_lines" in line]
    assert len(warnings) == 1 and warnings[0].startswith("<4>")
    assert f"{path}: skipped 1 unreadable line(s) (line 3)" in warnings[0]
    again.append(incident(4))
    assert history(tmp_path)[0].load().incidents == [incident(1), incident(2), incident(4)]


def test_a_torn_line_the_load_could_not_rewrite_away_is_not_glued_to_the_next(tmp_path):
    path = tmp_path / "incidents.jsonl"
    path.write_text(json.dumps({"v": 1, "at_unix_s": 1.0, "node": "spark2", "kind": "rank_exit", "message": "a"})
                    + '\n{"v": 1, "at_un')
    h, _ = history(tmp_path)
    h.append(incident(5))  # as after a load whose rewrite failed: the file still ends torn
    loaded = history(tmp_path)[0].load()
    assert [i.node for i in loaded.incidents] == ["spark2", "spark3"]


def test_corrupt_lines_are_skipped_naming_them_and_the_others_are_kept(tmp_path):
    path = tmp_path / "incidents.jsonl"
    good = [json.dumps({"v": 1, "at_unix_s": float(n), "node": "spark2", "kind": "node_lost", "message": "m"})
            for n in range(3)]
    path.write_text("\n".join([good[0], "\x00\x00garbage", good[1], '{"v": 9, "future": true}', '[1, 2]',
                               '{"v": 1, "at_unix_s": "soon", "node": "x", "kind": "rank_exit", "message": ""}',
                               good[2]]) + "\n")
    h, out = history(tmp_path)
    loaded = h.load()
    assert [i.at_unix_s for i in loaded.incidents] == [0.0, 1.0, 2.0]
    assert "skipped 4 unreadable line(s) (line 2, 4, 5, 6)" in out.getvalue()
    assert out.getvalue().count("incident_history_bad_lines") == 1
    assert len(path.read_text().splitlines()) == 3  # rewritten without them


def test_a_kind_this_version_does_not_know_is_kept_as_its_text(tmp_path):
    (tmp_path / "incidents.jsonl").write_text(json.dumps(
        {"v": 1, "at_unix_s": 5.0, "node": "spark1", "kind": "drain_failed", "message": "newer"}) + "\n")
    loaded = history(tmp_path)[0].load()
    assert loaded.incidents[0].kind == "drain_failed" and loaded.counts == {("drain_failed", "spark1"): 1}


def test_an_unreadable_history_starts_empty_with_an_error_event(tmp_path):
    (tmp_path / "incidents.jsonl").mkdir()  # EISDIR: read fails even for root
    h, out = history(tmp_path)
    assert h.load().incidents == []
    assert "<3>cannot read the incident history" in out.getvalue() and "incident_history_unreadable" in out.getvalue()


def test_an_unwritable_history_logs_one_error_and_writes_everything_once_it_can(tmp_path):
    blocker = tmp_path / "state"
    blocker.write_text("a file where the directory should be")  # ENOTDIR, even for root
    log, out = journal()
    h = IncidentHistory(str(blocker / "incidents.jsonl"), log)
    h.load()
    h.append(incident(1))
    h.append(incident(2))
    assert out.getvalue().count("incident_history_failed") == 1
    assert "<3>cannot write the incident history" in out.getvalue()
    blocker.unlink()
    h.append(incident(3))
    assert "incident_history_written" in out.getvalue()
    assert read_incidents(str(blocker / "incidents.jsonl")) == [incident(1), incident(2), incident(3)]


def runtime(tmp_path, keep: int = 1000):
    cfg = config.parse(SEED_TEXT, "cluster.env", HOME)
    log, stream = journal()
    clock = FakeClock()
    h = IncidentHistory(str(tmp_path / "incidents.jsonl"), log, keep=keep)
    return ClusterRuntime(cfg, {}, log, clock=clock.time, monotonic=clock.monotonic, history=h), stream


def test_a_coordinator_over_a_history_reports_its_incidents_and_counts_but_does_not_announce_them(tmp_path):
    earlier, _ = history(tmp_path)
    earlier.load()
    old = [incident(1), incident(2, IncidentKind.NODE_LOST, "spark2"), incident(3)]
    for i in old:
        earlier.append(i)
    rt, _ = runtime(tmp_path)
    announced = []
    rt.on_incident(announced.append)  # the incident hook's and the control server's way in
    assert rt.incidents() == old and rt.earlier_incidents() == 3
    assert rt.snapshot().last_incident == old[-1]
    assert announced == []
    recorder = Recorder()
    recorder.add_incidents(rt.follow_incidents(recorder.on_incident))  # as metrics/exporter.py does
    assert recorder.counters("dsv41_incidents") == {(("kind", "rank_exit"), ("node", "spark3")): 2,
                                                    (("kind", "node_lost"), ("node", "spark2")): 1}
    new = rt._incident("spark3", IncidentKind.RANK_HUNG, "rank on spark3 hung")
    assert announced == [new] and rt.incidents() == old + [new] and rt.earlier_incidents() == 3
    assert recorder.counters("dsv41_incidents")[(("kind", "rank_hung"), ("node", "spark3"))] == 1
    assert history(tmp_path)[0].load().incidents == old + [new]  # on disk for the next coordinator


class Context:
    def add_callback(self, callback):
        pass

    def is_active(self):
        return True


def test_events_mark_where_this_coordinator_began(tmp_path):
    earlier, _ = history(tmp_path)
    earlier.load()
    for n in range(1, 4):
        earlier.append(incident(n))
    rt, _ = runtime(tmp_path)
    new = rt._incident("spark2", IncidentKind.NODE_LOST, "spark2 lost")
    service = ControlService(rt.cfg, rt, journal()[0])
    shown = list(service.Events(pb.EventsRequest(last=3), Context()))
    assert [(e.kind, e.node) for e in shown] == [("rank_exit", "spark3"), ("rank_exit", "spark3"),
                                                 (COORDINATOR_STARTED, rt.cfg.head.name), ("node_lost", "spark2")]
    assert "the 2 incident(s) above are from before it" in shown[2].message
    assert shown[2].at_unix_s == rt.started_unix_s and shown[3].message == new.message
    only_new = list(service.Events(pb.EventsRequest(last=1), Context()))
    assert [e.kind for e in only_new] == ["node_lost"]


def test_the_metrics_start_from_the_history(tmp_path):
    earlier, _ = history(tmp_path, keep=2)
    earlier.load()
    for n in range(5):
        earlier.append(incident(n, IncidentKind.MEMORY_FLOOR, "spark1"))
    rt, _ = runtime(tmp_path, keep=2)
    with socket.socket() as s:  # a free port: the exporter binds when it is made
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = config.parse(edited(SEED_TEXT, METRICS_LISTEN=f"127.0.0.1:{port}"), "cluster.env", HOME)
    metrics = Metrics(cfg, rt, journal()[0]).start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    finally:
        metrics.stop()
    # 5 recorded, 2 kept: the counter still says 5
    assert 'dsv41_incidents_total{kind="memory_floor",node="spark1"} 5.0' in text.splitlines()
