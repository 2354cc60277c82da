"""The memory guard's code stays readable: no function over 80 lines, no import cycle among its
modules, and no import of the rank's adapter (the contract it shares with the ranks is dsv41's)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

GUARD = Path(__file__).resolve().parents[2] / "coordinator" / "guard"
MAX_LINES = 80


def modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(), str(p)) for p in sorted(GUARD.glob("*.py"))}


def test_no_function_in_the_guard_is_over_80_lines():
    long = [f"{name}.py:{node.lineno} {node.name}() is {node.end_lineno - node.lineno + 1} lines"
            for name, tree in modules().items() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_LINES]
    assert not long, long


def _imports(tree: ast.Module, names: set[str]) -> set[str]:
    """The guard's modules this one imports (relative or by coordinator.guard's name)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level == 1 or base.startswith("coordinator.guard"):
                base = base.removeprefix("coordinator.guard").lstrip(".")
                if base:
                    out.add(base.split(".")[0])
                else:
                    out.update(a.name for a in node.names)
    return out & names


def test_the_guards_modules_import_each_other_without_a_cycle():
    trees = modules()
    graph = {name: _imports(tree, set(trees)) - {name} for name, tree in trees.items()}
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, " -> ".join((*path[path.index(name):], name))
        if name in done:
            return
        for other in sorted(graph[name]):
            visit(other, (*path, name))
        done.add(name)

    for name in sorted(graph):
        visit(name, ())


def test_the_guard_imports_nothing_of_the_adapter():
    found = [f"{name}.py:{node.lineno}" for name, tree in modules().items() for node in ast.walk(tree)
             if (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "adapter")
             or (isinstance(node, ast.Import) and any(a.name.split(".")[0] == "adapter" for a in node.names))]
    assert not found, found


def test_every_guard_setting_has_a_meaning_and_goes_into_the_start_event():
    from dataclasses import fields

    from coordinator.guard.settings import GuardSettings, log_fields, meanings

    settings = GuardSettings()
    logged = log_fields(settings)
    assert all(meanings()[f.name] for f in fields(GuardSettings))
    for f in fields(GuardSettings):
        if f.name == "cost":
            assert {k for k in logged if k.startswith("cost_")} == {f"cost_{c.name}" for c in fields(settings.cost)}
        else:
            assert logged["guard_mode" if f.name == "mode" else f.name] == getattr(settings, f.name)
