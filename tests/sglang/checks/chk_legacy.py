"""Older SGLang builds have no HookRegistry: the adapters' own wrappers on the real modules, and a
target that is missing or changed leaves the import intact."""

import io
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit, marked  # noqa: E402

from adapter.boot import build_specs  # noqa: E402
from adapter.patching import AFTER, AdapterSpec, Installer, Patch, arm  # noqa: E402
from dsv41.adapterlog import AdapterLog  # noqa: E402

buf = io.StringIO()
log = AdapterLog(buf)
specs = build_specs({"DSV41_SOURCE": "/m"}, log)
specs.append(AdapterSpec("changed", "d", (Patch("sglang.srt.managers.schedule_batch", "Req.update_finish_state", AFTER, lambda *a: None, params=("self", "accepted_ids")),)))
specs.append(AdapterSpec("missing", "d", (Patch("sglang.srt.managers.schedule_batch", "Req.update_finish_state_v2", AFTER, lambda *a: None),)))
inst = Installer(specs, log, registry_loader=lambda: None)
arm(inst)

from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

params = SamplingParams(max_new_tokens=1000)
params.normalize(None)
req = Req("r", "", [1], params)
finished_at = None
for n in range(1, 200):
    req.output_ids.append(3)
    req.update_finish_state()
    if req.finished():
        finished_at = n
        break
emit(
    {
        "mode": inst.mode(),
        "marked": marked(Req.update_finish_state),
        "has_wrapped": hasattr(Req.update_finish_state, "__wrapped__"),
        "finished_at": finished_at,
        "reason": req.finished_reason.to_json() if req.finished_reason else None,
        "log": buf.getvalue().splitlines(),
    }
)
