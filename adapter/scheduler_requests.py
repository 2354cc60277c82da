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

A waiting request is listed with its prefix-cache match as prefilled and cached. SGLang's default
--schedule-policy fcfs matches a request against the radix tree only when it builds the request's
first step (Req.init_next_round_input), so without this a waiting hit looks like a cold prompt
and the guard charges it a cold prompt's KV. Each waiting request is matched once, when first
listed, by the tree's own match_prefix over the key SGLang builds for it (what SGLang itself does
to every waiting request each step under a cache-aware policy such as lpm: the walk may split a
node at the match's end and refreshes the path's access times, nothing else); the request is
left as it was. A prefix the tree evicts before the request starts makes that charge low by its
KV. When the match cannot be made (a tree without match_prefix, a SGLang without the key builder)
the request is listed as unmatched and the adapter says so once on stderr.
"""

from __future__ import annotations

import os
import sys
from array import array
from collections.abc import Callable, Iterable
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


def kv_in_use(scheduler: Any) -> int | None:
    """The KV pool's token slots held now (SGLang's allocator: its size less what is free), or
    None when the scheduler has no such allocator."""
    pool = getattr(scheduler, "token_to_kv_pool_allocator", None)
    try:
        return int(pool.size) - int(pool.available_size())
    except (AttributeError, TypeError, ValueError):
        return None


def snapshot_records(batch: Any, chunked: Any, running: Iterable[Any], waiting: Iterable[Any],
                     matched: Callable[[Any], int] = lambda req: 0) -> list[Record]:
    """The requests in flight, the batch about to run first, then the chunked request, the
    decoding ones, the waiting queue in its order (each with `matched(req)` of its prompt in the
    prefix cache, listed as prefilled and cached); finished ones left out."""
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
            hit = min(max(0, int(matched(req))), max(0, _prompt(req) - 1))  # its last token is computed
            add(Record(str(req.rid), "waiting", _prompt(req), hit, hit, 0, len(getattr(req, "output_ids", None) or ())))
    return out


def prefix_match(tree_cache: Any, req: Any) -> int:
    """The tokens of `req`'s prompt the tree has cached, by SGLang's own match (its key builder and
    the tree's match_prefix, as sglang.srt.mem_cache.common.match_kv_cache does), the request's
    fields untouched. Raises what SGLang raises (the caller stops matching)."""
    tokens = getattr(req, "origin_input_ids", None)
    if tree_cache is None or getattr(tree_cache, "disable", False) or tokens is None or len(tokens) < 2:
        return 0
    from sglang.srt.environ import envs
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.common import _req_radix_key

    if envs.SGLANG_RADIX_FORCE_MISS.get():
        return 0
    if not isinstance(tokens, array):
        tokens = array("q", tokens)  # the radix key's type, as SGLang's own fill ids are
    key = _req_radix_key(tree_cache, req, tokens, len(tokens) - 1)
    return int(tree_cache.match_prefix(MatchPrefixParams(key=key, req=req)).device_prefix_len)


class WaitingMatches:
    """Each waiting request's prefix-cache match, made once per request (by object: a retry under
    the same rid is matched anew) and forgotten once it leaves the queue."""

    def __init__(self, match: Callable[[Any, Any], int] = prefix_match) -> None:
        self._match = match
        self._known: dict[int, tuple[Any, int]] = {}
        self.failed = ""  # why matching stopped ("" while it works)

    def refresh(self, tree_cache: Any, waiting: Iterable[Any]) -> Callable[[Any], int]:
        known, self._known = self._known, {}
        for req in waiting:
            entry = known.get(id(req))
            if entry is None or entry[0] is not req:
                hit = 0
                if not self.failed:
                    try:
                        hit = self._match(tree_cache, req)
                    except Exception as exc:  # noqa: BLE001 - the listing goes on, unmatched
                        self.failed = f"{type(exc).__name__}: {exc}"
                        print(f"dsv41-adapter: inflight lists waiting requests unmatched from now on: the "
                              f"prefix-cache match failed: {self.failed}", file=sys.stderr, flush=True)
                entry = (req, hit)
            self._known[id(req)] = entry
        return lambda req: self._known.get(id(req), (None, 0))[1]


class SchedulerRequests:
    """The hook's state: one writer per scheduler process (made in the scheduler, not in the
    process that imported the adapter first)."""

    def __init__(self, directory: str, matches: WaitingMatches | None = None) -> None:
        self.directory = directory
        self._writer: RequestsWriter | None = None
        self._matches = matches or WaitingMatches()
        self.snapshots = 0

    def after_next_batch(self, plan: Any, scheduler: Any, *_args: Any, **_kwargs: Any) -> None:
        writer = self._writer
        if writer is None or writer.pid != os.getpid():
            writer = self._writer = RequestsWriter(int(getattr(scheduler, "tp_rank", 0) or 0), self.directory)
        running = getattr(getattr(plan, "running_batch", None), "reqs", None) or ()
        waiting = list(getattr(scheduler, "waiting_queue", None) or ())
        matched = self._matches.refresh(getattr(scheduler, "tree_cache", None), waiting)
        writer.write(snapshot_records(getattr(plan, "batch_to_run", None), getattr(scheduler, "chunked_req", None),
                                      running, waiting, matched), kv_in_use(scheduler))
        self.snapshots += 1
        return None

    def after_run_batch(self, _result: Any, scheduler: Any, *_args: Any, **_kwargs: Any) -> None:
        """The batch the snapshot lists is launched (under overlap scheduling run_batch returns
        once it is enqueued): its allocations are made, and a memory sample from now on has them."""
        writer = self._writer
        if writer is not None and writer.pid == os.getpid():
            writer.mark_launched()
        return None
