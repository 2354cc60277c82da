"""What the agents and the coordinator share about GPU telemetry: the names of NVML's clocks event
(throttle) reasons, and which of them are a slowdown."""

from __future__ import annotations

# nvmlClocksEventReason* bits (nvml.h), in bit order, with the names status and metrics use.
THROTTLE_REASONS = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)
REASON_NAMES = tuple(name for _, name in THROTTLE_REASONS)
# Thermal and hardware slowdowns. Not sw_power_cap: a GPU busy at its power limit is capped as designed.
SLOWDOWN_REASONS = frozenset({"hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"})


def decode_throttle_reasons(mask: int) -> tuple[str, ...]:
    """The named reasons set in an NVML clocks event mask; a bit nvml.h did not define when this was
    written is kept as unknown_0x... rather than dropped."""
    names = [name for bit, name in THROTTLE_REASONS if mask & bit]
    rest = mask
    for bit, _ in THROTTLE_REASONS:
        rest &= ~bit
    bit = 1
    while rest:
        if rest & bit:
            names.append(f"unknown_{bit:#x}")
            rest &= ~bit
        bit <<= 1
    return tuple(names)
