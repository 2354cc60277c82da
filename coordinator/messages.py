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
    """A rank unit's state as its node's agent streamed it; with a heartbeat stream also the
    node's boot and its ranks' forward-step counters."""
    node: str
    rank: pb.RankState
    received_at: float = 0.0  # time.monotonic() of the coordinator
    boot_id: str = ""
    progress: tuple = ()  # pb.RankProgress
    heartbeat: bool = False
    fabric_changes: tuple = ()  # pb.FabricChange: the node's fabric changed under it

    @classmethod
    def of(cls, node: str, event: pb.RankEvent, received_at: float) -> "RankObserved":
        return cls(node, event.rank, received_at, event.boot_id, tuple(event.progress), event.heartbeat,
                   tuple(event.fabric_changes))


@dataclass(frozen=True)
class IncidentSeen:
    """An incident another thread found (the GPU watch's gpu_slow): the supervisor records it."""
    node: str
    kind: str  # an IncidentKind value
    message: str


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


@dataclass(frozen=True)
class FabricTestJob:
    """`dsv41ctl fabric test`: the collective gate's job on every node now; reply gets (passed, message)."""
    reply: Future = field(default_factory=Future, compare=False)


Job = UnexportJob | PackStartJob | AutotuneResetJob | FabricTestJob


@dataclass(frozen=True)
class WorkSeen:
    """What rank 0's in-flight list said (busy None: no list, `why`)."""
    busy: bool | None
    at: float  # time.monotonic() of the coordinator
    why: str = ""


@dataclass(frozen=True)
class CanarySent:
    at: float


@dataclass(frozen=True)
class CanaryDone:
    ok: bool
    at: float
