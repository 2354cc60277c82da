"""dsv41/rankadapters.py declares the variables each adapter reads (its module's ENV_KEYS) and the one
that switches it on, and dsv41ctl config check and the health step derive from those declarations
which rank-side keys take effect and which adapters a rank arms: a declaration must be exactly what
build() reads, neither less (a key would be reported as having no effect) nor more (a key would be
claimed as implemented), and decide on and off as build() does."""

from __future__ import annotations

import io
from collections.abc import Iterator, Mapping

import pytest

from adapter import boot
from dsv41 import rankadapters
from dsv41.adapterlog import AdapterLog

pytestmark = pytest.mark.unit

# Settings that reach the parts of build() that defaults do not: the Engram offload reads its keys
# once OFFLOAD_MODE=nvme, the API key adapter only looks at its variable's presence. The decode
# adapters read all their keys whatever the values.
# The admission gate reads its cost once its guard level is set.
CONFIGURATIONS = ({}, {"OFFLOAD_MODE": "nvme", "DSV41_ENGRAM_PREFETCH": "1"}, {"DSV41_API_KEY_FILE": "/k"},
                  {"DSV41_ADMISSION_GUARD_BYTES": "150000000"})
DECODE_KEYS = ("DSV41_WO_A_W8", "DSV41_WO_A_W8_MID", "DSV41_WO_A_W8_DROP", "DSV41_WO_A_W8_DRAFT",
               "DSV41_DRAFT_HEAD_FP8", "DSV41_VERIFY_CAP", "DSV41_BLOCK_VERIFY", "DSV41_DRAFT_TAU",
               "DSV41_FOLDED_FENCE")


class Recording(Mapping):
    """A rank environment that records every variable looked up, and refuses to be listed."""

    def __init__(self, values: dict[str, str]) -> None:
        self.values = values
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> str:
        self.read.add(key)
        return self.values[key]

    def __iter__(self) -> Iterator[str]:
        raise AssertionError("build() must look variables up by name, not list the environment")

    def __len__(self) -> int:
        return len(self.values)


@pytest.mark.parametrize("module, builder", boot.ADAPTERS, ids=[m.NAME for m, _ in boot.ADAPTERS])
def test_declared_keys_are_exactly_what_build_reads(module, builder) -> None:
    read: set[str] = set()
    for values in CONFIGURATIONS:
        env = Recording(values)
        builder(env, AdapterLog(io.StringIO()))
        read |= env.read
    assert read == set(module.ENV_KEYS), module.NAME


def test_every_adapter_module_is_armed_and_the_builders_follow_it() -> None:
    assert [name for name, _ in boot.BUILDERS] == [m.NAME for m, _ in boot.ADAPTERS]
    keys = boot.env_keys()
    assert keys["DSV41_SOURCE"] == ("boot",) and keys["DSV41_RESIDENT_SCALES"] == ("engram_offload",)
    assert keys["DSV41_ENGRAM_PREFETCH"] == ("engram_offload",)
    # The decode adapters: every key of the example configuration's decode block has its reader.
    assert {k: keys[k] for k in DECODE_KEYS} == {
        "DSV41_WO_A_W8": ("wo_a_w8",), "DSV41_WO_A_W8_MID": ("wo_a_w8",), "DSV41_WO_A_W8_DROP": ("wo_a_w8",),
        "DSV41_WO_A_W8_DRAFT": ("wo_a_w8",), "DSV41_DRAFT_HEAD_FP8": ("draft_head_fp8",),
        "DSV41_VERIFY_CAP": ("verify_cap",), "DSV41_BLOCK_VERIFY": ("block_verify",),
        "DSV41_DRAFT_TAU": ("draft_tau",), "DSV41_FOLDED_FENCE": ("folded_fence",)}


def test_the_declarations_follow_the_armed_modules_in_order() -> None:
    assert [m.NAME for m, _ in boot.ADAPTERS] == [a.name for a in rankadapters.ADAPTERS]
    assert all(a.key in a.keys for a in rankadapters.ADAPTERS if a.switch is not rankadapters.Switch.ALWAYS)


SOURCE = {"DSV41_SOURCE": "/models/x"}
SWITCH_CASES = (
    {}, {"DSV41_TP_PAD": "0", "DSV41_AUTOTUNE_KEEP": "off", "DSV41_LOOP_ABORT": "no", "DSV41_INFLIGHT_ROUTE": "0"},
    {"DSV41_PREFILL_EMPTY_CACHE_TOKENS": "0", "DSV41_MAX_NEW_TOKENS": "0", "DSV41_REASONING_EFFORT_REMAP": "0"},
    {"DSV41_ADMISSION_GUARD_BYTES": "150000000", "DSV41_API_KEY_FILE": "", "OFFLOAD_MODE": "nvme"},
    {"OFFLOAD_MODE": "host", "DSV41_WO_A_W8": "1", "DSV41_DRAFT_HEAD_FP8": "yes", "DSV41_VERIFY_CAP": "conf:0.1",
     "DSV41_BLOCK_VERIFY": "1", "DSV41_DRAFT_TAU": "0.8", "DSV41_FOLDED_FENCE": "true"},
    {"DSV41_VERIFY_CAP": "0", "DSV41_DRAFT_TAU": "1.0", "DSV41_PREFILL_EMPTY_CACHE_TOKENS": "4096"},
)


@pytest.mark.parametrize("values", SWITCH_CASES)
def test_the_declared_switches_decide_as_the_builders_do(values) -> None:
    env = {**SOURCE, **values}
    built = {spec.name for spec in boot.build_specs(env, AdapterLog(io.StringIO()))}
    assert rankadapters.switched_on(env) == built
    assert rankadapters.switched_on(values) == frozenset()  # not armed without DSV41_SOURCE
