"""Counters and histograms that events and incidents move (thread-safe, kept in memory: they
start at zero with the coordinator, as Prometheus counters may, except the incident counters, which
carry on from the coordinator's incident history)."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

from prometheus_client.utils import floatToGoString

from .events import Count, Observe, updates_of

# Bring-up steps last from milliseconds (fabric) to hours (pack); health waits for a 12-minute load.
STEP_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 900.0, 1200.0, 1800.0, 3600.0,
                7200.0, 14400.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; last: above every bound
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, count) pairs as Prometheus exposes them, +Inf last."""
        out, running = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            running += count
            out.append((floatToGoString(bound), running))  # "30.0", "+Inf": as prometheus_client's own
        return out


class Recorder:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        self._histograms: dict[str, dict[tuple[tuple[str, str], ...], Histogram]] = {}

    # -- inputs

    def on_event(self, kind: str, priority: str, fields: dict[str, str]) -> None:
        """An EventLog listener."""
        for update in updates_of(kind, fields):
            self.apply(update)

    def on_incident(self, incident) -> None:
        """A ClusterRuntime.on_incident listener."""
        self.apply(Count("dsv41_incidents", (("kind", incident.kind), ("node", incident.node))))

    def add_incidents(self, counts: dict[tuple[str, str], int]) -> None:
        """Incidents counted before this recorder, by (kind, node): earlier coordinators' among them."""
        for (kind, node), count in counts.items():
            self.apply(Count("dsv41_incidents", (("kind", kind), ("node", node)), count))

    def apply(self, update: Count | Observe) -> None:
        with self._lock:
            if isinstance(update, Count):
                family = self._counters.setdefault(update.family, {})
                family[update.labels] = family.get(update.labels, 0.0) + update.amount
            else:
                family = self._histograms.setdefault(update.family, {})
                family.setdefault(update.labels, Histogram(STEP_BUCKETS)).observe(update.value)

    # -- outputs

    def counters(self, family: str) -> dict[tuple[tuple[str, str], ...], float]:
        with self._lock:
            return dict(self._counters.get(family, {}))

    def histograms(self, family: str) -> dict[tuple[tuple[str, str], ...], Histogram]:
        with self._lock:
            return {labels: Histogram(h.buckets, list(h.counts), h.total)
                    for labels, h in self._histograms.get(family, {}).items()}
