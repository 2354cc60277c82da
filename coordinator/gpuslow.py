"""The GPU slow state and heat, decided from the agents' GPU figures (NodeStatus.gpus).

A GB10 can latch at a lower clock (63 against 94 ms per decode step in one recipe's thread) and stay
there until its node's AC power is removed; a head that overheats soft-locks. A GPU is slow when,
continuously for longer than GPU_SLOW_S as the status polls see it, either
- its throttle reasons show a thermal or hardware slowdown (SLOWDOWN_REASONS), or
- it is busy (GPU utilisation >= GPU_BUSY_RATIO) below GPU_EXPECTED_SM_MHZ (empty: this rule is off).
sw_power_cap is not a slowdown here: a GPU busy at its power limit is capped as designed.

decide_slow is the pure decision over the figures of one poll; GpuSlowWatch keeps its state between
polls with an injected clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from dsv41.gpu import SLOWDOWN_REASONS

REMEDY = ("the GB10 slow state clears only when the node's AC power is removed (a reboot does not clear it); "
          "a head that overheats soft-locks: check its airflow")


@dataclass(frozen=True)
class GpuSlowRules:
    slow_s: float = 120.0                  # GPU_SLOW_S
    busy_ratio: float = 0.5                # GPU_BUSY_RATIO
    expected_sm_mhz: float | None = None   # GPU_EXPECTED_SM_MHZ; None: the clock rule is off


def rules_from_config(cfg) -> GpuSlowRules:
    return GpuSlowRules(slow_s=cfg.number("GPU_SLOW_S"), busy_ratio=cfg.number("GPU_BUSY_RATIO"),
                        expected_sm_mhz=cfg.optional_integer("GPU_EXPECTED_SM_MHZ"))


@dataclass(frozen=True)
class GpuFigures:
    """What the decision reads of one GPU; None where the agent had no figure."""
    node: str
    index: int
    uuid: str = ""
    name: str = ""
    sm_clock_mhz: float | None = None
    utilization_ratio: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    reasons: tuple[str, ...] = ()

    @property
    def key(self) -> tuple[str, str]:
        return self.node, self.uuid or f"GPU{self.index}"


def figures_of(node: str, gpu) -> GpuFigures:
    """GpuFigures of one pb.GpuState (an absent figure stays None, never 0)."""
    def figure(name: str) -> float | None:
        return getattr(gpu, name) if gpu.HasField(name) else None
    utilization = figure("utilization_gpu_pct")
    return GpuFigures(node=node, index=gpu.index, uuid=gpu.uuid, name=gpu.name, sm_clock_mhz=figure("sm_clock_mhz"),
                      utilization_ratio=None if utilization is None else utilization / 100.0,
                      temperature_c=figure("temperature_c"), power_w=figure("power_w"),
                      reasons=tuple(gpu.throttle_reasons))


def slow_cause(gpu: GpuFigures, rules: GpuSlowRules) -> str | None:
    """Why this GPU counts as slow now, or None."""
    slowdown = sorted(set(gpu.reasons) & SLOWDOWN_REASONS)
    if slowdown:
        return f"throttle reasons {', '.join(slowdown)}"
    if rules.expected_sm_mhz is None or gpu.sm_clock_mhz is None or gpu.utilization_ratio is None:
        return None
    if gpu.utilization_ratio >= rules.busy_ratio and gpu.sm_clock_mhz < rules.expected_sm_mhz:
        return (f"{gpu.utilization_ratio * 100:.0f} % busy at {gpu.sm_clock_mhz:g} MHz SM, below the expected "
                f"{rules.expected_sm_mhz:g} MHz")
    return None


@dataclass(frozen=True)
class SlowSince:
    since: float          # monotonic seconds when the GPU was first seen slow in this episode
    reported: bool = False


@dataclass(frozen=True)
class GpuSlow:
    gpu: GpuFigures
    cause: str
    for_s: float

    @property
    def message(self) -> str:
        g = self.gpu
        figures = ", ".join(part for part in (
            None if g.sm_clock_mhz is None else f"{g.sm_clock_mhz:g} MHz SM",
            None if g.utilization_ratio is None else f"{g.utilization_ratio * 100:.0f} % busy",
            None if g.temperature_c is None else f"{g.temperature_c:g} °C",
            None if g.power_w is None else f"{g.power_w:.1f} W") if part)
        return (f"{g.node} GPU{g.index} {g.name}: slow for {self.for_s:.0f} s ({self.cause}; {figures or 'no figures'}). "
                f"Known remedy: {REMEDY}")


@dataclass(frozen=True)
class SlowDecision:
    tracks: dict[tuple[str, str], SlowSince]  # the state for the next poll
    slow: tuple[GpuSlow, ...]                 # slow for longer than rules.slow_s now
    newly_slow: tuple[GpuSlow, ...]           # of those, the ones not reported before in this episode


def decide_slow(tracks: Mapping[tuple[str, str], SlowSince], gpus: Iterable[GpuFigures], rules: GpuSlowRules,
                now: float) -> SlowDecision:
    """One poll's figures against the episodes so far. A GPU not slow in this poll, or not in it at all
    (its node did not answer), ends its episode: the rule asks for a slow state seen continuously."""
    out: dict[tuple[str, str], SlowSince] = {}
    slow: list[GpuSlow] = []
    new: list[GpuSlow] = []
    for gpu in gpus:
        cause = slow_cause(gpu, rules)
        if cause is None:
            continue
        track = tracks.get(gpu.key) or SlowSince(since=now)
        for_s = now - track.since
        if for_s > rules.slow_s:
            found = GpuSlow(gpu, cause, for_s)
            slow.append(found)
            if not track.reported:
                new.append(found)
                track = SlowSince(track.since, reported=True)
        out[gpu.key] = track
    return SlowDecision(out, tuple(slow), tuple(new))


class GpuSlowWatch:
    """decide_slow over successive polls: observe() each poll's node statuses; it returns the GPUs that
    have just become slow (each once per episode)."""

    def __init__(self, rules: GpuSlowRules, monotonic: Callable[[], float] = time.monotonic):
        self._rules = rules
        self._monotonic = monotonic
        self._tracks: dict[tuple[str, str], SlowSince] = {}
        self._slow: tuple[GpuSlow, ...] = ()

    def observe(self, statuses: Mapping[str, object]) -> tuple[GpuSlow, ...]:
        """statuses: node -> pb.NodeStatus of the nodes that answered this poll."""
        gpus = [figures_of(node, gpu) for node, status in statuses.items() for gpu in status.gpus]
        decision = decide_slow(self._tracks, gpus, self._rules, self._monotonic())
        self._tracks, self._slow = decision.tracks, decision.slow
        return decision.newly_slow

    def slow(self) -> tuple[GpuSlow, ...]:
        return self._slow
