"""Fabric drift while the ranks run: what to do when an agent reports its fabric changed.

NCCL does not reconnect when a node's RoCE GID index, MTU, link or address changes under a running
group (a `netplan apply` by another tool, a NIC firmware reboot); the engine dies later with an error
that points elsewhere. So a change while the ranks run is an incident naming the node and the change,
then a restart that can wait (drained): its bring-up checks the fabric again (a fabric still wrong
fails there) and resolves the plans' GID placeholders anew.

One `netplan apply` is a link flap and an address re-added, reported as several batches within a
second or two: the changes are gathered until none came for FABRIC_SETTLE_S (at most four times that
after the first, so that a flapping link is not waited on for ever), and are then one incident.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from dsv41.fabricchange import FabricChange as Change

MAX_SETTLES = 4


def changes_of(wire: Iterable) -> tuple[Change, ...]:
    """Changes of pb.FabricChange messages."""
    return tuple(Change(c.netdev, c.what, c.before, c.after) for c in wire)


def describe(node: str, found: Iterable[Change], restarting: bool = True) -> str:
    then = ("restarting the group after a drain (its fabric step checks again)" if restarting
            else "the group's next bring-up checks it")
    return (f"{node}: the fabric changed under the running rank: " + "; ".join(c.describe() for c in found)
            + f": NCCL does not reconnect; {then}")


class Reaction(enum.Enum):
    RESTART = "restart"    # an incident per node, then a drained restart
    RECORD = "record"      # an incident per node only: a stop, restart or bring-up came since


def reaction(ranks_run: bool, recovery_due: bool) -> Reaction:
    """For changes reported while the ranks ran, once they settle. ranks_run: the group still serves,
    or a bring-up's ranks still run; recovery_due: a request waits, or a fault found while serving is
    about to be recovered from (that restarts or stops the group too). A change is not forgotten when
    the group went down meanwhile (its engine may have died of it): it is recorded, not acted on."""
    return Reaction.RESTART if ranks_run and not recovery_due else Reaction.RECORD


@dataclass(frozen=True)
class Pending:
    first_at: float
    last_at: float
    changes: dict[str, tuple[Change, ...]]  # node -> what changed there, in the order reported


def gather(pending: Pending | None, node: str, found: tuple[Change, ...], now: float) -> Pending:
    if pending is None:
        return Pending(now, now, {node: found})
    merged = dict(pending.changes)
    merged[node] = merged.get(node, ()) + found
    return Pending(pending.first_at, now, merged)


def settled(pending: Pending | None, now: float, settle_s: float) -> bool:
    return pending is not None and (now - pending.last_at >= settle_s
                                    or now - pending.first_at >= MAX_SETTLES * settle_s)


class FabricDrift:
    """The changes reported so far, gathered until they settle (supervisor thread only)."""

    def __init__(self, settle_s: float, monotonic: Callable[[], float] = time.monotonic):
        self._settle_s = settle_s
        self._monotonic = monotonic
        self._pending: Pending | None = None

    def note(self, node: str, wire_changes: Iterable) -> None:
        found = changes_of(wire_changes)
        if found:
            self._pending = gather(self._pending, node, found, self._monotonic())

    def take_all(self) -> dict[str, tuple[Change, ...]]:
        """node -> its changes so far, settled or not (then forgotten)."""
        pending, self._pending = self._pending, None
        return pending.changes if pending is not None else {}

    def take_settled(self) -> dict[str, tuple[Change, ...]]:
        """node -> its changes, once they have settled (then forgotten); empty before."""
        if not settled(self._pending, self._monotonic(), self._settle_s):
            return {}
        pending, self._pending = self._pending, None
        return pending.changes
