"""The GPU slow state: a thermal or hardware slowdown, or busy below the expected SM clock, seen
continuously for longer than GPU_SLOW_S, once per episode, with the figures and the known remedy."""

from __future__ import annotations

import pytest

from coordinator import config
from coordinator.gpuslow import (REMEDY, GpuFigures, GpuSlowRules, GpuSlowWatch, decide_slow, figures_of,
                                 rules_from_config, slow_cause)
from dsv41.v1 import agent_pb2 as pb
from tests.configtext import HOME, SEED_TEXT, edited
from tests.fakeclock import FakeClock

pytestmark = pytest.mark.unit

RULES = GpuSlowRules(slow_s=120.0, busy_ratio=0.5, expected_sm_mhz=2400)


def gpu(sm=2418, busy=0.97, reasons=(), node="spark1", index=0, uuid="GPU-a"):
    return GpuFigures(node=node, index=index, uuid=uuid, name="NVIDIA GB10", sm_clock_mhz=sm, utilization_ratio=busy,
                      temperature_c=71, power_w=38.2, reasons=reasons)


@pytest.mark.parametrize("figures, rules, slow", [
    (gpu(), RULES, False),                                            # busy at its clock
    (gpu(sm=1600), RULES, True),                                      # busy below it: the slow state
    (gpu(sm=1600, busy=0.2), RULES, False),                           # idle GPUs clock down
    (gpu(sm=1600, busy=0.5), RULES, True),                            # the ratio is inclusive
    (gpu(sm=1600), GpuSlowRules(expected_sm_mhz=None), False),        # the clock rule is off
    (gpu(sm=None), RULES, False),                                     # no clock figure: no clock rule
    (gpu(busy=None, sm=1600), RULES, False),
    (gpu(busy=0.0, reasons=("hw_thermal_slowdown",)), GpuSlowRules(), True),  # heat counts even idle
    (gpu(reasons=("sw_thermal_slowdown",)), GpuSlowRules(), True),
    (gpu(reasons=("hw_slowdown",)), GpuSlowRules(), True),
    (gpu(reasons=("hw_power_brake_slowdown",)), GpuSlowRules(), True),
    (gpu(reasons=("sw_power_cap",)), GpuSlowRules(), False),          # at its power limit as designed
    (gpu(reasons=("gpu_idle", "applications_clocks_setting", "sync_boost")), GpuSlowRules(), False),
])
def test_what_counts_as_slow(figures, rules, slow):
    assert (slow_cause(figures, rules) is not None) == slow


def test_slow_only_after_gpu_slow_s_without_a_break_and_reported_once_per_episode():
    tracks = {}
    seen = []
    for now, figures in [(0, gpu(sm=1600)), (60, gpu(sm=1600)), (120, gpu(sm=1600)), (121, gpu(sm=1600)),
                         (180, gpu(sm=1600)), (200, gpu()), (210, gpu(sm=1600)), (331, gpu(sm=1600))]:
        decision = decide_slow(tracks, [figures], RULES, float(now))
        tracks = decision.tracks
        seen.append((now, len(decision.slow), [round(s.for_s) for s in decision.newly_slow]))
    assert seen == [(0, 0, []), (60, 0, []), (120, 0, []), (121, 1, [121]), (180, 1, []), (200, 0, []),
                    (210, 0, []), (331, 1, [121])]


def test_a_gpu_missing_from_a_poll_starts_again():
    tracks = decide_slow({}, [gpu(sm=1600)], RULES, 0.0).tracks
    tracks = decide_slow(tracks, [], RULES, 100.0).tracks  # its node did not answer
    assert decide_slow(tracks, [gpu(sm=1600)], RULES, 200.0).slow == ()


def test_gpus_are_told_apart_by_node_and_uuid():
    both = [gpu(sm=1600, node="spark1"), gpu(node="spark2", reasons=("hw_thermal_slowdown",))]
    tracks = decide_slow({}, both, RULES, 0.0).tracks
    decision = decide_slow(tracks, both, RULES, 130.0)
    assert sorted(s.gpu.node for s in decision.newly_slow) == ["spark1", "spark2"]


def test_the_message_has_the_figures_the_cause_and_the_known_remedy():
    tracks = decide_slow({}, [gpu(sm=1600)], RULES, 0.0).tracks
    found = decide_slow(tracks, [gpu(sm=1600)], RULES, 150.0).newly_slow[0]
    assert found.message == ("spark1 GPU0 NVIDIA GB10: slow for 150 s (97 % busy at 1600 MHz SM, below the expected "
                             "2400 MHz; 1600 MHz SM, 97 % busy, 71 °C, 38.2 W). Known remedy: " + REMEDY)
    assert "AC power is removed" in REMEDY and "overheats soft-locks" in REMEDY


def test_the_watch_reads_node_statuses_with_its_clock():
    clock = FakeClock()
    watch = GpuSlowWatch(GpuSlowRules(slow_s=30.0), clock.monotonic)
    hot = pb.NodeStatus(gpus=[pb.GpuState(index=0, uuid="GPU-a", name="NVIDIA GB10", sm_clock_mhz=900,
                                          utilization_gpu_pct=99, temperature_c=97,
                                          throttle_reasons=["hw_slowdown", "hw_thermal_slowdown"])])
    assert watch.observe({"spark1": hot}) == ()
    clock.advance(31)
    found = watch.observe({"spark1": hot, "spark2": pb.NodeStatus()})
    assert [(s.gpu.node, s.cause) for s in found] == [("spark1", "throttle reasons hw_slowdown, hw_thermal_slowdown")]
    assert watch.slow() == found
    clock.advance(5)
    assert watch.observe({"spark1": hot}) == () and len(watch.slow()) == 1


def test_an_absent_figure_stays_none():
    figures = figures_of("spark1", pb.GpuState(index=1, utilization_gpu_pct=0))
    assert figures.sm_clock_mhz is None and figures.utilization_ratio == 0.0 and figures.power_w is None


def test_the_rules_come_from_cluster_env():
    cfg = config.parse(SEED_TEXT, "/etc/dsv41/cluster.env", HOME)
    assert rules_from_config(cfg) == GpuSlowRules(slow_s=120.0, busy_ratio=0.5, expected_sm_mhz=None)
    cfg = config.parse(edited(GPU_EXPECTED_SM_MHZ="2400", GPU_SLOW_S="60", GPU_BUSY_RATIO="0.8"),
                       "/etc/dsv41/cluster.env", HOME)
    assert rules_from_config(cfg) == GpuSlowRules(slow_s=60.0, busy_ratio=0.8, expected_sm_mhz=2400)


@pytest.mark.parametrize("key, value", [("GPU_BUSY_RATIO", "0"), ("GPU_BUSY_RATIO", "1.5"), ("GPU_SLOW_S", "0"),
                                        ("GPU_EXPECTED_SM_MHZ", "fast")])
def test_bad_values_are_refused_with_what_is_allowed(key, value):
    with pytest.raises(config.ConfigInvalid) as info:
        config.parse(edited(**{key: value}), "/etc/dsv41/cluster.env", HOME)
    assert key in str(info.value.errors[0]) and "must be" in str(info.value.errors[0])
