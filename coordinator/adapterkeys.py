"""Which rank-side keys of cluster.env take effect in the rank, from the adapters' own declarations.

Keys for the rank's other programs (NCCL, SGLang, PyTorch, CUDA, Gloo) are theirs to read. Every
other key the plan puts into the rank's environment (DSV41_*, OFFLOAD_MODE) is meant for the
adapters, and does something only if an adapter reads it: dsv41/rankadapters.py declares what
each adapter reads (its modules take their ENV_KEYS from there; tests/unit/test_adapter_env_keys.py
checks the declarations against what each build() really reads). A key none declares has no effect, and `dsv41ctl
config check` and `config keys` say so instead of describing it as if it worked.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from dsv41 import rankadapters

from . import schema

NO_EFFECT = "no adapter implements this yet; it has no effect"
# Read by the rank's other programs themselves, never by the adapters' absence.
FOREIGN_PREFIXES = ("NCCL_", "SGLANG_", "PYTORCH_", "CUDA_", "TORCH_", "GLOO_", "TP_")


def implemented() -> frozenset[str]:
    """Every variable some adapter reads."""
    return frozenset(rankadapters.env_keys())


def meant_for_adapters(key: schema.Key) -> bool:
    return key.to_rank_env and not key.name.startswith(FOREIGN_PREFIXES)


def without_effect(keys: Iterable[schema.Key], readers: Collection[str]) -> tuple[str, ...]:
    """The names of the rank-side keys meant for the adapters that no adapter reads."""
    return tuple(key.name for key in keys if meant_for_adapters(key) and key.name not in readers)
