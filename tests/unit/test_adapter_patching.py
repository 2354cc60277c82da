"""Import-time patching: hooks land on real modules as they are imported, never break an import."""

from __future__ import annotations

import importlib
import io
import sys
import textwrap
from pathlib import Path

import pytest

from dsv41.adapterlog import AdapterLog
from adapter.patching import (
    AFTER,
    BEFORE,
    ON_IMPORT,
    AdapterSpec,
    Installer,
    Patch,
    PatchError,
    PostImportFinder,
    arm,
    wrap,
)
from tests.fakepkg import fake_package

pytestmark = pytest.mark.unit

SOURCE = textwrap.dedent(
    """
    class Req:
        def __init__(self):
            self.calls = []

        def update(self, n=1):
            self.calls.append(n)
            return n * 2

        @staticmethod
        def make(x):
            return x + 1

    def free(a, b):
        return a + b
    """
)


@pytest.fixture
def pkg(tmp_path: Path, request: pytest.FixtureRequest):
    with fake_package(tmp_path, "dsv41fake_", request.node.name, SOURCE) as name:
        yield name


def installer(specs, buf: io.StringIO, registry=None) -> Installer:
    return Installer(specs, AdapterLog(buf), registry_loader=lambda: registry)


def test_before_hook_changes_arguments_and_logs_one_line(pkg: str) -> None:
    buf = io.StringIO()
    seen = []

    def double_b(a, b):
        seen.append((a, b))
        return (a, b * 10), {}

    spec = AdapterSpec("demo", "x=1", (Patch(f"{pkg}.target", "free", BEFORE, double_b, params=("a", "b")),))
    inst = installer([spec], buf)
    arm(inst)
    module = importlib.import_module(f"{pkg}.target")
    assert module.free(1, 2) == 21
    assert seen == [(1, 2)]
    assert buf.getvalue() == "dsv41-adapter: demo installed (x=1; via import hook)\n"
    # The module keeps its real loader, so inspect and importlib.resources work as before.
    assert type(module.__loader__).__name__ == "SourceFileLoader"


def test_after_hook_replaces_or_keeps_the_result(pkg: str) -> None:
    buf = io.StringIO()

    def after(result, req, n=1):
        return None if n == 1 else result + 100

    spec = AdapterSpec("demo", "d", (Patch(f"{pkg}.target", "Req.update", AFTER, after, params=("self", "n")),))
    arm(installer([spec], buf))
    module = importlib.import_module(f"{pkg}.target")
    req = module.Req()
    assert req.update() == 2
    assert req.update(3) == 106
    assert req.calls == [1, 3]


def test_staticmethod_stays_a_staticmethod(pkg: str) -> None:
    spec = AdapterSpec("demo", "d", (Patch(f"{pkg}.target", "Req.make", AFTER, lambda r, x: r * 10),))
    arm(installer([spec], io.StringIO()))
    module = importlib.import_module(f"{pkg}.target")
    assert isinstance(module.Req.__dict__["make"], staticmethod)
    assert module.Req.make(1) == 20 and module.Req().make(2) == 30


def test_missing_target_is_logged_and_the_adapter_stays_out(pkg: str) -> None:
    buf = io.StringIO()
    calls = []
    spec = AdapterSpec(
        "demo",
        "d",
        (
            Patch(f"{pkg}.target", "free", BEFORE, lambda a, b: calls.append(1)),
            Patch(f"{pkg}.target", "Req.gone", AFTER, lambda r, s: None),
        ),
    )
    inst = installer([spec], buf)
    arm(inst)
    module = importlib.import_module(f"{pkg}.target")  # the import itself must succeed
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("dsv41-adapter: demo installed")
    assert lines[1] == f"dsv41-adapter: demo could not patch {pkg}.target.Req.gone: {pkg}.target has no Req.gone; demo stays out"
    assert not inst.is_on("demo")
    assert module.free(2, 3) == 5
    assert calls == []  # the part that did apply passes through once the adapter is out


def test_changed_signature_is_refused(pkg: str) -> None:
    buf = io.StringIO()
    spec = AdapterSpec(
        "demo", "d", (Patch(f"{pkg}.target", "Req.update", AFTER, lambda r, s, n=1: 0, params=("self", "new_accepted_len")),)
    )
    arm(installer([spec], buf))
    module = importlib.import_module(f"{pkg}.target")
    assert "parameters new_accepted_len are gone" in buf.getvalue()
    assert module.Req().update(2) == 4  # untouched


def test_a_hook_that_raises_switches_its_adapter_off_without_breaking_the_call(pkg: str) -> None:
    buf = io.StringIO()

    def boom(result, a, b):
        raise RuntimeError("bug in adapter")

    spec = AdapterSpec("demo", "d", (Patch(f"{pkg}.target", "free", AFTER, boom),))
    inst = installer([spec], buf)
    arm(inst)
    module = importlib.import_module(f"{pkg}.target")
    assert module.free(1, 1) == 2
    assert module.free(2, 2) == 4
    failures = [line for line in buf.getvalue().splitlines() if "failed in" in line]
    assert failures == [f"dsv41-adapter: demo failed in {pkg}.target.free: RuntimeError: bug in adapter; demo stays out"]
    assert not inst.is_on("demo")


def test_modules_imported_before_arming_are_patched_at_once(pkg: str) -> None:
    module = importlib.import_module(f"{pkg}.target")
    spec = AdapterSpec("demo", "d", (Patch(f"{pkg}.target", "free", AFTER, lambda r, a, b: -r),))
    arm(installer([spec], io.StringIO()))
    assert module.free(1, 2) == -3


