"""forward_progress: count every forward step of this rank for its node's agent.

A BEFORE hook on `Scheduler.run_batch` (where SGLang itself counts `forward_ct`) bumps the rank's
counter in /dev/shm (dsv41/progress.py): a store into a shared page, no system call, nothing
that talks to the agent. The agent carries the count in its heartbeat; when a TP group hangs in a
collective, the rank whose counter stopped first is the one that never started the step the
others wait in. Always on in an armed rank (there is nothing to tune), and it stays out rather
than stop the rank: without it the coordinator only loses hang detection on that node.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from adapter.patching import BEFORE, AdapterSpec, Patch
from dsv41 import rankadapters
from dsv41.progress import ProgressWriter

NAME = "forward_progress"
# DSV41_PROGRESS_DIR moves the counter (tests on one machine); a rank's agent reads /dev/shm.
ENV_KEYS = rankadapters.BY_NAME[NAME].keys  # every variable build() reads, declared in dsv41
MODULE = "sglang.srt.managers.scheduler"


class ForwardProgress:
    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._writers: dict[int, ProgressWriter] = {}  # by TP rank: one scheduler per process

    def before_batch(self, scheduler: Any, *_args: Any, **_kwargs: Any) -> None:
        tp_rank = int(getattr(scheduler, "tp_rank", 0) or 0)
        writer = self._writers.get(tp_rank)
        if writer is None or writer.pid != os.getpid():  # a forked process starts its own counter
            writer = self._writers[tp_rank] = ProgressWriter(tp_rank, self.directory)
        writer.step()
        return None

    def count(self, tp_rank: int = 0) -> int:
        writer = self._writers.get(tp_rank)
        return writer.count if writer else 0


def build(env: Mapping[str, str]) -> AdapterSpec:
    directory = rankadapters.DSV41_PROGRESS_DIR.read(env)
    adapter = ForwardProgress(directory)
    return AdapterSpec(name=NAME, state=adapter, detail=f"forward steps counted in {directory}",
                       patches=(Patch(MODULE, "Scheduler.run_batch", BEFORE, adapter.before_batch,
                                      params=("self", "batch")),))
