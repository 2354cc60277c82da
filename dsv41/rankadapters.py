"""The rank's adapters as both sides see them: each one's name, the variables it reads and the
variable that switches it on (standard library only).

The rank's adapter/boot.py arms them in this order and each adapter module takes its ENV_KEYS from
here; the coordinator derives from the same records which rank-side keys of cluster.env take effect
(`dsv41ctl config check`, `config keys`) and which adapters a rank's environment switches on (the
health and smoke steps want each of them reported installed). tests/unit/test_adapter_env_keys.py
holds every adapter's build() to exactly these keys and to the same on/off decision.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

ARM_VARIABLE = "DSV41_SOURCE"  # the model path the coordinator always sets for a rank; arms them all


class Switch(enum.Enum):
    ALWAYS = "always"  # on whenever the rank is armed
    FLAG = "flag"  # on when the variable is a true flag (1/true/yes/on)
    NOT_OFF = "not off"  # on unless the variable's value is one of `off` (numbers compared as numbers)
    PRESENT = "present"  # on when the variable is in the environment at all, even empty
    EQUALS = "equals"  # on when the variable's value is `on_value`


@dataclass(frozen=True)
class RankAdapter:
    name: str
    keys: tuple[str, ...]  # every variable its build() reads
    switch: Switch = Switch.ALWAYS
    key: str = ""  # the switching variable (one of keys)
    unset: str = ""  # the value the rank takes when the variable is absent or empty
    off: tuple[str, ...] = ()  # NOT_OFF: the values that leave it out
    on_value: str = ""  # EQUALS

    def switched_on(self, env: Mapping[str, str]) -> bool:
        """Whether the environment switches this adapter on, as its build() decides (a value the
        adapter cannot use reads as off: the adapter then stays out and says so)."""
        if self.switch is Switch.ALWAYS:
            return True
        if self.switch is Switch.PRESENT:
            return self.key in env
        raw = env.get(self.key, "").strip() or self.unset
        if self.switch is Switch.FLAG:
            return raw.lower() in ("1", "true", "yes", "on")
        if self.switch is Switch.EQUALS:
            return raw.lower() == self.on_value
        return not any(_same(raw, off) for off in self.off)


def _same(raw: str, off: str) -> bool:
    try:
        return float(raw) == float(off)
    except ValueError:
        return raw == off


_LOOP = ("DSV41_LOOP_ABORT", "DSV41_LOOP_NGRAM", "DSV41_LOOP_REPEATS", "DSV41_LOOP_LINE_REPEATS")
_ADMISSION = ("DSV41_ADMISSION_GUARD_BYTES", "DSV41_ADMISSION_TOKEN_BYTES", "DSV41_ADMISSION_TRANSIENT_BYTES",
              "DSV41_ADMISSION_LONE_WAIT_S")
ENGRAM_STORE_KEYS = ("DSV41_IO_THREADS", "DSV41_CACHE_GIB", "DSV41_CACHE_WAYS", "DSV41_STATS_SECONDS",
                     "DSV41_RESIDENT_SCALES")
# SGLang's own Engram layouts; each would allocate a table of its own beside the offload's.
ENGRAM_CONFLICTS = ("SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE", "SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS")
_WO_A_W8 = ("DSV41_WO_A_W8", "DSV41_WO_A_W8_MID", "DSV41_WO_A_W8_DROP", "DSV41_WO_A_W8_DRAFT")

# In the order the rank arms them (the order of its "installed" lines).
ADAPTERS: tuple[RankAdapter, ...] = (
    RankAdapter("tp3_pad", ("DSV41_TP_PAD",), Switch.FLAG, "DSV41_TP_PAD", unset="1"),
    RankAdapter("mxfp8_b12x", ("DSV41_MXFP8_BACKEND",)),
    RankAdapter("autotune_keep", ("DSV41_AUTOTUNE_KEEP",), Switch.FLAG, "DSV41_AUTOTUNE_KEEP", unset="1"),
    RankAdapter("prefill_empty_cache", ("DSV41_PREFILL_EMPTY_CACHE_TOKENS",), Switch.NOT_OFF,
                "DSV41_PREFILL_EMPTY_CACHE_TOKENS", unset="8192", off=("0",)),
    RankAdapter("admission_gate", _ADMISSION, Switch.NOT_OFF, "DSV41_ADMISSION_GUARD_BYTES", unset="0",
                off=("0",)),
    RankAdapter("loop_abort", _LOOP, Switch.FLAG, "DSV41_LOOP_ABORT", unset="1"),
    RankAdapter("max_new_tokens", ("DSV41_MAX_NEW_TOKENS",), Switch.NOT_OFF, "DSV41_MAX_NEW_TOKENS",
                unset="32768", off=("0",)),
    RankAdapter("reasoning_effort", ("DSV41_REASONING_EFFORT_REMAP", "SGLANG_DSV41_REASONING_EFFORT"), Switch.FLAG,
                "DSV41_REASONING_EFFORT_REMAP", unset="1"),
    RankAdapter("inflight", ("DSV41_INFLIGHT_ROUTE", "DSV41_PROGRESS_DIR"), Switch.FLAG, "DSV41_INFLIGHT_ROUTE",
                unset="1"),
    RankAdapter("api_key", ("DSV41_API_KEY_FILE",), Switch.PRESENT, "DSV41_API_KEY_FILE"),
    RankAdapter("engram_offload", ("OFFLOAD_MODE", "DSV41_PACKED_DIR", "DSV41_ENGRAM_PREFETCH",
                                   "DSV41_ENGRAM_PREFETCH_CHECK", *ENGRAM_STORE_KEYS, *ENGRAM_CONFLICTS),
                Switch.EQUALS, "OFFLOAD_MODE", on_value="nvme"),
    RankAdapter("forward_progress", ("DSV41_PROGRESS_DIR",)),
    RankAdapter("wo_a_w8", _WO_A_W8, Switch.FLAG, "DSV41_WO_A_W8", unset="0"),
    RankAdapter("draft_head_fp8", ("DSV41_DRAFT_HEAD_FP8",), Switch.FLAG, "DSV41_DRAFT_HEAD_FP8", unset="0"),
    RankAdapter("verify_cap", ("DSV41_VERIFY_CAP", "SGLANG_RAGGED_VERIFY_MODE"), Switch.NOT_OFF, "DSV41_VERIFY_CAP",
                unset="0", off=("0",)),
    RankAdapter("block_verify", ("DSV41_BLOCK_VERIFY",), Switch.FLAG, "DSV41_BLOCK_VERIFY", unset="0"),
    RankAdapter("draft_tau", ("DSV41_DRAFT_TAU",), Switch.NOT_OFF, "DSV41_DRAFT_TAU", unset="1", off=("1",)),
    RankAdapter("folded_fence", ("DSV41_FOLDED_FENCE",), Switch.FLAG, "DSV41_FOLDED_FENCE", unset="0"),
)
BY_NAME = {adapter.name: adapter for adapter in ADAPTERS}


def env_keys() -> dict[str, tuple[str, ...]]:
    """{variable: the adapters that read it}, and DSV41_SOURCE, which arms them all."""
    readers: dict[str, tuple[str, ...]] = {ARM_VARIABLE: ("boot",)}
    for adapter in ADAPTERS:
        for key in adapter.keys:
            readers[key] = readers.get(key, ()) + (adapter.name,)
    return readers


def switched_on(env: Mapping[str, str]) -> frozenset[str]:
    """The adapters a rank with this environment arms (none without DSV41_SOURCE)."""
    if not env.get(ARM_VARIABLE, "").strip():
        return frozenset()
    return frozenset(adapter.name for adapter in ADAPTERS if adapter.switched_on(env))
