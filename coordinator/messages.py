"""What other threads hand the supervisor: events they observed and jobs they want done.

Rank watchers, the control socket and the memory guard never change the cluster's state or drive
an agent themselves; they put one of these on the supervisor's inbox (operator requests go
through the request slot, see policy.Request) and, for a job, wait on its Future.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from dsv41.v1 import agent_pb2 as pb


@dataclass(frozen=True)
class RankObserved:
    """A rank unit's state as its node's agent streamed it."""
    node: str
    rank: pb.RankState


@dataclass(frozen=True)
class WatchLost:
    """A node's rank stream broke (the watcher re-subscribes by itself)."""
    node: str
    why: str


@dataclass(frozen=True)
class Wake:
    """Nothing but a nudge: an operator request is waiting in the slot."""


@dataclass(frozen=True)
class UnexportJob:
    """`dsv41ctl share unexport`: reply gets (done, message)."""
    force: bool
    unmount: bool
    reply: Future = field(default_factory=Future, compare=False)


@dataclass(frozen=True)
class PackStartJob:
    """`dsv41ctl pack --start`: start the pack job on every node whose shards are incomplete;
    reply gets the nodes it was started on."""
    reply: Future = field(default_factory=Future, compare=False)


@dataclass(frozen=True)
class AutotuneResetJob:
    """`dsv41ctl autotune reset`: reply gets (done, message)."""
    reply: Future = field(default_factory=Future, compare=False)


Job = UnexportJob | PackStartJob | AutotuneResetJob
