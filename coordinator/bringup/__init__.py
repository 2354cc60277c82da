"""The bring-up steps, in order. Each is one module declaring its Step (name, deadline key,
whether a restart can fix its failure); the phase list, the deadlines, the retry rule and the
phases in which the cluster counts as starting all come from here. Adding a step is one module
and one line below."""

from __future__ import annotations

from . import fabric, health, launch, pack, preflight, share, smoke
from .step import BringUp, Preempted, Step, StepContext, StepFailed

STEPS: tuple[Step, ...] = (
    preflight.STEP,
    share.STEP,
    fabric.STEP,
    pack.STEP,
    launch.STEP,
    health.STEP,
    smoke.STEP,
)
PHASES: tuple[str, ...] = tuple(step.name for step in STEPS)
BY_NAME: dict[str, Step] = {step.name: step for step in STEPS}
# From launch on, ranks run: a rank exit is this bring-up's failure.
RANKS_RUN_FROM: str = launch.STEP.name

__all__ = ["STEPS", "PHASES", "BY_NAME", "RANKS_RUN_FROM", "BringUp", "Preempted", "Step", "StepContext",
           "StepFailed"]
