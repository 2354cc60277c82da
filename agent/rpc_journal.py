"""RPCs for the operator's view of a node: its dsv41 journal lines, and clearing the rank's caches."""

from __future__ import annotations

import os

import grpc

from dsv41.autotune_cache import clear_autotune_caches
from dsv41.v1 import agent_pb2 as pb

UNITS = ("dsv41-agent.service", "dsv41-rank.service", "dsv41-pack.service", "dsv41-collective-test.service",
         "dsv41-matmul-check.service", "dsv41-gateway.service")
_PRIORITY_NAMES = ("emerg", "alert", "crit", "err", "warning", "notice", "info", "debug")
MAX_LINES = 10_000


def from_unit(entry: dict, units) -> bool:
    """The entry was written by one of the units, or by systemd about one of them: never a line a
    user sent with UNIT= set. (The reader's matches already say so; this holds on to it.)"""
    if str(entry.get("_SYSTEMD_UNIT", "")) in units:
        return True
    return str(entry.get("UNIT", "")) in units and str(entry.get("_PID", "")) == "1"


def _line(node: str, entry: dict) -> pb.JournalLine:
    when = entry.get("__REALTIME_TIMESTAMP")
    priority = int(entry.get("PRIORITY", 6))
    return pb.JournalLine(at_unix_s=when.timestamp() if when else 0.0, node=node,
                          unit=str(entry.get("_SYSTEMD_UNIT") or entry.get("UNIT") or entry.get("SYSLOG_IDENTIFIER", "")),
                          priority=_PRIORITY_NAMES[min(max(priority, 0), 7)], message=str(entry.get("MESSAGE", "")))


class JournalRpcs:
    """ReadJournal (this node's dsv41 units, this boot) and ClearCaches (the rank's autotune caches)."""

    def __init__(self, settings, rank, events):
        """settings: the node's name and the rank's cache directories; rank: whose status says
        whether it runs (its caches are not cleared under it)."""
        self._settings = settings
        self._rank = rank
        self._events = events

    def ReadJournal(self, request, context):
        units = list(request.units) or list(UNITS)
        if any(u not in UNITS for u in units):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"units: only {', '.join(UNITS)}")
        if request.lines > MAX_LINES:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"lines: at most {MAX_LINES}")
        from systemd import journal  # imported here: only this RPC needs it

        reader = journal.Reader()
        try:
            reader.this_boot()
            for i, unit in enumerate(units):
                if i:
                    reader.add_disjunction()
                # _SYSTEMD_UNIT is journald's own field (from the sender's cgroup); UNIT= is a field
                # any local user may send, so it counts only from systemd itself (PID 1).
                reader.add_match(_SYSTEMD_UNIT=unit)
                reader.add_disjunction()
                reader.add_match(UNIT=unit, _PID="1")
            reader.seek_tail()
            backlog = []
            for _ in range(request.lines or 50):
                entry = reader.get_previous()
                if not entry:
                    break
                backlog.append(entry)
            for entry in reversed(backlog):
                if from_unit(entry, units):
                    yield _line(self._settings.node, entry)
            reader.seek_tail()
            reader.get_previous()
            while request.follow and context.is_active():
                if reader.wait(1_000_000) == journal.APPEND:
                    for entry in reader:
                        if from_unit(entry, units):
                            yield _line(self._settings.node, entry)
        finally:
            reader.close()

    def ClearCaches(self, request, context):
        if request.which != "autotune":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "which: only autotune")
        if self._rank.status().running:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the rank is running: stop it before clearing caches")
        roots = [os.path.join(d, "sglang") for d in (self._settings.rank_cache_dir, self._settings.container_cache_dir)]
        removed = [path for root in roots for path in clear_autotune_caches(root)]
        self._events.info("caches_cleared", f"removed {len(removed)} FlashInfer autotune cache file(s) under "
                          f"{' and '.join(roots)}", removed=len(removed))
        return pb.ClearCachesResponse(removed_files=len(removed))
