"""The guard's settings from cluster.env (the MEMORY_GUARD_* keys of coordinator/schema.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from .charge import CostModel
from .policy import GuardSettings

if TYPE_CHECKING:
    from ..config import ClusterConfig

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
