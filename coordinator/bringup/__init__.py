"""The bring-up steps, in order. Each is one module declaring its Step (name, deadline key,
whether a restart can fix its failure); the phase list, the deadlines, the retry rule and the
phases in which the cluster counts as starting all come from here. Adding a step is one module
and one line below."""

from __future__ import annotations

from . import collective, fabric, health, launch, pack, preflight, share, smoke
from ..state import Phase, Ranks
from .step import BringUp, Preempted, Step, StepContext, StepFailed

STEPS: tuple[Step, ...] = (
    preflight.STEP,
    share.STEP,
    fabric.STEP,
    collective.STEP,
    pack.STEP,
    launch.STEP,
    health.STEP,
    smoke.STEP,
)
PHASES: tuple[Phase, ...] = tuple(step.name for step in STEPS)
BY_NAME: dict[str, Step] = {step.name: step for step in STEPS}


def ranks_in(steps: tuple[Step, ...]) -> dict[Phase, Ranks]:
    """What the ranks do in every phase where they may run: each step's own declaration, then the
    supervisor's serving, draining and stopping (rank 0 drains what is in flight); in any other phase none
    runs. Once a step has started ranks, every later step runs them: one that says otherwise is
    refused here, not left unguarded."""
    started = [i for i, step in enumerate(steps) if step.ranks is not Ranks.NONE]
    for step in steps[started[0] if started else len(steps):]:
        if step.ranks is Ranks.NONE:
            raise ValueError(f"bring-up step {step.name} comes after ranks started, so its ranks run: "
                             f"declare Ranks.STARTING or Ranks.SERVING")
    declared = {step.name: step.ranks for step in steps}
    return {**declared, Phase.SERVING: Ranks.SERVING, Phase.DRAINING: Ranks.SERVING, Phase.STOPPING: Ranks.SERVING}


def guarded_phases(steps: tuple[Step, ...]) -> dict[Phase, bool]:
    """The phases the memory guard watches, and whether requests are served in them."""
    return {phase: ranks is Ranks.SERVING for phase, ranks in ranks_in(steps).items() if ranks is not Ranks.NONE}


# From the first step whose ranks run (launch) on, a rank exit is this bring-up's failure.
RANKS_RUN_FROM: Phase = next(step.name for step in STEPS if step.ranks is not Ranks.NONE)
GUARDED_PHASES: dict[Phase, bool] = guarded_phases(STEPS)

__all__ = ["STEPS", "PHASES", "BY_NAME", "RANKS_RUN_FROM", "ranks_in", "guarded_phases", "GUARDED_PHASES", "BringUp",
           "Preempted",            "Step", "StepContext", "StepFailed"]
