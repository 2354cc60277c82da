"""The metric families, built at each scrape from the runtime's snapshot, the recorder's counters,
the node poller's last answers and the guard's margin window (prometheus_client's custom
collector interface, the same in Debian 12's 0.16 and Ubuntu 24.04's 0.19)."""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from dsv41.adapterversion import adapter_stale
from dsv41.gpu import REASON_NAMES
from dsv41.version import VERSION
from dsv41.v1 import agent_pb2 as pb

from ..bringup import PHASES as STEP_PHASES
from ..packstate import layer_state
from ..state import Phase
from .nodes import NodeView
from .recorder import Recorder

# Every phase the runtime reports, so that a dashboard sees each one at 0 before it first happens:
# the bring-up steps' (from their registry) and the supervisor's own.
PHASES = (Phase.STARTING, Phase.STOPPED, *STEP_PHASES, Phase.SERVING, Phase.DRAINING, Phase.STOPPING,
          Phase.RESTARTING, Phase.WAITING, Phase.FAILED)
RESOURCES = ("cpu", "memory", "io")


def collective_families(report) -> list[GaugeMetricFamily]:
    """The collective gate's last figures (bring-up or `dsv41ctl fabric test`): none before it ran."""
    if report is None:
        return []
    busbw = GaugeMetricFamily("dsv41_collective_busbw_gbps",
                              "all-reduce bus bandwidth of a pair of nodes or of the whole group ('all'), GB/s, "
                              "at the collective gate's last run", labels=["group"])
    for figure in report.figures:
        busbw.add_metric([figure.group], figure.busbw_gbps)
    passed = GaugeMetricFamily("dsv41_collective_gate_ok", "1 when the collective gate's last run passed")
    passed.add_metric([], 1 if report.ok else 0)
    at = GaugeMetricFamily("dsv41_collective_measured_seconds", "when the collective gate last ran (unix time)")
    at.add_metric([], report.at_unix_s)
    return [busbw, passed, at]


