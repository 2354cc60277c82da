"""Applying the adapters' hooks to SGLang modules right after those modules are imported.

Each adapter declares Patch records (module, attribute path, hook kind, hook). A meta-path finder
(PostImportFinder) notices when a watched module has been executed and hands it to the Installer,
which checks that the target still exists with the expected parameters and then wraps it:

- through SGLang's own HookRegistry (`sglang.srt.plugins.hook_registry`, SGLang >= 0.5.2x) when the
  running SGLang has it: same BEFORE/AFTER/AROUND semantics, and it rebinds stale
  `from X import Y` references in other modules. It applies a target once, so a second adapter
  hooking the same target wraps the first one's result with the wrappers below;
- otherwise (older images) with equivalent wrappers of our own.

Patching at import time, rather than importing every target up front, keeps each SGLang process
(HTTP server, schedulers, detokenizer) from importing modules it never uses.

Nothing here may break SGLang's import: a missing or changed target is logged on one line and the
adapter owning it switches itself off ("stays out"); a hook that raises at run time does the same.
The one exception is an adapter marked fail_closed (the API key): switching it off would mean
serving without authentication, so its patch failures and hook errors stop the process instead.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import sys
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dsv41.adapterlog import PREFIX, AdapterLog

BEFORE = "before"  # hook(*args, **kwargs) -> None or (args, kwargs)
AFTER = "after"  # hook(result, *args, **kwargs) -> None (keep result) or a new result
AROUND = "around"  # hook(original, *args, **kwargs) -> result
ON_IMPORT = "on_import"  # hook(module) -> None; for changes that are not function wraps
KINDS = (BEFORE, AFTER, AROUND, ON_IMPORT)

MARK = "__dsv41_adapter__"  # set on every function we wrapped, so arming twice patches once
REGISTRY_MODULE = "sglang.srt.plugins.hook_registry"


@dataclass(frozen=True)
class Patch:
    module: str  # the module that defines the target, e.g. "sglang.srt.managers.schedule_batch"
    attr: str  # attribute path inside it, e.g. "Req.update_finish_state"; "" for ON_IMPORT
    kind: str
    hook: Callable[..., Any]
    params: tuple[str, ...] = ()  # parameter names the target must still have

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"patch kind {self.kind!r}: expected one of {', '.join(KINDS)}")
        if (self.kind == ON_IMPORT) != (self.attr == ""):
            raise ValueError("an on_import patch has no attribute; every other kind needs one")

    @property
    def target(self) -> str:
        return f"{self.module}.{self.attr}" if self.attr else self.module


@dataclass(frozen=True)
class AdapterSpec:
    """What an adapter module's build(env) returns when its setting switches it on."""

    name: str
    detail: str  # the settings it runs with, for the "installed" line
    patches: tuple[Patch, ...]
    state: Any = None  # the adapter object the hooks belong to (for inspection and tests)
    # True for an adapter the rank must not run without: a target it cannot patch, or an error in
    # one of its hooks, stops the process (Refused) instead of leaving the adapter out.
    fail_closed: bool = False


@dataclass
class _Armed:
    spec: AdapterSpec
    on: bool = True
    announced: bool = False
    applied: set[str] = field(default_factory=set)


class PatchError(Exception):
    """A target is missing or no longer looks the way the adapter expects."""


class Refused(SystemExit):
    """Stops the process with a one-line reason on stderr and exit status 1.

    A SystemExit, not an Exception: the `except Exception` blocks around imports and plugin
    loading (ours and SGLang's) must not turn a refusal into "carry on without the adapter"."""

    def __init__(self, message: str) -> None:
        super().__init__(PREFIX + message.replace("\n", " ") + "; the rank does not start")


def refusing(name: str, module: str, reason: str) -> AdapterSpec:
    """A fail_closed adapter that was asked for but cannot run as asked (a setting it cannot use):
    the process stops with `reason` right after `module` is imported, on every rank alike, instead
    of running without the adapter while its peers might not."""

    def refuse(_module: types.ModuleType) -> None:
        raise Refused(f"{name}: {reason}")

    return AdapterSpec(name=name, detail=f"refuses: {reason}", fail_closed=True,
                       patches=(Patch(module, "", ON_IMPORT, refuse),))


