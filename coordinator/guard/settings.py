"""The guard's settings from cluster.env (the MEMORY_GUARD_* keys of coordinator/schema.py)."""

from __future__ import annotations

from typing import Mapping

from .policy import GuardSettings

GB = 1_000_000_000


def from_config(cfg: Mapping[str, object]) -> GuardSettings:
    interval_ms = int(cfg["MEMORY_GUARD_INTERVAL_MS"])
    return GuardSettings(
        mode=str(cfg["MEMORY_GUARD"]),
        guard_bytes=int(float(cfg["MEMORY_GUARD_GB"]) * GB),
        interval_ms=interval_ms,
        lead_s=float(cfg["MEMORY_GUARD_LEAD_S"]),
        envelope_s=float(cfg["MEMORY_GUARD_ENVELOPE_S"]),
        stop_after_s=float(cfg["MEMORY_GUARD_STOP_AFTER_S"]),
        hysteresis_bytes=int(float(cfg["MEMORY_GUARD_HYSTERESIS_GB"]) * GB),
        confirm_samples=int(cfg["MEMORY_GUARD_CONFIRM_SAMPLES"]),
        # the slope window in samples, so it always holds enough of them for a line and its error
        window_s=int(cfg["MEMORY_GUARD_WINDOW_SAMPLES"]) * interval_ms / 1000,
    )
