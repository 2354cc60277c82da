"""CPU-rehearsal shim for torchvision, installed only into the real-engine environment
(tools/sglang-venv.sh); not torchvision.

SGLang 0.5.23 imports torchvision.transforms at module level through its config package
(srt/configs/__init__.py -> nano_nemotron_vl.py -> multimodal/internvl_utils.py) and transformers'
image utilities, so the server does not start without it. PyPI's torchvision 0.28 is a CUDA build
whose extension cannot load beside the CPU torch 2.13 wheel (`operator torchvision::nms does not
exist`), and the CUDA torch that would carry it is several GB. Only vision models use it. So every
name here resolves (classes, enums, submodules: what module-level code touches) and any call raises,
naming this shim: a dense text model never calls it, and one that does fails loudly.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+dsv41.cpu.shim"


class ShimNotImplemented(NotImplementedError):
    pass


class _Name:
    """A torchvision name: readable, subclassable, never callable."""

    def __init__(self, path: str) -> None:
        self._path = path

    def __getattr__(self, name: str) -> "_Name":
        if name.startswith("__"):
            raise AttributeError(name)
        return _Name(f"{self._path}.{name}")

    def __call__(self, *args, **kwargs):
        raise ShimNotImplemented(f"{self._path}: torchvision is a shim in this CPU engine environment "
                                 "(tools/engine/shims/torchvision); vision models are not supported here")

    def __mro_entries__(self, bases):
        return (object,)

    def __repr__(self) -> str:
        return f"<torchvision shim {self._path}>"


class _Module(types.ModuleType):
    def __getattr__(self, name: str) -> _Name:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Name(f"{self.__name__}.{name}")


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


def __getattr__(name: str) -> _Name:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Name(f"{__name__}.{name}")
