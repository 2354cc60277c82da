"""The demo and the node harness it boots with run from a tree without tests/: neither imports it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def imported_modules(source: str) -> set[str]:
    """Every module an `import` or `from ... import` statement names, at any depth of the code."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def from_tests(names: set[str]) -> set[str]:
    return {name for name in names if name == "tests" or name.startswith("tests.")}


def test_the_scan_sees_imports_inside_functions():
    source = "import os\ndef f():\n    from tests.cluster.sparks import ctl\n    import tests\n"
    assert from_tests(imported_modules(source)) == {"tests.cluster.sparks", "tests"}
    assert from_tests(imported_modules("from testbed.sparks import ctl\nimport testsuite\n")) == set()


@pytest.mark.parametrize("path", ["tools/demo.py", *sorted(str(p.relative_to(REPO))
                                                             for p in (REPO / "testbed").glob("*.py"))])
def test_imports_nothing_from_tests(path):
    assert from_tests(imported_modules((REPO / path).read_text())) == set()


def test_the_demo_boots_with_the_testbed():
    assert {"testbed.nspawn", "testbed.sparks", "testbed.rehearsal"} <= imported_modules(
        (REPO / "tools" / "demo.py").read_text())
