"""Arming the adapters in one process: read the settings, build the patches, hook the imports.

Called from sitecustomize.py at interpreter start and from the `sglang.srt.plugins` entry point
(adapter.plugin:load); the second call in a process finds the first one's finder and does
nothing. Only DSV41_SOURCE (the model path the coordinator always sets for a rank) arms it.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable, Mapping

from adapter import (
    admission_gate,
    api_key,
    autotune_keep,
    block_verify,
    draft_head_fp8,
    draft_tau,
    engram_offload,
    folded_fence,
    forward_progress,
    inflight,
    loop_abort,
    max_new_tokens,
    mxfp8_b12x,
    prefill_empty_cache,
    reasoning_effort,
    tp3_pad,
    verify_cap,
    wo_a_w8,
)
from adapter.patching import AdapterSpec, Installer, arm, armed_finder
from dsv41 import rankadapters
from dsv41.adapterlog import AdapterLog
from dsv41.ranksettings import SettingError

ARM_VARIABLE = rankadapters.ARM_VARIABLE

Builder = Callable[[Mapping[str, str], AdapterLog], AdapterSpec | None]

# Every adapter module with its builder. Order matters only for the order of the "installed" lines.
ADAPTERS: tuple[tuple[types.ModuleType, Builder], ...] = (
    (tp3_pad, tp3_pad.build),
    (mxfp8_b12x, mxfp8_b12x.build),
    (autotune_keep, lambda env, log: autotune_keep.build(env, log=log)),
    (prefill_empty_cache, lambda env, log: prefill_empty_cache.build(env)),
    (admission_gate, lambda env, log: admission_gate.build(env, log)),
    (loop_abort, lambda env, log: loop_abort.build(env)),
    (max_new_tokens, lambda env, log: max_new_tokens.build(env)),
    (reasoning_effort, lambda env, log: reasoning_effort.build(env)),
    (inflight, lambda env, log: inflight.build(env)),
    (api_key, api_key.build),
    (engram_offload, engram_offload.build),
    (forward_progress, lambda env, log: forward_progress.build(env)),
    (wo_a_w8, wo_a_w8.build),
    (draft_head_fp8, draft_head_fp8.build),
    (verify_cap, verify_cap.build),
    (block_verify, block_verify.build),
    (draft_tau, draft_tau.build),
    (folded_fence, folded_fence.build),
)
BUILDERS: tuple[tuple[str, Builder], ...] = tuple((module.NAME, build) for module, build in ADAPTERS)


def env_keys() -> dict[str, tuple[str, ...]]:
    """{variable: the adapters that read it}: dsv41/rankadapters.py declares them for both sides."""
    return rankadapters.env_keys()


def armed(env: Mapping[str, str]) -> bool:
    return bool(env.get(ARM_VARIABLE, "").strip())


def build_specs(env: Mapping[str, str], log: AdapterLog, builders: tuple[tuple[str, Builder], ...] = BUILDERS) -> list[AdapterSpec]:
    """The adapters the settings switch on; a bad setting keeps only its own adapter out."""
    specs = []
    for name, builder in builders:
        try:
            spec = builder(env, log)
        except SettingError as e:
            log.stays_out(name, str(e))
            continue
        except Exception as e:  # noqa: BLE001 - one adapter's bug must not block the others
            log.stays_out(name, f"{type(e).__name__}: {e}")
            continue
        if spec is not None:
            specs.append(spec)
    return specs


def arm_process(env: Mapping[str, str] | None = None, log: AdapterLog | None = None) -> Installer | None:
    """Arm this process once; None when DSV41_SOURCE is not set."""
    environ = os.environ if env is None else env
    if not armed(environ):
        return None
    existing = armed_finder()
    if existing is not None:
        return existing.installer
    logger = log if log is not None else AdapterLog()
    installer = Installer(build_specs(environ, logger), logger)
    arm(installer)
    return installer
