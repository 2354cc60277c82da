"""The adapter through SGLang's plugin entry points alone (no sitecustomize on the path)."""

import sys
from importlib.metadata import entry_points

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit, installer, marked  # noqa: E402

found = sorted(f"{ep.name}={ep.value}" for ep in entry_points(group="sglang.srt.plugins"))
before = installer() is not None
from sglang.srt.plugins import load_plugins  # noqa: E402

load_plugins()
from sglang.srt.managers.schedule_batch import Req  # noqa: E402

inst = installer()
emit(
    {
        "entry_points": found,
        "armed_before_load_plugins": before,
        "armed": inst is not None,
        "mode": inst.mode() if inst else None,
        "marked": marked(Req.update_finish_state),
    }
)