class ClusterCollector:
    def __init__(self, snapshot: Callable[[], object], nodes: list[str], recorder: Recorder,
                 views: Callable[[], dict[str, NodeView]], guard_low: Callable[[], float | None] | None,
                 guard_bytes: int, mounts: tuple[str, ...],
                 liveness: Callable[[], dict[str, tuple[float, float, int]]] = dict,
                 gpu_slow: Callable[[], tuple] = tuple):
        """`mounts`: the workers that mount the head's export (empty with NFS_SHARE=0);
        `guard_low`: the lowest available memory the guard saw lately (None: no guard);
        `liveness`: node -> (lease age, step age, forward steps), -1 where not known;
        `gpu_slow`: the GPUs slow now (coordinator.gpuslow.GpuSlow)."""
        self._liveness = liveness
        self._gpu_slow = gpu_slow
        self._snapshot = snapshot
        self._nodes = nodes
        self._recorder = recorder
        self._views = views
        self._guard_low = guard_low
        self._guard_bytes = guard_bytes
        self._mounts = mounts

    def describe(self):
        return []  # families are built at collect time; nothing to check at registration

    def collect(self) -> Iterator:
        snap = self._snapshot()
        yield from self._cluster(snap)
        yield from self._events()
        yield from self._node_figures(self._views())
        yield from self._guard()
        yield from liveness_families(self._liveness())
        yield from gpu_families(self._nodes, self._views(), self._gpu_slow())

    def _cluster(self, snap) -> Iterator:
        info = GaugeMetricFamily("dsv41_coordinator_info", "the coordinator's version", labels=["version"])
        info.add_metric([VERSION], 1)
        yield info
        phase = GaugeMetricFamily("dsv41_phase", "1 for the cluster's current phase, 0 for the others",
                                  labels=["phase"])
        for name in dict.fromkeys((*PHASES, snap.phase)):
            phase.add_metric([name], 1 if name == snap.phase else 0)
        yield phase
        yield from collective_families(getattr(snap, "collective", None))
        since = GaugeMetricFamily("dsv41_phase_since_seconds", "when the current phase began (unix time)")
        since.add_metric([], snap.since)
        yield since
        running = sum(1 for rank in snap.ranks.values() if rank.active_state == "active")
        yield GaugeMetricFamily("dsv41_ranks_running", "rank units active, as the agents' rank streams report",
                                value=running)
        yield GaugeMetricFamily("dsv41_ranks_total", "ranks of the cluster (nodes)", value=len(self._nodes))
        yield GaugeMetricFamily("dsv41_restart_attempt", "restart attempt of the current recovery (0: none)",
                                value=snap.restart_attempt)

    def _events(self) -> Iterator:
        incidents = CounterMetricFamily("dsv41_incidents", "incidents (rank exits, failed steps, stops, forced "
                                        "unexports) since the coordinator started", labels=["kind", "node"])
        for labels, value in sorted(self._recorder.counters("dsv41_incidents").items()):
            incidents.add_metric([dict(labels)["kind"], dict(labels)["node"]], value)
        yield incidents
        restarts = CounterMetricFamily("dsv41_restarts", "restart attempts after a rank failure")
        restarts.add_metric([], sum(self._recorder.counters("dsv41_restarts").values()))
        yield restarts
        actions = CounterMetricFamily("dsv41_guard_actions", "memory guard actions (abort, abort_all, stop; "
                                      "*_observed: what MEMORY_GUARD=observe would have done)", labels=["action"])
        for labels, value in sorted(self._recorder.counters("dsv41_guard_actions").items()):
            actions.add_metric([dict(labels)["action"]], value)
        yield actions
        hooks = CounterMetricFamily("dsv41_incident_hook_runs", "INCIDENT_HOOK runs by outcome (ok, failed, "
                                    "dropped)", labels=["outcome"])
        for labels, value in sorted(self._recorder.counters("dsv41_incident_hook_runs").items()):
            hooks.add_metric([dict(labels)["outcome"]], value)
        yield hooks
        steps = HistogramMetricFamily("dsv41_bringup_step_seconds", "duration of each completed bring-up step",
                                      labels=["step"])
        for labels, histogram in sorted(self._recorder.histograms("dsv41_bringup_step_seconds").items()):
            steps.add_metric([dict(labels)["step"]], histogram.cumulative(), histogram.total)
        yield steps

    def _node_figures(self, views: dict[str, NodeView]) -> Iterator:
        up = GaugeMetricFamily("dsv41_agent_up", "1 when the node's agent answered the last status poll",
                               labels=["node"])
        available = GaugeMetricFamily("dsv41_node_memory_available_bytes", "memory available on the node: "
                                      "min(MemAvailable, the node cgroup's headroom)", labels=["node"])
        psi = GaugeMetricFamily("dsv41_node_psi_some_avg10", "PSI some avg10 of the node (percent of time some "
                                "task stalled, over 10 s)", labels=["node", "resource"])
        psi_full = GaugeMetricFamily("dsv41_node_psi_full_avg10", "PSI full avg10 of the node (percent)",
                                     labels=["node", "resource"])
        mount = GaugeMetricFamily("dsv41_mount_healthy", "1 when the worker's mount of the head's weights "
                                  "export is healthy", labels=["node"])
        pack = GaugeMetricFamily("dsv41_pack_complete", "1 when the node's packed Engram shard of the layer is "
                                 "complete", labels=["node", "layer"])
        rank_memory = GaugeMetricFamily("dsv41_rank_memory_bytes", "memory of the node's rank unit (cgroup)",
                                        labels=["node"])
        stale = GaugeMetricFamily("dsv41_rank_adapter_stale", "1 when the node's running rank loaded another "
                                  "adapter version than is installed now (the next restart loads it); absent "
                                  "when either is unknown", labels=["node"])
        for node in self._nodes:
            view = views.get(node)
            up.add_metric([node], 1 if view is not None and view.up else 0)
            if view is None or not view.up or view.status is None:
                continue  # no figures rather than stale or made-up ones
            status = view.status
            available.add_metric([node], status.memory.available_bytes)
            if status.rank.memory_current_bytes:
                rank_memory.add_metric([node], status.rank.memory_current_bytes)
            if status.rank.adapter_version and status.adapter_version:
                stale.add_metric([node], 1 if adapter_stale(status.rank.adapter_version, status.adapter_version) else 0)
            for resource, (some, full) in pressures(status).items():
                psi.add_metric([node, resource], some)
                psi_full.add_metric([node, resource], full)
            if node in self._mounts:
                mount.add_metric([node], 1 if status.mount.state == pb.MountState.HEALTHY else 0)
            if view.pack is not None:
                for layer in view.pack.layers:
                    complete = layer_state(layer) == pb.PackLayerState.COMPLETE
                    pack.add_metric([node, str(layer.layer)], 1 if complete else 0)
        yield from (up, available, psi, psi_full, mount, pack, rank_memory, stale)

    def _guard(self) -> Iterator:
        if self._guard_low is None:
            return
        low = self._guard_low()
        if low is None:
            return  # the guard watches only while the cluster serves
        yield GaugeMetricFamily("dsv41_guard_lowest_margin_bytes", "lowest available memory minus MEMORY_GUARD_GB "
                                "that the memory guard saw on any node over the last minute", value=low - self._guard_bytes)


