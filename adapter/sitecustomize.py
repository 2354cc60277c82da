"""Start-up hook of the SGLang rank (installed at the top of the rank's PYTHONPATH entry).

Python imports the first `sitecustomize` on sys.path at start-up, in every process, including
SGLang's spawned schedulers and detokenizer (they inherit PYTHONPATH). When DSV41_SOURCE is set
(the coordinator sets it for ranks), this arms the adapters (adapter/boot.py); otherwise it does
nothing of its own. Either way it then runs the sitecustomize it shadows further down sys.path,
if there is one (container images ship their own), so putting this directory on PYTHONPATH
changes nothing else. Nothing here may stop the interpreter from starting.
"""

import os
import sys


def _arm() -> None:
    if not os.environ.get("DSV41_SOURCE", "").strip():
        return
    try:
        from adapter.boot import arm_process

        arm_process()
    except Exception as e:  # noqa: BLE001 - a broken adapter must not stop SGLang from starting
        try:
            sys.stderr.write(f"dsv41-adapter: not armed: {type(e).__name__}: {e}\n")
        except (OSError, ValueError):
            pass


def _run_shadowed() -> None:
    import importlib.machinery
    import importlib.util

    # abspath, not realpath: the file may be a symlink placed in the PYTHONPATH entry.
    here = os.path.dirname(os.path.abspath(__file__))
    entries = list(sys.path)
    try:
        start = next(i for i, e in enumerate(entries) if os.path.abspath(e or os.getcwd()) == here) + 1
    except (StopIteration, OSError, ValueError):
        return
    # Only entries after ours: Python would have picked one before ours instead of us, and a
    # second copy of this file further down then chains on, never back.
    for entry in entries[start:]:
        try:
            spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry])
        except (OSError, ValueError, ImportError):
            continue
        if spec is None or spec.loader is None or spec.origin is None:
            continue
        if os.path.realpath(spec.origin) == os.path.realpath(__file__):
            continue
        try:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - same rule as Python's own site.py
            try:
                sys.stderr.write(f"Error in sitecustomize ({spec.origin}); {type(e).__name__}: {e}\n")
            except (OSError, ValueError):
                pass
        return


_arm()
_run_shadowed()