def resolve_target(module: types.ModuleType, attr: str) -> tuple[Any, str, Callable[..., Any], Any]:
    """(owner, name, function, raw attribute) for `attr` inside `module`; PatchError if absent."""
    owner: Any = module
    parts = attr.split(".")
    for part in parts[:-1]:
        if not hasattr(owner, part):
            raise PatchError(f"{module.__name__} has no {part!r} (looked for {attr})")
        owner = getattr(owner, part)
    name = parts[-1]
    raw = owner.__dict__.get(name) if isinstance(owner, type) else None
    if raw is None:
        if not hasattr(owner, name):
            raise PatchError(f"{module.__name__} has no {attr}")
        raw = getattr(owner, name)
    func = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    if not callable(func):
        raise PatchError(f"{module.__name__}.{attr} is not callable")
    return owner, name, func, raw


def check_params(func: Callable[..., Any], wanted: Sequence[str], target: str) -> None:
    if not wanted:
        return
    try:
        names = set(inspect.signature(func).parameters)
    except (TypeError, ValueError) as e:
        raise PatchError(f"cannot read the signature of {target}: {e}") from None
    missing = [p for p in wanted if p not in names]
    if missing:
        raise PatchError(
            f"{target} changed: parameters {', '.join(missing)} are gone (it has {', '.join(sorted(names))})"
        )


def wrap(original: Callable[..., Any], kind: str, hook: Callable[..., Any]) -> Callable[..., Any]:
    """A wrapper with HookRegistry's semantics, for SGLang builds without HookRegistry."""
    if kind == BEFORE:

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            changed = hook(*args, **kwargs)
            if changed is not None:
                args, kwargs = changed
            return original(*args, **kwargs)

    elif kind == AFTER:

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            replaced = hook(result, *args, **kwargs)
            return result if replaced is None else replaced

    elif kind == AROUND:

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return hook(original, *args, **kwargs)

    else:
        raise ValueError(f"cannot wrap with kind {kind!r}")
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


