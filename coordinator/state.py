"""What the coordinator tells about the cluster: the snapshot readers see and the incidents.

Only the supervisor thread makes new ones; everyone else reads them (they are frozen).
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field


class Phase(enum.StrEnum):
    """The cluster's phase as status, metrics and the journal show it; the value is what they
    write (a StrEnum formats, compares and serialises as its value)."""
    STARTING = "starting"  # the coordinator's start, until its supervisor has looked for ranks to adopt
    STOPPED = "stopped"
    # the bring-up steps, one each (coordinator/bringup declares them, in this order)
    PREFLIGHT = "preflight"
    SHARE = "share"
    FABRIC = "fabric"
    COLLECTIVE = "collective"
    PACK = "pack"
    LAUNCH = "launch"
    HEALTH = "health"
    SMOKE = "smoke"
    SERVING = "serving"
    DRAINING = "draining"  # before a restart that can wait: rank 0 refuses new requests, those in flight finish
    STOPPING = "stopping"
    RESTARTING = "restarting"  # a restart's backoff
    WAITING = "waiting"  # for a node that cannot be reached
    FAILED = "failed"
    UNKNOWN = "unknown"  # dsv41ctl's, when the coordinator is not running


STARTING = Phase.STARTING


class Ranks(enum.Enum):
    """What the ranks do in a phase; the memory guard watches every phase in which they run."""
    NONE = "none"  # no rank runs (yet)
    # ranks load, compile and warm up (and answer the smoke test): the guard stops what it cannot abort
    STARTING = "starting"
    SERVING = "serving"  # ranks serve requests: the guard aborts the one that would exhaust memory


class IncidentKind(enum.StrEnum):
    """What an incident is: the kind status, metrics' `kind` label, the incident hook
    (DSV41_INCIDENT_KIND) and the event stream carry."""
    RANK_EXIT = "rank_exit"
    MEMORY_FLOOR = "memory_floor"  # a rank exit its node's memory floor caused
    NODE_LOST = "node_lost"
    NODE_REBOOTED = "node_rebooted"
    RANK_HUNG = "rank_hung"
    STOPPED = "stopped"  # an operator's or the guard's stop
    EXPORT_FORCED = "export_forced"  # `dsv41ctl share unexport --force`
    ROLLED_BACK = "rolled_back"  # a configuration change failed to serve: the one before it runs again
    FABRIC_CHANGED = "fabric_changed"  # a node's fabric changed under its running rank (coordinator/fabricdrift.py)
    GPU_SLOW = "gpu_slow"  # a GPU slow or hot for longer than GPU_SLOW_S (coordinator/gpuwatch.py)
    # a bring-up step that failed: "<step>_failed" (step_failed)
    PREFLIGHT_FAILED = "preflight_failed"
    SHARE_FAILED = "share_failed"
    FABRIC_FAILED = "fabric_failed"
    COLLECTIVE_FAILED = "collective_failed"
    PACK_FAILED = "pack_failed"
    LAUNCH_FAILED = "launch_failed"
    HEALTH_FAILED = "health_failed"
    SMOKE_FAILED = "smoke_failed"


def step_failed(step: Phase) -> IncidentKind:
    """The incident of a failed bring-up step; a step without one fails loudly here."""
    return IncidentKind(f"{step}_failed")


@dataclass(frozen=True)
class Incident:
    at_unix_s: float
    node: str
    kind: IncidentKind
    message: str


@dataclass(frozen=True)
class Snapshot:
    phase: Phase = Phase.STOPPED
    detail: str = ""
    since: float = 0.0
    serving_since: float = 0.0
    ranks_since: float = 0.0  # when this run of the ranks began (the launch, or a re-adoption); 0: none runs
    restart_attempt: int = 0
    generation: str = ""
    last_incident: Incident | None = None
    fabric: dict = field(default_factory=dict)  # node -> FabricReport
    collective: object = None  # the collective gate's last CollectiveTestReport (bring-up or `fabric test`)
    fingerprints: dict = field(default_factory=dict)  # node -> plan fingerprint
    ranks: dict = field(default_factory=dict)  # node -> last RankState seen


def generation_of(plans) -> str:
    return hashlib.sha256(",".join(p.fingerprint for p in plans).encode()).hexdigest()[:12]
