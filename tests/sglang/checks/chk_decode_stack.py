"""Every decode adapter at once on SGLang's real modules, with the environment a rank of the example
configuration gets (the pytest side renders it with the coordinator's plan).

argv: nothing (armed by sitecustomize, through SGLang's HookRegistry) or `legacy` (unarmed; the
check arms the adapters itself with the import hook's own wrappers, as on builds without
HookRegistry). Imports the modules the decode adapters patch, in the order a scheduler does, and
reports, for every patched target, the adapters whose hooks it carries (outermost first: hooks
chain through __wrapped__).
"""

import importlib
import os
import sys

os.environ.setdefault("SGLANG_OPT_USE_FUSED_HASH_TOPK", "0")
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit, installer  # noqa: E402

from adapter.patching import MARK, resolve_target  # noqa: E402

MODULES = (
    "sglang.srt.models.deepseek_v2",
    "sglang.srt.layers.moe.hash_topk",
    "sglang.srt.models.deepseek_v4",
    "sglang.srt.models.dspark",
    "sglang.srt.models.deepseek_v4_dspark",
    "sglang.kernels.ops.speculative.dspark.blockwise_rejection",
    "sglang.srt.speculative.dspark_components.dspark_draft",
    "sglang.srt.speculative.dspark_components.dspark_verify",
    "sglang.srt.speculative.dspark_components.dspark_sampling_accept_graph",
)


def chain(func):
    names = []
    for _ in range(32):
        if func is None:
            break
        mark = getattr(func, MARK, None)
        if mark is not None and mark not in names:
            names.append(mark)
        func = getattr(func, "__wrapped__", None)
    return names


def main():
    if sys.argv[1:] == ["legacy"]:
        from adapter.boot import build_specs
        from dsv41.adapterlog import AdapterLog
        from adapter.patching import Installer, arm

        log = AdapterLog(sys.stderr)
        arm(Installer(build_specs(os.environ, log), log, registry_loader=lambda: None))
    for name in MODULES:
        importlib.import_module(name)
    inst = installer()
    decode = ("wo_a_w8", "draft_head_fp8", "verify_cap", "block_verify", "draft_tau", "folded_fence")
    targets, missing = {}, []
    for adapter in decode:
        spec = inst.spec(adapter) if inst else None
        for patch in (spec.patches if spec else ()):
            if patch.target not in inst.applied(adapter):
                missing.append(patch.target)
            if patch.attr:
                _, _, func, _ = resolve_target(sys.modules[patch.module], patch.attr)
                targets[patch.target] = chain(func)
                if adapter not in targets[patch.target]:
                    missing.append(f"{patch.target} without {adapter}'s hook")
    emit({"on": {a: bool(inst and inst.is_on(a)) for a in decode},
          "fail_closed": {a: inst.spec(a).fail_closed for a in decode if inst and inst.spec(a)},
          "not_applied": missing, "targets": targets})


if __name__ == "__main__":
    main()
