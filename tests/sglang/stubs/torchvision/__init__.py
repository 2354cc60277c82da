"""Test-only stand-in for torchvision in the CPU venv of the sglang tier.

SGLang's config package imports its vision-model helpers, which import torchvision at module
level. PyPI has no CPU build of torchvision that matches the venv's CPU torch (the CUDA wheel's
extension cannot load), and none of the adapters touch vision code, so these tests put this
package first on PYTHONPATH: every attribute and submodule is an inert placeholder.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+dsv41-test-stub"


class _Placeholder:
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Placeholder()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()

    def __mro_entries__(self, bases):
        return (object,)


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Module(spec.name)

    def exec_module(self, module):
        module.__path__ = []


sys.meta_path.append(_Finder())


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder()
