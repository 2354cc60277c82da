"""The coordinator's metrics: events and incidents into counters, node status into gauges, the text
format as prometheus_client's own parser reads it, over a real HTTP server."""

import io
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from coordinator.metrics.collector import ClusterCollector, liveness_families
from coordinator.metrics.events import updates_of
from coordinator.metrics.low import WindowLow
from coordinator.metrics.nodes import NodeView
from coordinator.metrics.recorder import Recorder
from coordinator.metrics.server import MetricsServer
from coordinator.runtime import Incident, Snapshot
from dsv41.journal import EventLog
from dsv41.v1 import agent_pb2 as pb

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
NODES = ["spark1", "spark2", "spark3"]
GB = 10**9


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def scrape(registry) -> dict:
    from prometheus_client import generate_latest
    return {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}


def samples(families, name):
    """Values of the samples called `name` (a counter's family is named without _total)."""
    found = [s for f in families.values() for s in f.samples if s.name == name]
    assert found or name in families, f"no sample {name}"
    return {tuple(sorted(s.labels.items())): s.value for s in found}


def status(available, some=(1.5, 0.0, 2.0), mount=pb.MountState.HEALTHY, rank_state="active"):
    cpu, memory, io_ = some
    return pb.NodeStatus(
        memory=pb.MemorySample(available_bytes=available, some=pb.Pressure(avg10=memory)),
        mount=pb.MountState(state=mount), rank=pb.RankState(active_state=rank_state, memory_current_bytes=7 * GB),
        pressure=[pb.ResourcePressure(resource="cpu", some=pb.Pressure(avg10=cpu)),
                  pb.ResourcePressure(resource="memory", some=pb.Pressure(avg10=memory), full=pb.Pressure(avg10=0.5)),
                  pb.ResourcePressure(resource="io", some=pb.Pressure(avg10=io_))])


def collector(snapshot, recorder=None, views=None, low=None, mounts=("spark2", "spark3")):
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ClusterCollector(lambda: snapshot, NODES, recorder or Recorder(), lambda: views or {},
                                       low, int(1.5 * GB), mounts))
    return registry


def test_event_updates():
    assert updates_of("step_done", {"DSV41_STEP": "launch", "DSV41_DURATION_S": "1.25"})[0].value == 1.25
    assert updates_of("step_done", {"DSV41_STEP": "launch", "DSV41_DURATION_S": "nan"}) == []
    assert updates_of("step_done", {"DSV41_STEP": "launch"}) == []
    assert [u.family for u in updates_of("restart_attempt", {"DSV41_ATTEMPT": "1"})] == ["dsv41_restarts"]
    assert updates_of("memory_abort_all", {})[0].labels == (("action", "abort_all"),)
    assert updates_of("memory_stop_observed", {})[0].labels == (("action", "stop_observed"),)
    assert updates_of("memory_guard_rearmed", {}) == []
    assert updates_of("incident_hook_failed", {})[0].labels == (("outcome", "failed"),)
    assert updates_of("serving", {}) == []