class Installer:
    """Applies the armed adapters' patches to modules as they are imported (one per process)."""

    def __init__(
        self,
        specs: Iterable[AdapterSpec],
        log: AdapterLog,
        registry_loader: Callable[[], Any] | None = None,
    ) -> None:
        self._log = log
        self._armed = [_Armed(spec) for spec in specs]
        self._registry_loader = registry_loader if registry_loader is not None else _load_hook_registry
        self._registry: Any = None
        self._registry_probed = False

    @property
    def modules(self) -> frozenset[str]:
        return frozenset(p.module for a in self._armed for p in a.spec.patches)

    def is_on(self, name: str) -> bool:
        return any(a.spec.name == name and a.on for a in self._armed)

    def spec(self, name: str) -> AdapterSpec | None:
        for a in self._armed:
            if a.spec.name == name:
                return a.spec
        return None

    def applied(self, name: str) -> frozenset[str]:
        for a in self._armed:
            if a.spec.name == name:
                return frozenset(a.applied)
        return frozenset()

    def mode(self) -> str:
        return "HookRegistry" if self._hook_registry() is not None else "import hook"

    def on_import(self, module: types.ModuleType) -> None:
        """Patch every watched target in `module`. Never raises, but Refused for a fail_closed adapter."""
        for armed in self._armed:
            for patch in armed.spec.patches:
                if patch.module != module.__name__ or not armed.on or patch.target in armed.applied:
                    continue
                try:
                    self._apply(armed, patch, module)
                except Exception as e:  # noqa: BLE001 - any failure must leave SGLang importable
                    if armed.spec.fail_closed:
                        raise Refused(f"{armed.spec.name} could not patch {patch.target}: {e}") from None
                    armed.on = False
                    self._log.line(
                        f"{armed.spec.name} could not patch {patch.target}: {e}; {armed.spec.name} stays out"
                    )
                    continue
                armed.applied.add(patch.target)
                if not armed.announced:
                    armed.announced = True
                    self._log.installed(armed.spec.name, f"{armed.spec.detail}; via {self.mode()}")

    def _apply(self, armed: _Armed, patch: Patch, module: types.ModuleType) -> None:
        hook = self._guard(armed, patch)
        if patch.kind == ON_IMPORT:
            hook(module)
            return
        owner, name, func, _raw = resolve_target(module, patch.attr)
        if _wrapped_by(func, armed.spec.name):
            return  # armed twice in one process (sitecustomize and the plugin entry point)
        check_params(func, patch.params, patch.target)
        registry = self._hook_registry()
        if registry is not None and not _registry_applied(registry[0], patch.target):
            hook_registry, hook_type = registry
            hook_registry.register(patch.target, hook, getattr(hook_type, patch.kind.upper()))
            hook_registry.apply_hooks()
            _o, _n, new_func, _r = resolve_target(module, patch.attr)
            if new_func is func:
                raise PatchError("SGLang's HookRegistry did not apply the hook (see its log)")
        else:
            raw = owner.__dict__.get(name) if isinstance(owner, type) else None
            new_func = wrap(func, patch.kind, hook)
            if isinstance(raw, staticmethod):
                setattr(owner, name, staticmethod(new_func))
            elif isinstance(raw, classmethod):
                setattr(owner, name, classmethod(new_func))
            else:
                setattr(owner, name, new_func)
        try:
            setattr(new_func, MARK, armed.spec.name)
        except (AttributeError, TypeError):
            pass

    def _guard(self, armed: _Armed, patch: Patch) -> Callable[..., Any]:
        """The hook, passed through while the adapter is off; a runtime failure switches it off."""
        hook, log, name = patch.hook, self._log, armed.spec.name
        if armed.spec.fail_closed:
            return hook  # its errors propagate: an unchecked key or an unredacted log line must not pass

        def fail(e: BaseException) -> None:
            if armed.on:
                armed.on = False
                log.line(f"{name} failed in {patch.target}: {type(e).__name__}: {e}; {name} stays out")

        if patch.kind == AROUND:

            def around(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
                if not armed.on:
                    return original(*args, **kwargs)
                return hook(original, *args, **kwargs)

            return around

        if patch.kind == ON_IMPORT:
            return hook  # errors surface through on_import as "could not patch"

        def guarded(*args: Any, **kwargs: Any) -> Any:
            if not armed.on:
                return None
            try:
                return hook(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - a broken adapter must not kill the scheduler
                fail(e)
                return None

        return guarded

    def _hook_registry(self) -> Any:
        if not self._registry_probed:
            self._registry_probed = True
            self._registry = self._registry_loader()
        return self._registry


def _wrapped_by(func: Any, name: str) -> bool:
    """Whether `func` or a function it wraps (hooks chain through __wrapped__) carries `name`'s mark."""
    for _ in range(32):
        if getattr(func, MARK, None) == name:
            return True
        func = getattr(func, "__wrapped__", None)
        if func is None:
            return False
    return False


def _registry_applied(hook_registry: Any, target: str) -> bool:
    """SGLang's HookRegistry applies each target once (apply_hooks skips the targets it patched): a
    second adapter's hook on a target already applied is chained with our own wrapper instead."""
    return target in getattr(hook_registry, "_patched", ())


def _load_hook_registry() -> Any:
    """(HookRegistry, HookType) from the running SGLang, or None on builds without plugins."""
    try:
        module = __import__(REGISTRY_MODULE, fromlist=["HookRegistry", "HookType"])
        return module.HookRegistry, module.HookType
    except Exception:  # noqa: BLE001 - older images: fall back to our own wrappers
        return None


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, puts it back on the module, then lets the Installer patch."""

    def __init__(self, loader: Any, installer: Installer) -> None:
        self._loader = loader
        self._installer = installer

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        # Code that inspects __loader__ (inspect.getsource, importlib.resources) sees the real one.
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._installer.on_import(module)


class PostImportFinder(importlib.abc.MetaPathFinder):
    """Watches the Installer's target modules; first on sys.meta_path, finds nothing itself."""

    def __init__(self, installer: Installer) -> None:
        self.installer = installer
        self._names = installer.modules

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self._names:
            return None
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, PostImportFinder):
                continue
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is None:
                continue
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _PatchingLoader(spec.loader, self.installer)
            return spec
        return None


def arm(installer: Installer, meta_path: list[Any] | None = None, modules: Mapping[str, Any] | None = None) -> PostImportFinder:
    """Put the finder first on sys.meta_path and patch the watched modules already imported."""
    meta = sys.meta_path if meta_path is None else meta_path
    loaded = sys.modules if modules is None else modules
    finder = PostImportFinder(installer)
    meta.insert(0, finder)
    for name in sorted(installer.modules):
        module = loaded.get(name)
        if isinstance(module, types.ModuleType):
            installer.on_import(module)
    return finder


def armed_finder(meta_path: Iterable[Any] | None = None) -> PostImportFinder | None:
    for finder in sys.meta_path if meta_path is None else meta_path:
        if isinstance(finder, PostImportFinder):
            return finder
    return None