def test_arming_twice_wraps_once(pkg: str) -> None:
    spec = AdapterSpec("demo", "d", (Patch(f"{pkg}.target", "free", AFTER, lambda r, a, b: r + 1),))
    arm(installer([spec], io.StringIO()))
    module = importlib.import_module(f"{pkg}.target")
    arm(installer([spec], io.StringIO()))  # e.g. sitecustomize, then the plugin entry point
    assert module.free(1, 2) == 4


def test_on_import_failure_is_a_could_not_patch(pkg: str) -> None:
    buf = io.StringIO()

    def need_app(module):
        raise PatchError(f"{module.__name__} has no app")

    spec = AdapterSpec("route", "d", (Patch(f"{pkg}.target", "", ON_IMPORT, need_app),))
    arm(installer([spec], buf))
    importlib.import_module(f"{pkg}.target")
    assert buf.getvalue() == f"dsv41-adapter: route could not patch {pkg}.target: {pkg}.target has no app; route stays out\n"


class FakeRegistry:
    """Just enough of SGLang's HookRegistry: register, then apply by wrapping and setattr."""

    class HookType:
        BEFORE, AFTER, AROUND = BEFORE, AFTER, "around"

    def __init__(self) -> None:
        self.registered: list[tuple[str, str]] = []
        self._pending: list[tuple[str, object, str]] = []

    def register(self, target, hook, hook_type) -> None:
        self.registered.append((target, hook_type))
        self._pending.append((target, hook, hook_type))

    def apply_hooks(self) -> None:
        for target, hook, kind in self._pending:
            mod_name, attr = target.rsplit(".", 1)
            owner = importlib.import_module(mod_name) if mod_name in sys.modules else None
            setattr(owner, attr, wrap(getattr(owner, attr), kind, hook))
        self._pending.clear()


def test_sglang_hook_registry_is_used_when_present(pkg: str) -> None:
    registry = FakeRegistry()
    buf = io.StringIO()
    spec = AdapterSpec("demo", "d", (Patch(f"{pkg}.target", "free", AFTER, lambda r, a, b: r * 3),))
    arm(installer([spec], buf, registry=(registry, FakeRegistry.HookType)))
    module = importlib.import_module(f"{pkg}.target")
    assert registry.registered == [(f"{pkg}.target.free", AFTER)]
    assert module.free(1, 1) == 6
    assert buf.getvalue().endswith("via HookRegistry)\n")


class OnceRegistry(FakeRegistry):
    """SGLang's HookRegistry applies a target once: apply_hooks skips targets it already patched."""

    def __init__(self) -> None:
        super().__init__()
        self._patched: set[str] = set()

    def apply_hooks(self) -> None:
        self._pending = [p for p in self._pending if p[0] not in self._patched]
        self._patched |= {p[0] for p in self._pending}
        super().apply_hooks()


def test_two_adapters_on_one_target_both_apply_through_the_registry(pkg: str) -> None:
    registry = OnceRegistry()
    buf = io.StringIO()
    first = AdapterSpec("first", "d", (Patch(f"{pkg}.target", "free", AFTER, lambda r, a, b: r * 3),),
                        fail_closed=True)
    second = AdapterSpec("second", "d", (Patch(f"{pkg}.target", "free", BEFORE, lambda a, b: ((a, b + 10), {})),),
                         fail_closed=True)
    inst = installer([first, second], buf, registry=(registry, FakeRegistry.HookType))
    arm(inst)
    module = importlib.import_module(f"{pkg}.target")
    # The second hook wraps the first's wrapper: (1 + (1 + 10)) * 3.
    assert module.free(1, 1) == 36
    assert registry.registered == [(f"{pkg}.target.free", AFTER)]
    assert inst.is_on("first") and inst.is_on("second")
    assert "could not patch" not in buf.getvalue()
    # Arming the same adapters again (a second installer in the process) patches nothing twice,
    # although the first adapter's mark is no longer on the outermost wrapper.
    installer([first, second], io.StringIO(), registry=(registry, FakeRegistry.HookType)).on_import(module)
    assert module.free(1, 1) == 36


def test_registry_that_does_not_apply_is_reported(pkg: str) -> None:
    class Inert(FakeRegistry):
        def apply_hooks(self) -> None:
            self._pending.clear()

    buf = io.StringIO()
    spec = AdapterSpec("demo", "d", (Patch(f"{pkg}.target", "free", AFTER, lambda r, a, b: 0),))
    inst = installer([spec], buf, registry=(Inert(), FakeRegistry.HookType))
    arm(inst)
    importlib.import_module(f"{pkg}.target")
    assert "HookRegistry did not apply the hook" in buf.getvalue()
    assert not inst.is_on("demo")


def test_the_finder_only_answers_for_watched_modules(pkg: str) -> None:
    spec = AdapterSpec("demo", "d", (Patch(f"{pkg}.target", "free", AFTER, lambda r, a, b: r),))
    finder = PostImportFinder(installer([spec], io.StringIO()))
    assert finder.find_spec("json", None) is None
    assert finder.find_spec(f"{pkg}.nothing_here", None) is None


def test_patch_records_are_validated() -> None:
    with pytest.raises(ValueError, match="kind"):
        Patch("m", "f", "sideways", print)
    with pytest.raises(ValueError, match="on_import"):
        Patch("m", "f", ON_IMPORT, print)
