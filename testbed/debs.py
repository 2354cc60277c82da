"""packaging/debs.py for what builds the packages (the tests, the demo, the benches): packaging/ is
no Python package (its name would shadow python3-packaging)."""

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def debs_module():
    if "dsv41_debs" not in sys.modules:
        spec = importlib.util.spec_from_file_location("dsv41_debs", REPO / "packaging" / "debs.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["dsv41_debs"] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    return sys.modules["dsv41_debs"]
