"""Running small check scripts under the cached SGLang venv, from the outer pytest process.

The venv from tools/sglang-venv.sh is the real engine's environment: CPU torch, sglang 0.5.23 and
everything its server imports, with the CPU shims of sgl_kernel and torchvision.

Each check script prints one JSON object as its last stdout line; the adapter reaches it the way
it reaches a rank: a PYTHONPATH entry holding sitecustomize.py, the adapter/ package and
dsv41_adapter.dist-info (symlinks into this repository).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CHECKS = Path(__file__).resolve().parent / "checks"


def venv() -> Path:
    out = subprocess.run(
        [str(REPO / "tools" / "sglang-venv.sh")], capture_output=True, text=True, timeout=1800, check=True
    )
    return Path(out.stdout.strip().splitlines()[-1])


def adapter_dir(root: Path, sitecustomize: bool = True) -> Path:
    """A PYTHONPATH entry laid out like the installed adapter, made of symlinks."""
    entry = root / ("adapter-entry" if sitecustomize else "adapter-entry-plugin-only")
    entry.mkdir(exist_ok=True)
    links = [
        ("adapter", REPO / "adapter"),
        ("dsv41", REPO / "dsv41"),  # the contracts the adapter imports, shipped beside it
        ("dsv41_adapter.dist-info", REPO / "adapter" / "dsv41_adapter.dist-info"),
    ]
    if sitecustomize:
        links.append(("sitecustomize.py", REPO / "adapter" / "sitecustomize.py"))
    for name, target in links:
        link = entry / name
        if not link.exists():
            link.symlink_to(target)
    return entry


class Sglang:
    def __init__(self, python: Path, root: Path) -> None:
        self.python = python
        self.entry = adapter_dir(root)
        self.plugin_only_entry = adapter_dir(root, sitecustomize=False)
        self.root = root

    def env(self, armed: bool, extra: dict[str, str] | None = None, sitecustomize: bool = True) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DSV41_", "SGLANG_", "PYTHON"))}
        entry = self.entry if sitecustomize else self.plugin_only_entry
        env["PYTHONPATH"] = str(entry)
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env["SGLANG_CACHE_DIR"] = str(self.root / "sglang-cache")
        env["HOME"] = str(self.root)
        if armed:
            env["DSV41_SOURCE"] = "/models/DeepSeek-V4.1-Flash"
        env.update(extra or {})
        return env

    def check(
        self,
        script: str,
        *args: str,
        armed: bool = True,
        env: dict[str, str] | None = None,
        sitecustomize: bool = True,
        timeout: float = 300,
    ) -> tuple[dict[str, Any], str]:
        """Run checks/<script>.py; (its JSON result, its stderr)."""
        done = subprocess.run(
            [str(self.python), str(CHECKS / f"{script}.py"), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env(armed, env, sitecustomize),
            cwd=str(self.root),
        )
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            raise AssertionError(
                f"check {script} failed (exit {done.returncode})\nstdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-6000:]}"
            )
        return json.loads(lines[-1]), done.stderr


def adapter_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("dsv41-adapter: ")]