def test_every_family_of_the_issue_is_exposed_and_parses():
    snap = Snapshot(phase="serving", since=50.0, ranks={n: pb.RankState(active_state="active") for n in NODES})
    recorder = Recorder()
    recorder.on_incident(Incident(1.0, "spark3", "rank_exit", "died"))
    recorder.on_event("step_done", "info", {"DSV41_STEP": "health", "DSV41_DURATION_S": "42.0"})
    recorder.on_event("restart_attempt", "warning", {})
    recorder.on_event("memory_abort", "err", {})
    pack = pb.PackState(layers=[pb.PackLayerState(layer=1, state="complete"), pb.PackLayerState(layer=14, state="absent")])
    views = {"spark1": NodeView("spark1", True, status(90 * GB), pack),
             "spark2": NodeView("spark2", True, status(80 * GB, mount=pb.MountState.STALE)),
             "spark3": NodeView("spark3", False, error="UNAVAILABLE: connection refused")}
    families = scrape(collector(snap, recorder, views, low=lambda: 2 * GB))
    wanted = {"dsv41_phase", "dsv41_ranks_running", "dsv41_incidents", "dsv41_restarts", "dsv41_bringup_step_seconds",
              "dsv41_agent_up", "dsv41_node_memory_available_bytes", "dsv41_node_psi_some_avg10",
              "dsv41_guard_actions", "dsv41_guard_lowest_margin_bytes", "dsv41_mount_healthy", "dsv41_pack_complete"}
    assert wanted <= set(families)
    assert samples(families, "dsv41_phase")[(("phase", "serving"),)] == 1
    assert samples(families, "dsv41_phase")[(("phase", "restarting"),)] == 0
    assert samples(families, "dsv41_ranks_running")[()] == 3
    assert samples(families, "dsv41_incidents_total") == {(("kind", "rank_exit"), ("node", "spark3")): 1}
    assert samples(families, "dsv41_restarts_total") == {(): 1}
    assert samples(families, "dsv41_guard_actions_total") == {(("action", "abort"),): 1}
    assert samples(families, "dsv41_bringup_step_seconds_count") == {(("step", "health"),): 1}
    buckets = samples(families, "dsv41_bringup_step_seconds_bucket")
    assert buckets[(("le", "30.0"), ("step", "health"))] == 0 and buckets[(("le", "60.0"), ("step", "health"))] == 1
    assert samples(families, "dsv41_agent_up") == {(("node", "spark1"),): 1, (("node", "spark2"),): 1,
                                                   (("node", "spark3"),): 0}
    # a node that did not answer has no figures rather than stale ones
    assert samples(families, "dsv41_node_memory_available_bytes") == {(("node", "spark1"),): 90 * GB,
                                                                      (("node", "spark2"),): 80 * GB}
    psi = samples(families, "dsv41_node_psi_some_avg10")
    assert psi[(("node", "spark1"), ("resource", "cpu"))] == 1.5 and psi[(("node", "spark1"), ("resource", "io"))] == 2.0
    assert samples(families, "dsv41_mount_healthy") == {(("node", "spark2"),): 0}  # the head mounts nothing
    assert samples(families, "dsv41_pack_complete") == {(("layer", "1"), ("node", "spark1")): 1,
                                                        (("layer", "14"), ("node", "spark1")): 0}
    assert samples(families, "dsv41_guard_lowest_margin_bytes") == {(): 0.5 * GB}


def test_the_liveness_families_carry_each_nodes_lease_and_step_age_and_nothing_unknown():
    views = {"spark1": (0.4, 1.5, 120), "spark2": (7.0, -1.0, 0), "spark3": (-1.0, -1.0, 0)}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ClusterCollector(lambda: Snapshot(), NODES, Recorder(), dict, None, 0, (), lambda: views))
    families = scrape(registry)
    assert samples(families, "dsv41_node_lease_age_seconds") == {(("node", "spark1"),): 0.4,
                                                                 (("node", "spark2"),): 7.0}  # spark3: not heard yet
    assert samples(families, "dsv41_rank_step_age_seconds") == {(("node", "spark1"),): 1.5}  # spark2: no counter
    assert samples(families, "dsv41_rank_forward_steps_total") == {(("node", "spark1"),): 120}
    assert [f.name for f in liveness_families({})] == ["dsv41_node_lease_age_seconds", "dsv41_rank_step_age_seconds",
                                                       "dsv41_rank_forward_steps"]


def test_no_guard_margin_without_a_guard_or_without_samples():
    assert "dsv41_guard_lowest_margin_bytes" not in scrape(collector(Snapshot(), low=None))
    assert "dsv41_guard_lowest_margin_bytes" not in scrape(collector(Snapshot(), low=lambda: None))


def test_an_unknown_phase_is_exposed_too():
    assert samples(scrape(collector(Snapshot(phase="waiting"))), "dsv41_phase")[(("phase", "waiting"),)] == 1


def test_an_old_agent_without_pressure_reports_memory_psi_only():
    old = pb.NodeStatus(memory=pb.MemorySample(available_bytes=5, some=pb.Pressure(avg10=3.0)))
    families = scrape(collector(Snapshot(), views={"spark1": NodeView("spark1", True, old)}))
    assert samples(families, "dsv41_node_psi_some_avg10") == {(("node", "spark1"), ("resource", "memory")): 3.0}


def test_the_window_keeps_the_lowest_value_of_the_last_minute():
    clock = Clock()
    low = WindowLow(60.0, clock)
    assert low.lowest() is None
    for value in (5, 3, 4, 6):
        low.add(value)
        clock.now += 10
    assert low.lowest() == 3
    clock.now += 50  # the 3 is 80 s old now, the 4 70 s, the 6 60 s
    assert low.lowest() == 6
    clock.now += 1
    assert low.lowest() is None


