"""The cluster's phases and incident kinds, and the phases the memory guard watches, all derived
from one declaration each (coordinator/state.py, the bring-up registry)."""

from dataclasses import replace

import pytest

from coordinator import bringup
from coordinator.metrics.collector import PHASES as METRIC_PHASES
from coordinator.state import IncidentKind, Phase, Ranks, step_failed

pytestmark = pytest.mark.unit


def test_phase_and_incident_values_are_what_status_metrics_and_hooks_have_always_shown():
    assert [str(p) for p in Phase] == [
        "starting", "stopped", "preflight", "share", "fabric", "collective", "pack", "launch", "health", "smoke", "serving",
        "draining",
        "stopping", "restarting", "waiting", "failed", "unknown"]
    assert {str(k) for k in IncidentKind} == {
        "rank_exit", "memory_floor", "node_lost", "node_rebooted", "rank_hung", "stopped", "export_forced",
        "rolled_back", "fabric_changed", "gpu_slow",
        *(f"{s.name.value}_failed" for s in bringup.STEPS)}
    assert f"{Phase.SERVING}" == "serving" and Phase.SERVING == "serving"


def test_the_metrics_list_every_phase_the_coordinator_reports_in_the_order_dashboards_saw():
    assert list(METRIC_PHASES) == [p for p in Phase if p is not Phase.UNKNOWN]


def test_every_bring_up_step_is_a_phase_with_its_own_failure_incident():
    assert bringup.PHASES == (Phase.PREFLIGHT, Phase.SHARE, Phase.FABRIC, Phase.COLLECTIVE, Phase.PACK, Phase.LAUNCH, Phase.HEALTH,
                              Phase.SMOKE)
    for step in bringup.STEPS:
        assert isinstance(step.name, Phase)
        assert step_failed(step.name) == f"{step.name}_failed"
    with pytest.raises(ValueError):
        step_failed(Phase.SERVING)  # not a step: no such incident


def test_ranks_run_in_every_step_from_launch_on_and_in_none_before():
    names = [step.name for step in bringup.STEPS]
    first = names.index(bringup.RANKS_RUN_FROM)
    assert bringup.RANKS_RUN_FROM == Phase.LAUNCH
    assert all(step.ranks is Ranks.NONE for step in bringup.STEPS[:first])
    assert all(step.ranks is not Ranks.NONE for step in bringup.STEPS[first:])


def test_the_guard_watches_every_step_after_launch_and_the_supervisors_phases_with_ranks():
    after_launch = {step.name for step in bringup.STEPS[bringup.PHASES.index(Phase.LAUNCH):]}
    assert after_launch <= set(bringup.GUARDED_PHASES)
    # what the hand-written table said before it was derived
    assert bringup.GUARDED_PHASES == {"launch": False, "health": False, "smoke": False, "serving": True, "draining": True,
                                      "stopping": True}
    unwatched = set(Phase) - set(bringup.GUARDED_PHASES)
    assert unwatched == {Phase.STARTING, Phase.STOPPED, Phase.PREFLIGHT, Phase.SHARE, Phase.FABRIC, Phase.COLLECTIVE, Phase.PACK,
                         Phase.RESTARTING, Phase.WAITING, Phase.FAILED, Phase.UNKNOWN}


def test_a_step_after_launch_that_says_no_rank_runs_is_refused_not_left_unguarded():
    """A new step after launch cannot be silently unguarded: its Step must say what its ranks do
    (a required field), and the registry refuses a step that says none run once they have started."""
    with pytest.raises(TypeError):
        bringup.Step(Phase.SMOKE, "SMOKE_TIMEOUT_S", retryable=True, run=lambda ctx, d: None)
    unguarded = replace(bringup.BY_NAME["smoke"], ranks=Ranks.NONE)
    with pytest.raises(ValueError, match="bring-up step smoke comes after ranks started"):
        bringup.guarded_phases((*bringup.STEPS[:-1], unguarded))
    serving_smoke = replace(bringup.BY_NAME["smoke"], ranks=Ranks.SERVING)
    assert bringup.guarded_phases((*bringup.STEPS[:-1], serving_smoke))[Phase.SMOKE] is True
