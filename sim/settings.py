"""The stand-in's own knobs, read from DSV41_SIM_* environment variables (the coordinator passes
every DSV41_* key of cluster.env through to the rank's environment)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from adapter import admission_gate, prefill_empty_cache
from dsv41.admission import GateSettings
from dsv41.ranksettings import SettingError, env_int


@dataclass(frozen=True)
class Settings:
    prefill_tokens_per_s: float = 20000.0
    bytes_per_token: int = 16384
    # The indexer's logits buffer [chunk, prefix] per prefill chunk: fp32 (4 bytes), one low-ratio
    # layer's at a time (the shape bench/results/prefill_empty_cache-h200.txt measured).
    transient_bytes: float = 4.0
    decode_tokens_per_s: float = 200.0
    load_s: float = 0.0
    # Memory the model load takes (the weights), allocated evenly over load_s and kept.
    load_bytes: int = 0
    # The prefill_empty_cache hook's threshold, as the adapter reads it inside SGLang.
    empty_cache_tokens: int = prefill_empty_cache.DEFAULT
    # The admission gate, as the adapter reads it inside SGLang (DSV41_ADMISSION_*; None: off).
    admission: GateSettings | None = None
    # KV in a pool as SGLang keeps it (sim/kvpool.py: taken once, kept, reused by KV alone, of
    # --max-total-tokens slots); False: in the caching allocator, where an ended request's blocks
    # serve anything and empty_cache() may give them back (kinder than SGLang).
    kv_pool: bool = True
    drain_timeout_s: float = 60.0
    rendezvous_timeout_s: float = 600.0
    # None: a silent peer is waited for, as NCCL does (the engine's watchdog ends a step that hangs);
    # a number only where a test asks for a quick exit on silence.
    peer_timeout_s: float | None = None
    heartbeat_s: float = 0.5


# name -> (field, converter, lowest allowed value, whether 0 is allowed)
_ENV = {
    "DSV41_SIM_PREFILL_TOKENS_PER_S": ("prefill_tokens_per_s", float, False),
    "DSV41_SIM_BYTES_PER_TOKEN": ("bytes_per_token", int, True),
    "DSV41_SIM_TRANSIENT_BYTES": ("transient_bytes", float, True),
    "DSV41_SIM_DECODE_TOKENS_PER_S": ("decode_tokens_per_s", float, False),
    "DSV41_SIM_LOAD_S": ("load_s", float, True),
    "DSV41_SIM_LOAD_BYTES": ("load_bytes", int, True),
    "DSV41_SIM_DRAIN_TIMEOUT_S": ("drain_timeout_s", float, True),
    "DSV41_SIM_RENDEZVOUS_TIMEOUT_S": ("rendezvous_timeout_s", float, False),
    "DSV41_SIM_PEER_TIMEOUT_S": ("peer_timeout_s", float, False),
}


def from_env(env: Mapping[str, str], dist_timeout_s: int | None = None) -> Settings:
    """Settings from the environment; raises ValueError naming the variable and what is allowed.
    --dist-timeout (SGLang's rendezvous timeout) sets the rendezvous default."""
    values: dict[str, float | int] = {}
    if dist_timeout_s is not None:
        values["rendezvous_timeout_s"] = float(dist_timeout_s)
    for name, (attr, kind, zero_ok) in _ENV.items():
        raw = env.get(name)
        if raw is None or raw == "":
            continue
        try:
            value = kind(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not math.isfinite(value):
            raise ValueError(f"{name}={raw!r} is not a finite number")
        if value < 0 or (value == 0 and not zero_ok):
            raise ValueError(f"{name}={raw!r} must be {'zero or more' if zero_ok else 'more than zero'}")
        values[attr] = value
    try:
        values["empty_cache_tokens"] = env_int(env, "DSV41_PREFILL_EMPTY_CACHE_TOKENS", prefill_empty_cache.DEFAULT,
                                               0, prefill_empty_cache.MAXIMUM)
        values["admission"] = admission_gate.settings_from_env(env)
        values["kv_pool"] = bool(env_int(env, "DSV41_SIM_KV_POOL", 1, 0, 1))
    except SettingError as exc:
        raise ValueError(str(exc)) from None
    settings = Settings(**values)  # type: ignore[arg-type]
    if settings.peer_timeout_s is None:
        return settings
    # Heartbeats several times per timeout, so one late beat never counts as a lost peer.
    return Settings(**{**settings.__dict__, "heartbeat_s": min(0.5, settings.peer_timeout_s / 5)})
