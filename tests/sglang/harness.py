"""Running small check scripts under the cached SGLang venv, from the outer pytest process.

The venv from tools/sglang-venv.sh holds CPU torch and sglang 0.5.23 without most of sglang's
runtime dependencies: enough to parse a rank's argv, not to import the modules the adapters
patch (the scheduler, the tokenizer manager, the HTTP server). The first run therefore installs
those pure-Python dependencies, pinned and without their own dependencies, into a cached overlay
directory (OVERLAY) that goes on PYTHONPATH; torchvision is replaced by tests/sglang/stubs.
(Folding PACKAGES into tools/sglang-venv.sh would make the overlay unnecessary.)

Each check script prints one JSON object as its last stdout line; the adapter reaches it the way
it reaches a rank: a PYTHONPATH entry holding sitecustomize.py, the adapter/ package and
dsv41_adapter.dist-info (symlinks into this repository).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECKS = Path(__file__).resolve().parent / "checks"
STUBS = Path(__file__).resolve().parent / "stubs"
OVERLAY = Path(os.environ.get("DSV41_SGLANG_OVERLAY", "/var/tmp/dsv41-sglang-adapter-overlay"))
OVERLAY_STAMP = "dsv41-overlay-1"
PACKAGES = (
    "annotated-doc==0.0.7",
    "apache-tvm-ffi==0.1.11",
    "cffi==2.1.1",
    "click==8.5.1",
    "compressed-tensors==0.20.1",
    "dill==0.4.1",
    "einops==0.8.2",
    "fastapi==0.165.0",
    "gguf==0.19.0",
    "h11==0.16.0",
    "httpcore2==2.16.2",
    "httpx2==2.16.2",
    "huggingface-hub==2.4.0",
    "jsonschema==4.26.0",
    "jsonschema-specifications==2025.9.1",
    "loguru==0.7.3",
    "openai==3.57.0",
    "opentelemetry-api==1.45.2",
    "partial-json-parser==0.2.1.1.post7",
    "pycparser==3.12",
    "python-multipart==0.0.34",
    "pyyaml==6.0.4",
    "referencing==0.37.0",
    "regex==2026.11.19",
    "rpds-py==2026.9.1",
    "safetensors==0.8.0",
    "sentencepiece==0.2.3",
    "setproctitle==1.3.8",
    "sniffio==1.3.1",
    "soundfile==0.14.0",
    "tokenizers==0.23.2",
    "transformers==5.24.0",
    "truststore==0.10.5",
    "uvicorn==0.54.0",
    "uvloop==0.23.0",
    "xgrammar==0.2.9",
)


def venv() -> Path:
    out = subprocess.run(
        [str(REPO / "tools" / "sglang-venv.sh")], capture_output=True, text=True, timeout=1800, check=True
    )
    return Path(out.stdout.strip().splitlines()[-1])


def overlay(python: Path) -> Path:
    stamp = OVERLAY / OVERLAY_STAMP
    if stamp.is_file() and stamp.read_text().split() == list(PACKAGES):
        return OVERLAY
    tmp = OVERLAY.with_name(OVERLAY.name + f".tmp{os.getpid()}")
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", "--target", str(tmp)]
    done = subprocess.run([*pip, *PACKAGES], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        subprocess.run(["rm", "-rf", str(tmp)], check=False)
        pytest.skip(f"cannot build the SGLang import overlay with pip: {done.stderr.strip()[-500:]}")
    (tmp / OVERLAY_STAMP).write_text("\n".join(PACKAGES) + "\n")
    subprocess.run(["rm", "-rf", str(OVERLAY)], check=False)
    os.replace(tmp, OVERLAY)
    return OVERLAY


def adapter_dir(root: Path, sitecustomize: bool = True) -> Path:
    """A PYTHONPATH entry laid out like the installed adapter, made of symlinks."""
    entry = root / ("adapter-entry" if sitecustomize else "adapter-entry-plugin-only")
    entry.mkdir(exist_ok=True)
    links = [
        ("adapter", REPO / "adapter"),
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
    def __init__(self, python: Path, overlay_dir: Path, root: Path) -> None:
        self.python = python
        self.overlay = overlay_dir
        self.entry = adapter_dir(root)
        self.plugin_only_entry = adapter_dir(root, sitecustomize=False)
        self.root = root

    def env(self, armed: bool, extra: dict[str, str] | None = None, sitecustomize: bool = True) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DSV41_", "SGLANG_", "PYTHON"))}
        entry = self.entry if sitecustomize else self.plugin_only_entry
        env["PYTHONPATH"] = os.pathsep.join([str(entry), str(STUBS), str(self.overlay)])
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


if __name__ == "__main__":  # build the overlay ahead of a test run
    print(overlay(venv() / "bin" / "python"), file=sys.stderr)
