"""What the coordinator tells about the cluster: the snapshot readers see and the incidents.

Only the supervisor thread makes new ones; everyone else reads them (they are frozen).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


# The phase from the coordinator's start until its supervisor has looked for ranks to adopt.
STARTING = "starting"


@dataclass(frozen=True)
class Incident:
    at_unix_s: float
    node: str
    kind: str
    message: str


@dataclass(frozen=True)
class Snapshot:
    phase: str = "stopped"
    detail: str = ""
    since: float = 0.0
    serving_since: float = 0.0
    ranks_since: float = 0.0  # when this run of the ranks began (the launch, or a re-adoption); 0: none runs
    restart_attempt: int = 0
    generation: str = ""
    last_incident: Incident | None = None
    fabric: dict = field(default_factory=dict)  # node -> FabricReport
    fingerprints: dict = field(default_factory=dict)  # node -> plan fingerprint
    ranks: dict = field(default_factory=dict)  # node -> last RankState seen


def generation_of(plans) -> str:
    return hashlib.sha256(",".join(p.fingerprint for p in plans).encode()).hexdigest()[:12]
