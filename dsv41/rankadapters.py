"""The rank's adapters as both sides see them: each one's name, its settings (one declaration per
variable: type, default, allowed values, help) and the setting that switches it on (standard
library only).

The rank's adapter/boot.py arms them in this order; each adapter module reads its settings from
here (and takes its ENV_KEYS from here). The coordinator derives from the same records the
rank-side keys of cluster.env with their parsers, defaults and help (coordinator/schema.py), which
keys take effect (`dsv41ctl config check`, `config keys`) and which adapters a rank's environment
switches on (the health and smoke steps want each of them reported installed).
tests/unit/test_adapter_env_keys.py holds every adapter's build() to exactly its declared
variables and to the same on/off decision.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from dsv41.admission import LONE_WAIT_S
from dsv41.progress import DIRECTORY as PROGRESS_DIRECTORY
from dsv41.ranksettings import Kind, Setting

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
    settings: tuple[Setting, ...]  # every variable its build() reads
    switch: Switch = Switch.ALWAYS
    key: str = ""  # the switching variable (one of settings)
    off: tuple[str, ...] = ()  # NOT_OFF: the values that leave it out
    on_value: str = ""  # EQUALS

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(setting.name for setting in self.settings)

    def switched_on(self, env: Mapping[str, str]) -> bool:
        """Whether the environment switches this adapter on, as its build() decides (a value the
        adapter cannot use reads as off: the adapter then stays out and says so)."""
        if self.switch is Switch.ALWAYS:
            return True
        if self.switch is Switch.PRESENT:
            return self.key in env
        raw = env.get(self.key, "").strip() or next(s for s in self.settings if s.name == self.key).when_absent
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


MAX_CONTEXT = 1_048_576  # the model's context, tokens

DSV41_TP_PAD = Setting(
    "DSV41_TP_PAD", Kind.FLAG, "1",
    "pad heads, vocab and draft experts for TP sizes that do not divide them")
DSV41_MXFP8_BACKEND = Setting(
    "DSV41_MXFP8_BACKEND", Kind.CHOICE, "b12x",
    "FlashInfer MXFP8 dense kernel",
    choices=("b12x", "cudnn", "cutlass"))
DSV41_AUTOTUNE_KEEP = Setting(
    "DSV41_AUTOTUNE_KEEP", Kind.FLAG, "1",
    "keep FlashInfer autotune caches across boots of the same launch")
DSV41_PREFILL_EMPTY_CACHE_TOKENS = Setting(
    "DSV41_PREFILL_EMPTY_CACHE_TOKENS", Kind.INTEGER, "8192",
    "return cached allocator blocks between the prefill chunks of sequences this long, right before each "
    "chunk is launched, where the release waits only for the chunk before (0: off)",
    low=0, high=MAX_CONTEXT)
DSV41_LOOP_ABORT = Setting(
    "DSV41_LOOP_ABORT", Kind.FLAG, "1",
    "decode-side loop abort")
DSV41_LOOP_NGRAM = Setting(
    "DSV41_LOOP_NGRAM", Kind.INTEGER, "32",
    "loop abort: n-gram length",
    low=4, high=4096)
DSV41_LOOP_REPEATS = Setting(
    "DSV41_LOOP_REPEATS", Kind.INTEGER, "4",
    "loop abort: n-gram copies",
    low=2, high=1000)
DSV41_LOOP_LINE_REPEATS = Setting(
    "DSV41_LOOP_LINE_REPEATS", Kind.INTEGER, "8",
    "loop abort: identical decoded lines",
    low=2, high=10000)
DSV41_MAX_NEW_TOKENS = Setting(
    "DSV41_MAX_NEW_TOKENS", Kind.INTEGER, "32768",
    "fill/clamp max_tokens of chat requests (0: SGLang's behaviour)",
    low=0, high=MAX_CONTEXT)
DSV41_REASONING_EFFORT_REMAP = Setting(
    "DSV41_REASONING_EFFORT_REMAP", Kind.FLAG, "1",
    "map reasoning tiers to the publisher's table")
SGLANG_DSV41_REASONING_EFFORT = Setting(
    "SGLANG_DSV41_REASONING_EFFORT", Kind.REASONING_EFFORT, "75",
    "default reasoning budget: 1-100 or low/high/xhigh/max")
DSV41_INFLIGHT_ROUTE = Setting(
    "DSV41_INFLIGHT_ROUTE", Kind.FLAG, "1",
    "serve /dsv41/inflight (the memory guard's victim list) and /dsv41/drain (the drain before a planned "
    "restart) on rank 0")
OFFLOAD_MODE = Setting(
    "OFFLOAD_MODE", Kind.CHOICE, "nvme",
    "Engram tables: nvme serves them from this node's packed shards (required on GB10; the rank refuses "
    "to start without them); host leaves them to SGLang (device memory, or host RAM with "
    "SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE=1)",
    choices=("nvme", "host"), absent="")
DSV41_PACKED_DIR = Setting(
    "DSV41_PACKED_DIR", Kind.PATH, "/engram",
    "where the rank sees ENGRAM_DIR (it opens engram-l{L}-r{R}of{TP}.bin there)")
DSV41_ENGRAM_PREFETCH = Setting(
    "DSV41_ENGRAM_PREFETCH", Kind.FLAG, "1",
    "fetch Engram rows ahead on a side stream: extend batches staged by the scheduler, other batches "
    "right after the hasher",
    absent="0")
DSV41_ENGRAM_PREFETCH_CHECK = Setting(
    "DSV41_ENGRAM_PREFETCH_CHECK", Kind.FLAG, "0",
    "also run the synchronous lookup and log rows that differ from the prefetched ones (slow)")
DSV41_IO_THREADS = Setting(
    "DSV41_IO_THREADS", Kind.INTEGER, "96",
    "Engram miss reader threads",
    low=1, high=1024)
DSV41_CACHE_GIB = Setting(
    "DSV41_CACHE_GIB", Kind.REAL, "0",
    "Engram row cache per host in GiB (0 disables)",
    low=0, high=64)
DSV41_CACHE_WAYS = Setting(
    "DSV41_CACHE_WAYS", Kind.INTEGER, "4",
    "Engram cache associativity",
    low=1, high=16)
DSV41_STATS_SECONDS = Setting(
    "DSV41_STATS_SECONDS", Kind.INTEGER, "60",
    "one Engram statistics line per rank this often (lookups/s, rows/s, hit rate, read latency; 0: off)",
    low=0, high=86400)
DSV41_RESIDENT_SCALES = Setting(
    "DSV41_RESIDENT_SCALES", Kind.FLAG, "0",
    "hold the owned rows' scale bytes in host RAM (~1 GiB/layer/rank, one pass over the shard at start); "
    "a miss then reads 256 instead of 264 bytes, one read either way")
DSV41_WO_A_W8 = Setting(
    "DSV41_WO_A_W8", Kind.FLAG, "1",
    "fp8 twin of the target's wo_a (the checkpoint's values) serves decode/verify forwards of up to 8 "
    "rows (wo_a_w8 adapter); +16 MiB per layer and rank",
    absent="0")
DSV41_WO_A_W8_MID = Setting(
    "DSV41_WO_A_W8_MID", Kind.FLAG, "1",
    "with DSV41_WO_A_W8: the twin also serves 9-192-row verifies (2-32 requests)",
    absent="0")
DSV41_WO_A_W8_DROP = Setting(
    "DSV41_WO_A_W8_DROP", Kind.FLAG, "1",
    "with DSV41_WO_A_W8: release the bf16 wo_a of every twinned layer (-32 MiB each; other rows "
    "dequantise the twin per call); the rank then refuses to start without the adapter",
    absent="0")
DSV41_WO_A_W8_DRAFT = Setting(
    "DSV41_WO_A_W8_DRAFT", Kind.FLAG, "0",
    "with DSV41_WO_A_W8: twins for the DSpark draft's layers too")
DSV41_DRAFT_HEAD_FP8 = Setting(
    "DSV41_DRAFT_HEAD_FP8", Kind.FLAG, "1",
    "the DSpark draft projects through an fp8 copy of the shared LM head (+211 MiB per rank); the target "
    "keeps the bf16 head (draft_head_fp8 adapter)",
    absent="0")
DSV41_VERIFY_CAP = Setting(
    "DSV41_VERIFY_CAP", Kind.VERIFY_CAP, "conf:0.1",
    "0 or conf:<T>: per request accept at most k drafts, k the leading drafts whose running product of "
    "the draft's confidence stays >= T (at least 1); dead verify rows route to their anchor's experts "
    "(verify_cap adapter; needs SGLang's static verify mode; every rank refuses to start without it)",
    absent="0")
DSV41_BLOCK_VERIFY = Setting(
    "DSV41_BLOCK_VERIFY", Kind.FLAG, "1",
    "DSpark's sampled rows accepted by SGLang's block verification instead of token by token (lossless)",
    absent="0")
DSV41_DRAFT_TAU = Setting(
    "DSV41_DRAFT_TAU", Kind.REAL, "1",
    "sampled DSpark drafts at tau x the request's temperature, accepted against that distribution (1: "
    "off)",
    low=0, high=1, low_open=True)
DSV41_FOLDED_FENCE = Setting(
    "DSV41_FOLDED_FENCE", Kind.FLAG, "0",
    "clone the folded DSpark accept results off the verify graph's buffers before the next replay can "
    "overwrite them (sglang#40919, overlap scheduling)")

# Set by the coordinator's plan, never written in cluster.env.
DSV41_API_KEY_FILE = Setting(
    "DSV41_API_KEY_FILE", Kind.PATH, "",
    "where the rank reads SGLang's API key (the plan sets it when API_KEY_FILE is set); present: the key is "
    "required", in_cluster_env=False)
DSV41_PROGRESS_DIR = Setting(
    "DSV41_PROGRESS_DIR", Kind.PATH, PROGRESS_DIRECTORY,
    "directory of the rank's forward-step counter and request-state files", in_cluster_env=False)
# The admission gate's cost and level, which the plan derives from the MEMORY_GUARD_* keys.
ADMISSION_MAXIMUM_BYTES = 1 << 50  # 1 PiB: any real level; a larger one is a unit mistake
DSV41_ADMISSION_GUARD_BYTES = Setting(
    "DSV41_ADMISSION_GUARD_BYTES", Kind.INTEGER, "0",
    "memory the gate keeps on the node, bytes (0: the gate is off)", low=0, high=ADMISSION_MAXIMUM_BYTES,
    in_cluster_env=False)
DSV41_ADMISSION_TOKEN_BYTES = Setting(
    "DSV41_ADMISSION_TOKEN_BYTES", Kind.INTEGER, "0",
    "what a prompt token costs the rank, bytes", low=0, high=1 << 30, in_cluster_env=False)
DSV41_ADMISSION_TRANSIENT_BYTES = Setting(
    "DSV41_ADMISSION_TRANSIENT_BYTES", Kind.REAL, "0",
    "a prefill chunk's buffers, bytes per chunk token x prefix token", low=0, high=1e6, in_cluster_env=False)
DSV41_ADMISSION_LONE_WAIT_S = Setting(
    "DSV41_ADMISSION_LONE_WAIT_S", Kind.REAL, f"{LONE_WAIT_S:g}",
    "longest hold of a request alone in the rank, seconds", low=0, high=600, in_cluster_env=False)
ADMISSION = (DSV41_ADMISSION_GUARD_BYTES, DSV41_ADMISSION_TOKEN_BYTES, DSV41_ADMISSION_TRANSIENT_BYTES,
             DSV41_ADMISSION_LONE_WAIT_S)
# SGLang's own variables, read by the adapters to refuse what they cannot serve beside.
SGLANG_RAGGED_VERIFY_MODE = Setting(
    "SGLANG_RAGGED_VERIFY_MODE", Kind.TEXT, "", "SGLang's verify scheduling; verify_cap needs it static",
    in_cluster_env=False)
ENGRAM_CONFLICTS = tuple(Setting(name, Kind.FLAG, "0", "SGLang's own Engram table layout: conflicts with "
                                 "OFFLOAD_MODE=nvme", in_cluster_env=False)
                         for name in ("SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE", "SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS"))
ENGRAM_STORE = (DSV41_IO_THREADS, DSV41_CACHE_GIB, DSV41_CACHE_WAYS, DSV41_STATS_SECONDS, DSV41_RESIDENT_SCALES)

# In the order the rank arms them (the order of its "installed" lines).
ADAPTERS: tuple[RankAdapter, ...] = (
    RankAdapter("tp3_pad", (DSV41_TP_PAD,), Switch.FLAG, "DSV41_TP_PAD"),
    RankAdapter("mxfp8_b12x", (DSV41_MXFP8_BACKEND,)),
    RankAdapter("autotune_keep", (DSV41_AUTOTUNE_KEEP,), Switch.FLAG, "DSV41_AUTOTUNE_KEEP"),
    RankAdapter("prefill_empty_cache", (DSV41_PREFILL_EMPTY_CACHE_TOKENS,), Switch.NOT_OFF,
                "DSV41_PREFILL_EMPTY_CACHE_TOKENS", off=("0",)),
    RankAdapter("admission_gate", ADMISSION, Switch.NOT_OFF, "DSV41_ADMISSION_GUARD_BYTES", off=("", "0")),
    RankAdapter("loop_abort", (DSV41_LOOP_ABORT, DSV41_LOOP_NGRAM, DSV41_LOOP_REPEATS, DSV41_LOOP_LINE_REPEATS),
                Switch.FLAG, "DSV41_LOOP_ABORT"),
    RankAdapter("max_new_tokens", (DSV41_MAX_NEW_TOKENS,), Switch.NOT_OFF, "DSV41_MAX_NEW_TOKENS", off=("0",)),
    RankAdapter("reasoning_effort", (DSV41_REASONING_EFFORT_REMAP, SGLANG_DSV41_REASONING_EFFORT), Switch.FLAG,
                "DSV41_REASONING_EFFORT_REMAP"),
    RankAdapter("inflight", (DSV41_INFLIGHT_ROUTE, DSV41_PROGRESS_DIR), Switch.FLAG, "DSV41_INFLIGHT_ROUTE"),
    RankAdapter("api_key", (DSV41_API_KEY_FILE,), Switch.PRESENT, "DSV41_API_KEY_FILE"),
    RankAdapter("engram_offload", (OFFLOAD_MODE, DSV41_PACKED_DIR, DSV41_ENGRAM_PREFETCH, DSV41_ENGRAM_PREFETCH_CHECK,
                                   *ENGRAM_STORE, *ENGRAM_CONFLICTS), Switch.EQUALS, "OFFLOAD_MODE", on_value="nvme"),
    RankAdapter("forward_progress", (DSV41_PROGRESS_DIR,)),
    RankAdapter("wo_a_w8", (DSV41_WO_A_W8, DSV41_WO_A_W8_MID, DSV41_WO_A_W8_DROP, DSV41_WO_A_W8_DRAFT), Switch.FLAG,
                "DSV41_WO_A_W8"),
    RankAdapter("draft_head_fp8", (DSV41_DRAFT_HEAD_FP8,), Switch.FLAG, "DSV41_DRAFT_HEAD_FP8"),
    RankAdapter("verify_cap", (DSV41_VERIFY_CAP, SGLANG_RAGGED_VERIFY_MODE), Switch.NOT_OFF, "DSV41_VERIFY_CAP",
                off=("0",)),
    RankAdapter("block_verify", (DSV41_BLOCK_VERIFY,), Switch.FLAG, "DSV41_BLOCK_VERIFY"),
    RankAdapter("draft_tau", (DSV41_DRAFT_TAU,), Switch.NOT_OFF, "DSV41_DRAFT_TAU", off=("1",)),
    RankAdapter("folded_fence", (DSV41_FOLDED_FENCE,), Switch.FLAG, "DSV41_FOLDED_FENCE"),
)
BY_NAME = {adapter.name: adapter for adapter in ADAPTERS}


def settings() -> dict[str, Setting]:
    """Every declared variable once, in the adapters' order."""
    return {setting.name: setting for adapter in ADAPTERS for setting in adapter.settings}


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
