"""The GPU slow state as an incident: a GB10's figures read through the agent's telemetry over the
stand-in NVML (tests/nvmlstandin.py), carried in NodeStatus as GetStatus does, fed poll by poll on a
fake clock: a gpu_slow incident once per episode with the figures and the remedy, a notice when it
clears; and the coordinator's own poll when metrics are off."""

from __future__ import annotations

import io

import pytest

from agent.gpu.nvml import Nvml
from agent.gpu.telemetry import GpuTelemetry
from agent.service import gpu_state_pb
from coordinator.gpuslow import GpuSlowRules, GpuSlowWatch
from coordinator.gpuwatch import GpuSlowIncidents
from coordinator.metrics.nodes import NodePoller
from dsv41.journal import EventLog
from dsv41.v1 import agent_pb2 as pb
from tests.fakeclock import FakeClock
from tests.nvmlstandin import GB10, StandInNvml

pytestmark = pytest.mark.unit
HW_THERMAL_SLOWDOWN = 0x40


def node_status(lib: StandInNvml, clock: FakeClock) -> pb.NodeStatus:
    telemetry = GpuTelemetry(lambda: Nvml(lambda: lib), None, clock.monotonic, watch_xid=False)
    try:
        return pb.NodeStatus(node="spark1", gpus=[gpu_state_pb(g) for g in telemetry.read().gpus])
    finally:
        telemetry.close()


def test_a_hot_gb10_is_an_incident_once_per_episode_with_its_figures_and_remedy_and_its_end_a_notice():
    clock, stream = FakeClock(), io.StringIO()
    log = EventLog("test", {}, stream=stream, use_journal=False)
    reported = []
    gpus = GpuSlowIncidents(GpuSlowWatch(GpuSlowRules(slow_s=120.0), clock.monotonic),
                            lambda *seen: reported.append(seen), log)
    hot = StandInNvml([dict(GB10, reasons=HW_THERMAL_SLOWDOWN, temperature=96, clock={0: 1100, 1: 1100})])
    for _ in range(5):  # a poll every 30 s: slow at 0, 30, ..., 120 (not longer than 120 s yet)
        gpus.observe({"spark1": node_status(hot, clock)})
        clock.advance(30)
    assert reported == []
    for _ in range(3):
        gpus.observe({"spark1": node_status(hot, clock)})
        clock.advance(30)
    assert len(reported) == 1
    node, kind, message = reported[0]
    assert (node, kind) == ("spark1", "gpu_slow")
    assert message.startswith("spark1 GPU0 NVIDIA GB10: slow for 150 s (throttle reasons hw_thermal_slowdown; "
                              "1100 MHz SM, 97 % busy, 96 °C, 38.2 W). Known remedy: the GB10 slow state clears "
                              "only when the node's AC power is removed")
    assert [s.gpu.node for s in gpus.slow()] == ["spark1"]
    gpus.observe({"spark1": node_status(StandInNvml([GB10]), clock)})  # well again
    assert gpus.slow() == () and len(reported) == 1
    cleared = [line for line in stream.getvalue().splitlines() if "DSV41_EVENT=gpu_slow_cleared" in line]
    assert len(cleared) == 1 and "spark1 GPU0 NVIDIA GB10: no longer slow (slow for at least 210 s)" in cleared[0]


def test_with_metrics_off_the_coordinator_polls_the_agents_itself():
    clock = FakeClock()
    hot = node_status(StandInNvml([dict(GB10, reasons=HW_THERMAL_SLOWDOWN)]), clock)

    class Client:
        def status(self, timeout):
            return hot
    reported = []
    gpus = GpuSlowIncidents(GpuSlowWatch(GpuSlowRules(slow_s=10.0), clock.monotonic),
                            lambda *seen: reported.append(seen), EventLog("test", {}, stream=io.StringIO(),
                                                                        use_journal=False))
    poller = NodePoller({"spark1": Client()}, {}, 15.0, on_poll=gpus.on_poll)
    try:
        for step in (0, 11):
            clock.advance(step)
            poller.poll_once()
    finally:
        poller.stop()
    assert [r[:2] for r in reported] == [("spark1", "gpu_slow")]
