"""`dsv41ctl share unexport`, carried out: ask every agent, unmount first when told to, then have
the head's agent (which has the last word) remove the export. Runs on the supervisor between
activities, so it never races a bring-up's share step. The decisions are in share.py."""

from __future__ import annotations

from typing import Callable

from dsv41.journal import EventLog
from dsv41.v1 import agent_pb2 as pb

from . import share
from .agents import AgentClient, AgentUnavailable
from .parallel import on_each
from .state import IncidentKind


def ask(clients: dict[str, AgentClient], fn: Callable[[AgentClient], object], nodes: list[str]) -> dict[str, share.Asked]:
    """fn on each node at once; an agent that cannot answer is an Asked with its error."""
    def one(name: str) -> share.Asked:
        try:
            return share.Asked(fn(clients[name]))
        except AgentUnavailable as exc:
            return share.Asked(None, f"{exc.code}: {exc.details}")
    return on_each(one, nodes)


def unexport(clients: dict[str, AgentClient], head: str, log: EventLog, phase: str,
             record_incident: Callable[[str, IncidentKind, str], object], force: bool,
             unmount: bool) -> tuple[bool, str]:
    """(done, what happened or why it was refused)."""
    workers = [name for name in clients if name != head]
    statuses = ask(clients, lambda c: c.status(timeout=10.0), list(clients))
    if statuses[head].answer is None:
        return False, f"cannot reach {head}'s agent ({statuses[head].error}): nothing was changed"
    path = statuses[head].answer.export.path
    running = share.running_ranks(statuses)
    mounted = share.holders(ask(clients, lambda c: c.get_mount(), workers))
    notes = []
    if unmount and mounted and (force or not running):
        for node, _ in mounted:
            try:
                clients[node].remove_mount()
                notes.append(f"unmounted on {node}")
            except AgentUnavailable as exc:
                notes.append(f"not unmounted on {node}: {exc.details}")
        mounted = share.holders(ask(clients, lambda c: c.get_mount(), [node for node, _ in mounted]))
    reason = share.refusal(path, mounted, running, phase)
    held_by = [node for node, _ in mounted]
    if reason and not force and not mounted:
        log.warning("unexport_refused", reason, ranks_running=",".join(n for n, _ in running))
        return False, reason
    try:
        state = clients[head].remove_export(force, held_by)
    except AgentUnavailable as exc:
        if exc.code == "FAILED_PRECONDITION" and not force:
            message = reason or f"refused by {head}'s agent: {exc.details}"
            if notes:
                message += f" ({'; '.join(notes)})"
            log.warning("unexport_refused", message, mounted_by=",".join(held_by),
                        ranks_running=",".join(n for n, _ in running))
            return False, message
        return False, f"{head}: RemoveExport: {exc.code}: {exc.details}"
    path = state.path or path
    removed = share.export_removed(state)
    message = f"unexported {path} on {head}" if removed else f"nothing was exported on {head}"
    if notes:
        message += f" ({'; '.join(notes)})"
    forced = share.forced_note(mounted, running) if force and removed else ""
    if forced:
        message += f" (forced): {forced}"
        record_incident(head, IncidentKind.EXPORT_FORCED, message)
    else:
        log.info("share_unexported", message, path=path)
    return True, message
