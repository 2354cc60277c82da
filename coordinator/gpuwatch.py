"""The GPU slow state as an incident, whether or not metrics are on.

Each status poll's GPU figures go to coordinator.gpuslow's watch: a GPU slow for longer than
GPU_SLOW_S is a gpu_slow incident (once per episode, with its figures and the known remedy), and its
end is a notice. The poll is the metrics' (every METRICS_POLL_S) when they are on, else a poller of
this module's own (every GPU_POLL_S) over agent clients of its own, so that an agent that is down
never puts the supervisor's channel into reconnect backoff.

No restart follows a gpu_slow incident. A restart cannot help: a GB10 latched in its slow state stays
there until its node's AC power is removed, and a hot GPU is as hot after the bring-up; the group
would only lose what it has in flight and a bring-up's minutes, then run exactly as slow again. The
operator removes the cause (power-cycles the node, fixes the airflow) and the episode ends by itself.
"""

from __future__ import annotations

from typing import Callable, Mapping

from dsv41.journal import EventLog

from .gpuslow import GpuSlow, GpuSlowWatch
from .state import IncidentKind


class GpuSlowIncidents:
    """Feeds GpuSlowWatch from status polls; report(node, kind, message) records an incident (the
    runtime's post of a messages.IncidentSeen: only the supervisor thread records incidents)."""

    def __init__(self, watch: GpuSlowWatch, report: Callable[[str, str, str], None], log: EventLog):
        self._watch = watch
        self._report = report
        self._log = log

    def slow(self) -> tuple[GpuSlow, ...]:
        """The GPUs slow now (for dsv41_gpu_slow)."""
        return self._watch.slow()

    def observe(self, statuses: Mapping[str, object]) -> None:
        """One poll: node -> pb.NodeStatus of the nodes that answered."""
        before = {s.gpu.key: s for s in self._watch.slow()}
        for slow in self._watch.observe(statuses):
            self._log.warning("gpu_slow", slow.message, node=slow.gpu.node, gpu=slow.gpu.index,
                              uuid=slow.gpu.uuid, cause=slow.cause, slow_s=round(slow.for_s))
            self._report(slow.gpu.node, IncidentKind.GPU_SLOW.value, slow.message)
        now = {s.gpu.key for s in self._watch.slow()}
        for key, was in before.items():
            if key in now:
                continue
            where = "its node did not answer" if was.gpu.node not in statuses else "no longer slow"
            self._log.info("gpu_slow_cleared", f"{was.gpu.node} GPU{was.gpu.index} {was.gpu.name}: {where} "
                           f"(slow for at least {was.for_s:.0f} s)", node=was.gpu.node, gpu=was.gpu.index,
                           uuid=was.gpu.uuid)

    def on_poll(self, views: Mapping[str, object]) -> None:
        """A NodePoller's on_poll: its views (metrics.nodes.NodeView) of the nodes."""
        self.observe({node: view.status for node, view in views.items() if view.up and view.status is not None})
