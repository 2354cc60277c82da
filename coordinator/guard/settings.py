"""The guard's settings: one record of every setting (type, default, meaning), read from cluster.env
(the MEMORY_GUARD_* keys of coordinator/schema.py) and logged whole when the guard starts."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Mapping

from dsv41.cost import CostModel

from .kinds import Mode

if TYPE_CHECKING:
    from ..config import ClusterConfig

MODES = tuple(m.value for m in Mode)


def _setting(default: Any, meaning: str, factory: Any = None) -> Any:
    if factory is not None:
        return field(default_factory=factory, metadata={"meaning": meaning})
    return field(default=default, metadata={"meaning": meaning})


@dataclass(frozen=True)
class GuardSettings:
    mode: str = _setting("act", "act | observe (log what it would do) | off (MEMORY_GUARD)")
    guard_bytes: int = _setting(1_500_000_000, "keep at least this much available on every node (MEMORY_GUARD_GB)")
    interval_ms: int = _setting(20, "the agents' sampling period (MEMORY_GUARD_INTERVAL_MS)")
    lead_s: float = _setting(1.0, "what an abort needs to take effect: HTTP and one prefill chunk "
                                  "(MEMORY_GUARD_LEAD_S)")
    envelope_s: float = _setting(1.0, "the span a low is taken over, at least one prefill chunk "
                                      "(MEMORY_GUARD_ENVELOPE_S)")
    stop_after_s: float = _setting(1.0, "memory still falling this long after abort_all: stop the ranks "
                                        "(MEMORY_GUARD_STOP_AFTER_S)")
    hysteresis_bytes: int = _setting(250_000_000, "re-arm above guard + this; escalate after a further fall of "
                                                  "this (MEMORY_GUARD_HYSTERESIS_GB)")
    confirm_samples: int = _setting(2, "consecutive samples in danger before acting (MEMORY_GUARD_CONFIRM_SAMPLES)")
    window_s: float = _setting(0.2, "the slope's window (MEMORY_GUARD_WINDOW_SAMPLES x the interval)")
    envelope_points: int = _setting(8, "lows (one per envelope span) in the lows' line")
    significance: float = _setting(3.0, "standard errors a slope must be below zero to count as a fall")
    rearm_quiet_s: float = _setting(10.0, "re-arm after this long without danger")
    # A quiet node costs one gRPC message per heartbeat instead of one per sample (bench/agent_footprint).
    send_change_bytes: int = _setting(4 << 20, "an agent sends a sample when available moved this much since the "
                                                "last it sent (and the samples a confirmation needs); 0: every one")
    heartbeat_ms: int = _setting(5000, "an agent sends a sample at least this often")
    cost: CostModel = _setting(None, "what a request costs each rank (dsv41/cost.py): victims are chosen by it",
                               factory=CostModel)
    rank0_node: str = _setting("", "the node rank 0 runs on: its samples and rank 0's scheduler share a clock")
    context_tokens: int = _setting(0, "the longest prompt the ranks take (CONTEXT_LENGTH; 0: not known), for "
                                      "the KV pool's check (poolfit.py)")

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r}: must be one of {', '.join(MODES)}")
        if self.guard_bytes < 0 or self.hysteresis_bytes < 0:
            raise ValueError("guard_bytes and hysteresis_bytes must be zero or more")
        for name in ("lead_s", "envelope_s", "window_s", "interval_ms", "stop_after_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be more than zero")
        if self.confirm_samples < 1 or self.envelope_points < 4:
            raise ValueError("confirm_samples must be >= 1 and envelope_points >= 4")
        if self.send_change_bytes < 0 or self.heartbeat_ms < self.interval_ms:
            raise ValueError("send_change_bytes must be zero or more and heartbeat_ms at least interval_ms")

    @property
    def confirm_s(self) -> float:
        """How long an aborted request may still be listed: the abort ends it at the next chunk
        boundary (within the lead), and the list is a sample late."""
        return self.lead_s + self.envelope_s

    @property
    def reach_s(self) -> float:
        """How much further ahead than an action needs a projection looks: the time the samples
        after the first one in danger take to confirm it, and one interval more. The next sample
        comes an interval later, so the action comes on the last sample before the crossing is an
        action's time ahead, not up to an interval after it."""
        return self.confirm_samples * self.interval_ms / 1000

    @property
    def line_bytes(self) -> int:
        """The early check's finest spacing: a quarter band (the lines below guard + band)."""
        return max(1, max(4 << 20, self.hysteresis_bytes) // 4)

    def line_of(self, level: int) -> int:
        """Which of the early check's lines a level is on: a hysteresis band apart (4 MiB at least),
        a quarter band apart below guard + band. Lines a band apart put the first one below a
        level within a band of the guard at the guard itself: memory left there after an abort (the
        allocator keeps it) would be looked at again only once the next prompt had taken it below."""
        band = max(4 << 20, self.hysteresis_bytes)
        above = level - self.guard_bytes
        return 4 * (above // band) if above >= band else above // self.line_bytes

    @property
    def settle_s(self) -> float:
        """Quiet after confirmed aborts before the guard is armed again."""
        return self.lead_s + self.envelope_s

    def send_request(self) -> dict[str, int]:
        """What the agents are asked to send (WatchMemoryRequest's fields): every sample that moved
        send_change_bytes, followed by the samples a confirmation needs. No held-back samples before
        a change: they are flat, and a window holding a flat half is not a sustained fall anyway (the
        trace tests check the actions are the same as with every sample)."""
        if not self.send_change_bytes:
            return {"min_change_bytes": 0}
        return {"min_change_bytes": self.send_change_bytes, "heartbeat_ms": self.heartbeat_ms,
                "replay_samples": 0, "follow_samples": self.confirm_samples}


def meanings() -> dict[str, str]:
    """Each setting's meaning, by name."""
    return {f.name: f.metadata["meaning"] for f in fields(GuardSettings)}


def log_fields(s: GuardSettings) -> dict[str, object]:
    """Every setting as journal fields (the cost model's as cost_*): the guard's start event."""
    out: dict[str, object] = {}
    for f in fields(s):
        value = getattr(s, f.name)
        if isinstance(value, CostModel):
            out.update({f"cost_{c.name}": getattr(value, c.name) for c in fields(value)})
        else:
            out["guard_mode" if f.name == "mode" else f.name] = value
    return out


GB = 1_000_000_000
# What a request costs each rank when MEMORY_GUARD_TOKEN_BYTES / _TRANSIENT_BYTES are empty: the
# stand-in's own defaults (sim/settings.py; a unit test holds them equal), else the head's as the
# example configuration's notes give it (tests/unit/test_guard_traces.py rebuilds them).
SIM_TOKEN_BYTES, SIM_TRANSIENT_BYTES = 16384, 4.0
SGLANG_TOKEN_BYTES, SGLANG_TRANSIENT_BYTES = 12_000, 20.0


def cost_model(cfg: ClusterConfig, passthrough: Mapping[str, str] | None = None) -> CostModel:
    """The requests' cost per rank. With RANK_ENGINE=sim and the keys empty, the stand-in's own
    DSV41_SIM_BYTES_PER_TOKEN / DSV41_SIM_TRANSIENT_BYTES (what it really allocates), and its KV
    where DSV41_SIM_KV_POOL puts it (its pool, unless 0)."""
    passthrough = passthrough or {}
    sim = cfg.text("RANK_ENGINE") == "sim"
    token = cfg.optional_integer("MEMORY_GUARD_TOKEN_BYTES")
    if token is None:
        token = int(passthrough.get("DSV41_SIM_BYTES_PER_TOKEN") or SIM_TOKEN_BYTES) if sim else SGLANG_TOKEN_BYTES
    transient = cfg.optional_number("MEMORY_GUARD_TRANSIENT_BYTES")
    if transient is None:
        transient = float(passthrough.get("DSV41_SIM_TRANSIENT_BYTES") or SIM_TRANSIENT_BYTES) if sim \
            else SGLANG_TRANSIENT_BYTES
    gate = cfg.flag("MEMORY_GUARD_ADMISSION") and cfg.text("MEMORY_GUARD") != "off"
    # SGLang keeps the KV in its pool, never in the caching allocator; so does the stand-in
    # (sim/kvpool.py) unless DSV41_SIM_KV_POOL=0 puts it in its allocator.
    pool = passthrough.get("DSV41_SIM_KV_POOL", "").strip() != "0" if sim else True
    return CostModel(token_bytes=token, transient_bytes=transient, kv_pool=pool,
                     kv_pool_tokens=cfg.integer("MAX_TOTAL_TOKENS") if pool else 0,
                     chunk_tokens=cfg.integer("CHUNKED_PREFILL_SIZE"),
                     empty_cache_tokens=cfg.integer("DSV41_PREFILL_EMPTY_CACHE_TOKENS"),
                     admission_guard_bytes=int(cfg.number("MEMORY_GUARD_GB") * GB) if gate else 0)


def from_config(cfg: ClusterConfig) -> GuardSettings:
    interval_ms = cfg.integer("MEMORY_GUARD_INTERVAL_MS")
    return GuardSettings(
        mode=cfg.text("MEMORY_GUARD"),
        guard_bytes=int(cfg.number("MEMORY_GUARD_GB") * GB),
        interval_ms=interval_ms,
        lead_s=cfg.number("MEMORY_GUARD_LEAD_S"),
        envelope_s=cfg.number("MEMORY_GUARD_ENVELOPE_S"),
        stop_after_s=cfg.number("MEMORY_GUARD_STOP_AFTER_S"),
        hysteresis_bytes=int(cfg.number("MEMORY_GUARD_HYSTERESIS_GB") * GB),
        confirm_samples=cfg.integer("MEMORY_GUARD_CONFIRM_SAMPLES"),
        # the slope window in samples, so it always holds enough of them for a line and its error
        window_s=cfg.integer("MEMORY_GUARD_WINDOW_SAMPLES") * interval_ms / 1000,
        cost=cost_model(cfg, cfg.passthrough),
        rank0_node=cfg.head.name,
        context_tokens=cfg.integer("CONTEXT_LENGTH"),
    )