def pressures(status) -> dict[str, tuple[float, float]]:
    """resource -> (some avg10, full avg10); an agent without NodeStatus.pressure reports memory only."""
    out = {p.resource: (p.some.avg10, p.full.avg10) for p in status.pressure if p.resource in RESOURCES}
    if not out:
        out["memory"] = (status.memory.some.avg10, status.memory.full.avg10)
    return out


GPU_LABELS = ["node", "gpu", "uuid"]


def gpu_families(nodes: list[str], views: dict[str, NodeView], slow: tuple = ()) -> list:
    """Each GPU's figures from its node's last status (NodeStatus.gpus), labelled node, gpu (NVML
    index) and uuid; a figure the GPU does not give (a GB10 has no memory clock) has no sample."""
    figures = {  # family: (help, GpuState field, scale)
        "dsv41_gpu_sm_clock_mhz": ("current SM clock (MHz)", "sm_clock_mhz", 1),
        "dsv41_gpu_memory_clock_mhz": ("current memory clock (MHz)", "memory_clock_mhz", 1),
        "dsv41_gpu_power_watts": ("power draw (W)", "power_w", 1),
        "dsv41_gpu_temperature_celsius": ("GPU temperature (°C)", "temperature_c", 1),
        "dsv41_gpu_utilization_ratio": ("part of the last sample period a kernel ran (0..1)",
                                        "utilization_gpu_pct", 0.01),
    }
    families = {name: GaugeMetricFamily(name, doc, labels=GPU_LABELS) for name, (doc, _, _) in figures.items()}
    throttle = GaugeMetricFamily("dsv41_gpu_throttle", "1 for each reason NVML gives for holding the GPU's clocks "
                                 "down (gpu_idle, sw_power_cap, hw_slowdown, sw_thermal_slowdown, ...), 0 for the "
                                 "others", labels=[*GPU_LABELS, "reason"])
    xid = CounterMetricFamily("dsv41_gpu_xid_errors", "Xid critical errors the driver reported since the node's "
                              "agent started", labels=GPU_LABELS)
    slow_now = {(s.gpu.node, s.gpu.index) for s in slow}
    slow_family = GaugeMetricFamily("dsv41_gpu_slow", "1 while the GPU has been slow (busy below "
                                    "GPU_EXPECTED_SM_MHZ, or a thermal or hardware slowdown) for longer than "
                                    "GPU_SLOW_S", labels=GPU_LABELS)
    for node in nodes:
        view = views.get(node)
        if view is None or not view.up or view.status is None:
            continue
        for gpu in view.status.gpus:
            labels = [node, str(gpu.index), gpu.uuid]
            for name, (_, field, scale) in figures.items():
                if gpu.HasField(field):
                    families[name].add_metric(labels, getattr(gpu, field) * scale)
            if gpu.HasField("throttle_mask"):
                active = set(gpu.throttle_reasons)
                for reason in dict.fromkeys((*REASON_NAMES, *gpu.throttle_reasons)):
                    throttle.add_metric([*labels, reason], 1 if reason in active else 0)
            xid.add_metric(labels, gpu.xid_count)
            slow_family.add_metric(labels, 1 if (node, gpu.index) in slow_now else 0)
    return [*families.values(), throttle, xid, slow_family]


def liveness_families(views: dict[str, tuple[float, float, int]]) -> list:
    """dsv41_node_lease_age_seconds{node}: seconds since the node's agent last sent a heartbeat;
    dsv41_rank_step_age_seconds{node}: seconds since its rank last took a forward step. A node not
    heard from yet, or a rank without a counter, has no sample (no made-up values)."""
    lease = GaugeMetricFamily("dsv41_node_lease_age_seconds",
                              "seconds since the node's agent last sent a heartbeat (its lease: NODE_LEASE_S)",
                              labels=["node"])
    step = GaugeMetricFamily("dsv41_rank_step_age_seconds",
                             "seconds since the node's rank last took a forward step", labels=["node"])
    forward = CounterMetricFamily("dsv41_rank_forward_steps", "forward steps of the node's rank since it started",
                                  labels=["node"])
    for node, (lease_age, step_age, count) in views.items():
        if lease_age >= 0:
            lease.add_metric([node], lease_age)
        if step_age >= 0:
            step.add_metric([node], step_age)
            forward.add_metric([node], count)
    return [lease, step, forward]
