"""Fixtures of the sglang tier: the cached venv, a scratch directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sglang.harness import Sglang, venv


@pytest.fixture(scope="session")
def sglang(tmp_path_factory: pytest.TempPathFactory) -> Sglang:
    python = venv() / "bin" / "python"
    return Sglang(python, Path(tmp_path_factory.mktemp("sglang")))
