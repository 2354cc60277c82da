"""What rank 0's scheduler knows of each request, published for GET /dsv41/inflight.

An AFTER hook on `Scheduler.get_next_batch_to_run`, which every iteration of SGLang's event loop
calls right after it has taken in new requests and aborts: the waiting queue, the request being
chunk-prefilled (`chunked_req`), the decoding batch and the batch about to be launched are all
settled there. The snapshot goes to adapter/reqstate.py's shared file: built from a few
attributes per request, written with one copy, no lock (a few microseconds per iteration for a
handful of requests).

A request in the batch about to run prefills [prefix_len, extend_end) of its prompt: prefix_len
tokens are in its KV already (earlier chunks, or the prefix cache's `cached_tokens`), the rest is
the chunk now launched. The chunked request outside that batch (a decode step ran instead) keeps
its progress with no chunk running. An AFTER hook on `Scheduler.run_batch` marks the snapshot's
step launched, with the time: the guard knows from it whether a memory sample has that step's
buffers in it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from adapter.reqstate import Record, RequestsWriter


def _prompt(req: Any) -> int:
    return len(getattr(req, "origin_input_ids", None) or ())


def _finished(req: Any) -> bool:
    finished = getattr(req, "finished", None)
    return bool(finished()) if callable(finished) else False


def _record(req: Any, state: str, prefilled: int, chunk: int = 0) -> Record:
    return Record(str(req.rid), state, _prompt(req), prefilled, int(getattr(req, "cached_tokens", 0) or 0), chunk,
                  len(getattr(req, "output_ids", None) or ()))


def snapshot_records(batch: Any, chunked: Any, running: Iterable[Any], waiting: Iterable[Any]) -> list[Record]:
    """The requests in flight, the batch about to run first, then the chunked request, the
    decoding ones, the waiting queue in its order; finished ones left out."""
    out: list[Record] = []
    seen: set[str] = set()

    def add(record: Record) -> None:
        if record.rid not in seen:
            seen.add(record.rid)
            out.append(record)

    mode = getattr(batch, "forward_mode", None)
    if batch is not None and mode is not None and mode.is_extend():
        for req in getattr(batch, "reqs", None) or ():
            start, end = int(getattr(req, "prefix_len", 0) or 0), getattr(req, "extend_end", None)
            end = start if end is None else int(end)
            if _finished(req):
                continue
            if start >= _prompt(req):  # a decoding request in a mixed batch
                add(_record(req, "decoding", _prompt(req)))
            else:
                add(_record(req, "prefilling", start, max(0, end - start)))
    if chunked is not None and not _finished(chunked):
        add(_record(chunked, "prefilling", int(getattr(chunked, "prefix_len", 0) or 0)))
    for req in running:
        if not _finished(req):
            add(_record(req, "decoding", _prompt(req)))
    for req in waiting:
        if not _finished(req):
            add(_record(req, "waiting", 0))
    return out


class SchedulerRequests:
    """The hook's state: one writer per scheduler process (made in the scheduler, not in the
    process that imported the adapter first)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._writer: RequestsWriter | None = None
        self.snapshots = 0

    def after_next_batch(self, plan: Any, scheduler: Any, *_args: Any, **_kwargs: Any) -> None:
        writer = self._writer
        if writer is None or writer.pid != os.getpid():
            writer = self._writer = RequestsWriter(int(getattr(scheduler, "tp_rank", 0) or 0), self.directory)
        running = getattr(getattr(plan, "running_batch", None), "reqs", None) or ()
        writer.write(snapshot_records(getattr(plan, "batch_to_run", None), getattr(scheduler, "chunked_req", None),
                                      running, getattr(scheduler, "waiting_queue", None) or ()))
        self.snapshots += 1
        return None

    def after_run_batch(self, _result: Any, scheduler: Any, *_args: Any, **_kwargs: Any) -> None:
        """The batch the snapshot lists is launched (under overlap scheduling run_batch returns
        once it is enqueued): its allocations are made, and a memory sample from now on has them."""
        writer = self._writer
        if writer is not None and writer.pid == os.getpid():
            writer.mark_launched()
        return None
