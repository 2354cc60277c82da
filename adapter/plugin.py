"""SGLang plugin entry point (group `sglang.srt.plugins`, name `dsv41`).

SGLang >= 0.5.2x calls every general plugin early in each of its processes (load_plugins). This
arms the adapters exactly as sitecustomize.py does, for processes started without it; the hooks
themselves go through SGLang's HookRegistry (see patching.py). The entry point is declared by
dsv41_adapter.dist-info/entry_points.txt, which must sit at the top of the rank's PYTHONPATH
entry, beside sitecustomize.py and the adapter/ package.
"""

from __future__ import annotations


def load() -> None:
    from adapter.boot import arm_process

    arm_process()
