"""autotune_keep: reuse FlashInfer autotune caches across boots only for the same launch.

SGLang keeps each rank's FlashInfer tactic cache at
`$SGLANG_CACHE_DIR/flashinfer/autotune/<flashinfer version>/<sm arch>/<model key>/rank_*.json`
(SGLANG_CACHE_DIR defaults to ~/.cache/sglang). Reusing it makes boots faster and keeps tactics,
greedy outputs and tok/s identical across restarts, but its key ignores most of the launch
(kernel environment variables, most server flags). Beside every cache file this adapter keeps
`rank_*.launch` with a fingerprint of the launch: the server argv and the kernel-relevant
environment (SGLANG_*, DSV41_*, FLASHINFER_*, TORCH_*, PYTORCH_*, CUDA_*, TRITON_*, NVIDIA_*),
minus values that change from boot to boot (rendezvous address, ports, API keys, systemd's
per-invocation variables). When SGLang asks for the cache path
(`flashinfer_autotune_cache_path`) and the recorded fingerprint differs, the old cache is deleted
so this boot retunes; the new fingerprint is written either way.

Forcing a retune (what `dsv41ctl autotune reset` does on every node through its agent) is
dsv41/autotune_cache.py's `clear_autotune_caches`, which removes both kinds of file.

DSV41_AUTOTUNE_KEEP=0 leaves SGLang's own cache handling alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from adapter.patching import AFTER, AdapterSpec, Patch
from dsv41 import rankadapters
from dsv41.adapterlog import AdapterLog

NAME = "autotune_keep"
# The variables build() reads: dsv41ctl config check reports any other adapter key as no effect.
ENV_KEYS = rankadapters.BY_NAME[NAME].keys  # every variable build() reads, declared in dsv41
MODULE = "sglang.srt.model_executor.runner.flashinfer_autotune"
ENV_PREFIXES = ("SGLANG_", "DSV41_", "FLASHINFER_", "TORCH_", "PYTORCH_", "CUDA_", "TRITON_", "NVIDIA_")
# Set per boot (or per systemd invocation) without changing what the kernels do.
PER_BOOT_ENV = frozenset(
    {
        "INVOCATION_ID",
        "JOURNAL_STREAM",
        "NOTIFY_SOCKET",
        "SYSTEMD_EXEC_PID",
        "MANAGERPID",
        "WATCHDOG_PID",
        "WATCHDOG_USEC",
        "DSV41_GENERATION",
        "DSV41_CLUSTER_GENERATION",
        "DSV41_BOOT_ID",
        "DSV41_LAUNCH_ID",
    }
)
PER_BOOT_FLAGS = frozenset({"--dist-init-addr", "--host", "--port", "--nccl-port", "--api-key", "--admin-api-key"})


def launch_args(argv: Sequence[str]) -> list[str]:
    """The server arguments (argv[1:]) without the per-boot flags and their values."""
    out: list[str] = []
    skip_value = False
    for arg in argv[1:]:
        if skip_value:
            skip_value = False
            if not arg.startswith("--"):
                continue
        flag = arg.split("=", 1)[0]
        if flag in PER_BOOT_FLAGS:
            skip_value = "=" not in arg
            continue
        out.append(arg)
    return out


def launch_env(env: Mapping[str, str]) -> dict[str, str]:
    return {
        k: v for k, v in sorted(env.items()) if k.startswith(ENV_PREFIXES) and k not in PER_BOOT_ENV
    }


def launch_fingerprint(argv: Sequence[str], env: Mapping[str, str]) -> str:
    payload = json.dumps({"argv": launch_args(argv), "env": launch_env(env)}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def launch_file(cache_file: Path) -> Path:
    return cache_file.with_suffix(".launch")


class AutotuneCacheKeeper:
    """Deletes a rank's tactic cache when the launch that made it differs from this one.

    argv and the environment are read when the first cache path is seen, not at construction:
    in a spawned scheduler process sys.argv is only restored after interpreter start-up.
    """

    def __init__(
        self,
        argv: Callable[[], Sequence[str]],
        env: Callable[[], Mapping[str, str]],
        log: AdapterLog | None = None,
    ) -> None:
        self._argv = argv
        self._env = env
        self._log = log
        self._record: dict[str, Any] | None = None

    @property
    def fingerprint(self) -> str:
        return self.record()["fingerprint"]

    def record(self) -> dict[str, Any]:
        if self._record is None:
            argv, env = list(self._argv()), dict(self._env())
            self._record = {
                "fingerprint": launch_fingerprint(argv, env),
                "argv": launch_args(argv),
                "env_keys": sorted(launch_env(env)),
            }
        return self._record

    def recorded(self, cache_file: Path) -> str | None:
        try:
            data = json.loads(launch_file(cache_file).read_text())
        except (OSError, ValueError):
            return None
        value = data.get("fingerprint") if isinstance(data, dict) else None
        return value if isinstance(value, str) else None

    def reconcile(self, cache_file: Path) -> str:
        """"kept" (same launch), "discarded" (cache of another launch removed) or "new"."""
        if self.recorded(cache_file) == self.fingerprint:
            return "kept"
        outcome = "new"
        try:
            cache_file.unlink()
            outcome = "discarded"
        except FileNotFoundError:
            pass
        target = launch_file(cache_file)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.record(), sort_keys=True) + "\n")
        os.replace(tmp, target)
        if outcome == "discarded" and self._log is not None:
            self._log.line(f"{NAME}: launch changed, discarded {cache_file} (FlashInfer retunes this boot)")
        return outcome

    def after_cache_path(self, result: Any, *_args: Any, **_kwargs: Any) -> None:
        self.reconcile(Path(result))
        return None


def build(
    env: Mapping[str, str],
    argv: Callable[[], Sequence[str]] | None = None,
    log: AdapterLog | None = None,
) -> AdapterSpec | None:
    if not rankadapters.DSV41_AUTOTUNE_KEEP.read(env):
        return None
    keeper = AutotuneCacheKeeper(argv if argv is not None else (lambda: sys.argv), lambda: os.environ, log)
    return AdapterSpec(
        name=NAME,
        state=keeper,
        detail="retune when the launch fingerprint changes",
        patches=(
            Patch(MODULE, "flashinfer_autotune_cache_path", AFTER, keeper.after_cache_path, params=("model_runner",)),
        ),
    )