def test_event_log_listeners_get_every_event_and_a_failing_one_is_contained():
    stream = io.StringIO()
    log = EventLog("test", {"DSV41_NODE": "spark1"}, stream=stream, use_journal=False)
    seen = []
    unsubscribe = log.subscribe(lambda kind, priority, fields: seen.append((kind, priority, fields)))
    log.subscribe(lambda *args: 1 / 0)
    entry = log.info("step_done", "bring-up: launch done", step="launch", duration_s=1.5)
    assert entry["DSV41_STEP"] == "launch"
    assert seen == [("step_done", "info", {"DSV41_NODE": "spark1", "DSV41_EVENT": "step_done", "DSV41_STEP": "launch",
                                           "DSV41_DURATION_S": "1.5"})]
    assert "event listener failed on step_done: ZeroDivisionError" in stream.getvalue()
    unsubscribe()
    log.info("serving", "serving")
    assert len(seen) == 1


def test_the_server_serves_metrics_and_only_metrics():
    registry = collector(Snapshot(phase="stopped"))
    server = MetricsServer("127.0.0.1", 0, registry).start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as reply:
            assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            families = {f.name for f in text_string_to_metric_families(reply.read().decode())}
        assert "dsv41_phase" in families
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/", timeout=10)
        assert info.value.code == 404
    finally:
        server.stop()


def test_a_failing_collector_fails_the_scrape_not_the_server():
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ClusterCollector(lambda: 1 / 0, NODES, Recorder(), dict, None, 0, ()))
    server = MetricsServer("127.0.0.1", 0, registry).start()
    try:
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10)
        assert info.value.code == 500 and b"ZeroDivisionError" in info.value.read()
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10)  # still answering
    finally:
        server.stop()


def test_the_dashboard_reads_only_families_the_coordinator_exposes():
    dashboard = json.loads((REPO / "packaging" / "grafana" / "dsv41-cluster.json").read_text())
    snap = Snapshot(phase="serving", ranks={})
    recorder = Recorder()
    recorder.on_incident(Incident(1.0, "spark3", "rank_exit", "died"))
    recorder.on_event("step_done", "info", {"DSV41_STEP": "health", "DSV41_DURATION_S": "1"})
    recorder.on_event("memory_abort", "err", {})
    pack = pb.PackState(layers=[pb.PackLayerState(layer=1, state="complete")])
    views = {n: NodeView(n, True, status(GB), pack) for n in NODES}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ClusterCollector(lambda: snap, NODES, recorder, lambda: views, lambda: GB, int(1.5 * GB),
                                       ("spark2", "spark3"), lambda: {n: (0.5, 1.0, 10) for n in NODES}))
    exposed = {s.name for f in scrape(registry).values() for s in f.samples}
    import re
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in dashboard["templating"]["list"]]
    used = {name for e in exprs for name in re.findall(r"\b(dsv41_[a-z0-9_]+)", e)}
    assert used and used <= exposed, used - exposed
    assert {"dsv41_phase", "dsv41_incidents_total", "dsv41_node_memory_available_bytes",
            "dsv41_guard_lowest_margin_bytes", "dsv41_node_lease_age_seconds", "dsv41_rank_step_age_seconds"} <= used
    assert any("sglang:" in e for e in exprs)  # SGLang's own /metrics beside them
    assert dashboard["uid"] == "dsv41-cluster" and len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def test_the_gpu_families_carry_each_gpu_s_figures_labelled_by_node_index_and_uuid():
    from coordinator.gpuslow import GpuFigures, GpuSlow
    from dsv41.gpu import REASON_NAMES
    busy = pb.GpuState(index=0, uuid="GPU-a", name="NVIDIA GB10", sm_clock_mhz=2418, temperature_c=71, power_w=38.2,
                       utilization_gpu_pct=97, throttle_mask=0x60,
                       throttle_reasons=["sw_thermal_slowdown", "hw_thermal_slowdown"], xid_count=2)
    # An H100-like GPU that gives memory clocks, idle; a figure not given has no sample.
    idle = pb.GpuState(index=1, uuid="GPU-b", sm_clock_mhz=345, memory_clock_mhz=2619, utilization_gpu_pct=0,
                       throttle_mask=0x1, throttle_reasons=["gpu_idle"])
    with_gpus = status(90 * GB)
    with_gpus.gpus.extend([busy, idle])
    views = {"spark1": NodeView("spark1", True, with_gpus), "spark2": NodeView("spark2", True, status(80 * GB)),
             "spark3": NodeView("spark3", False)}
    slow = (GpuSlow(GpuFigures("spark1", 0, "GPU-a"), "throttle reasons hw_thermal_slowdown", 130.0),)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ClusterCollector(lambda: Snapshot(phase="serving", since=1.0, ranks={}), NODES, Recorder(),
                                       lambda: views, None, 0, (), gpu_slow=lambda: slow))
    families = scrape(registry)
    a = (("gpu", "0"), ("node", "spark1"), ("uuid", "GPU-a"))
    b = (("gpu", "1"), ("node", "spark1"), ("uuid", "GPU-b"))
    assert samples(families, "dsv41_gpu_sm_clock_mhz") == {a: 2418, b: 345}
    assert samples(families, "dsv41_gpu_memory_clock_mhz") == {b: 2619}  # the GB10 gives none
    assert samples(families, "dsv41_gpu_power_watts") == {a: 38.2}
    assert samples(families, "dsv41_gpu_temperature_celsius") == {a: 71}
    assert samples(families, "dsv41_gpu_utilization_ratio") == {a: 0.97, b: 0.0}
    throttle = samples(families, "dsv41_gpu_throttle")
    assert len(throttle) == 2 * len(REASON_NAMES)
    assert {dict(k)["reason"] for k, v in throttle.items() if v == 1 and dict(k)["gpu"] == "0"} == {
        "sw_thermal_slowdown", "hw_thermal_slowdown"}
    assert throttle[(*b[:2], ("reason", "gpu_idle"), b[2])] == 1
    assert samples(families, "dsv41_gpu_xid_errors_total") == {a: 2, b: 0}
    assert samples(families, "dsv41_gpu_slow") == {a: 1, b: 0}


