"""The adapter's PYTHONPATH entry as a rank has it (sitecustomize.py, adapter/ and the dsv41/ contracts
side by side), and
an environment without this machine's DSV41_*/PYTHON* settings, for tests that start a Python
process the way a rank starts."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def adapter_entry(tmp_path: Path) -> Path:
    entry = tmp_path / "entry"
    entry.mkdir(exist_ok=True)
    for link, target in (("sitecustomize.py", REPO / "adapter" / "sitecustomize.py"), ("adapter", REPO / "adapter"),
                         ("dsv41", REPO / "dsv41")):
        if not (entry / link).exists():
            (entry / link).symlink_to(target)
    return entry


def rank_env(path: list[str], **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSV41_", "PYTHON"))}
    env.update(PYTHONPATH=os.pathsep.join(path), **extra)
    return env
