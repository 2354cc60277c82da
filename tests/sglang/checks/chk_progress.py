"""forward_progress on the real Scheduler.run_batch: every call counts one forward step of that
TP rank in its progress file, before SGLang's own body runs (as its forward_ct does)."""

import os
import sys
import tempfile
from types import SimpleNamespace

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import Anything, emit, installer, marks  # noqa: E402

from dsv41 import progress  # noqa: E402
from sglang.srt.managers.scheduler import Scheduler  # noqa: E402


directory = os.environ.get("DSV41_PROGRESS_DIR") or tempfile.mkdtemp()
scheduler = Anything(tp_rank=2)
errors = []
for _ in range(3):
    try:
        Scheduler.run_batch(scheduler, SimpleNamespace(forward_mode=Anything(), reqs=[]))
    except Exception as exc:  # noqa: BLE001 - SGLang's body on a stand-in scheduler may fail after the hook
        errors.append(type(exc).__name__)
inst = installer()
found = progress.read_all(directory, allowed_uids=(os.getuid(),))
emit({
    "marked": marks(Scheduler.run_batch),
    "installed": bool(inst and inst.applied("forward_progress")),
    "counts": {p.tp_rank: p.count for p in found},
    "pids": sorted({p.pid == os.getpid() for p in found}),
})