def test_the_gpu_families_are_empty_without_gpus():
    views = {n: NodeView(n, True, status(90 * GB)) for n in NODES}
    registry = collector(Snapshot(phase="serving", since=1.0, ranks={}), views=views)
    families = scrape(registry)
    assert "dsv41_gpu_sm_clock_mhz" in families and samples(families, "dsv41_gpu_sm_clock_mhz") == {}


def test_each_poll_goes_to_the_gpu_watch_and_a_gpu_slow_too_long_is_an_incident_once():
    from coordinator.gpuslow import GpuSlowRules, GpuSlowWatch
    from coordinator.gpuwatch import GpuSlowIncidents
    from coordinator.metrics.nodes import NodePoller
    from tests.fakeclock import FakeClock

    hot = status(90 * GB)
    hot.gpus.add(index=0, uuid="GPU-a", name="NVIDIA GB10", sm_clock_mhz=1100, utilization_gpu_pct=99,
                 temperature_c=97, throttle_reasons=["hw_slowdown", "hw_thermal_slowdown"])

    class Client:
        def status(self, timeout):
            return hot
    polls = []
    poller = NodePoller({"spark1": Client()}, {}, 5.0, on_poll=polls.append)
    poller.poll_once()
    poller.start().stop()  # (stop shuts its pool down)
    assert polls[0]["spark1"].status is hot

    clock, stream = FakeClock(), io.StringIO()
    log = EventLog("test", {}, stream=stream, use_journal=False)
    reported = []
    gpus = GpuSlowIncidents(GpuSlowWatch(GpuSlowRules(slow_s=10.0), clock.monotonic),
                            lambda *seen: reported.append(seen), log)
    views = {"spark1": NodeView("spark1", True, hot), "spark2": NodeView("spark2", False)}
    for step in (0, 11, 5):
        clock.advance(step)
        gpus.on_poll(views)
    lines = [line for line in stream.getvalue().splitlines() if "DSV41_EVENT=gpu_slow" in line]
    assert len(lines) == 1, stream.getvalue()
    assert "spark1 GPU0 NVIDIA GB10: slow for 11 s (throttle reasons hw_slowdown, hw_thermal_slowdown" in lines[0]
    assert "Known remedy" in lines[0] and "DSV41_NODE=spark1" in lines[0] and "DSV41_SLOW_S=11" in lines[0]
    assert [s.gpu.node for s in gpus.slow()] == ["spark1"]
    assert len(reported) == 1 and reported[0][:2] == ("spark1", "gpu_slow") and "Known remedy" in reported[0][2]
