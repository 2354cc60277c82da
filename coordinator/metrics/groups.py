"""The TP groups' and the gateway's families (GROUPS with two or more): built at each scrape from
each group's supervisor and the gateway manager's last look at the gateway."""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily

from .collector import PHASES


class GroupCollector:
    def __init__(self, group_phases: Callable[[], list[tuple[str, str, float]]],
                 gateway_view: Callable[[], object] | None):
        """`group_phases`: (group, phase, serving since) per group; `gateway_view`: the manager's view."""
        self._group_phases = group_phases
        self._gateway_view = gateway_view

    def describe(self):
        return []

    def collect(self) -> Iterator:
        phase = GaugeMetricFamily("dsv41_group_phase", "1 for each TP group's current phase, 0 for the others",
                                  labels=["group", "phase"])
        since = GaugeMetricFamily("dsv41_group_serving_since_seconds",
                                  "when each TP group began serving (unix time; 0 while it does not serve)",
                                  labels=["group"])
        for group, current, serving_since in self._group_phases():
            for name in dict.fromkeys((*PHASES, current)):
                phase.add_metric([group, name], 1 if name == current else 0)
            since.add_metric([group], serving_since)
        yield phase
        yield since
        if self._gateway_view is None:
            return
        view = self._gateway_view()
        up = GaugeMetricFamily("dsv41_gateway_up", "1 while the gateway's unit is active on the head")
        up.add_metric([], 1 if view.unit_state == "active" else 0)
        ready = GaugeMetricFamily("dsv41_gateway_ready", "1 while the gateway has a healthy worker (/readiness)")
        ready.add_metric([], 1 if view.ready else 0)
        workers = GaugeMetricFamily("dsv41_gateway_worker_healthy",
                                    "each worker of the gateway: 1 healthy, 0 not (group empty: no group's)",
                                    labels=["group", "url"])
        for group, url, healthy in view.workers:
            workers.add_metric([group, url], 1 if healthy else 0)
        yield from (up, ready, workers)
