"""`dsv41ctl share unexport`: who pins the head's export, and whether unexporting is allowed now.

Pure functions over what the agents answered; the runtime asks them (GetStatus on every node,
GetMount on every worker) and the head's agent has the last word (RemoveExport refuses while
`mounted_by` is not empty, unless forced). Unexporting under a mounted worker once wedged that
worker until a power cycle, so when in doubt a worker counts as mounting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from dsv41.v1 import agent_pb2 as pb

from .bringup import PHASES
from .state import Phase

# A mount in these states holds the export: mounting may complete any moment, wrong content is
# still mounted, and a stale mount is the one an unexport wedges for good.
PINNING = {pb.MountState.MOUNTING: "mounting", pb.MountState.HEALTHY: "healthy",
           pb.MountState.WRONG_CONTENT: "mounted, wrong content", pb.MountState.STALE: "stale"}
# Nothing of dsv41's is mounted: never requested or unmounted, or the mount unit failed.
NOT_MOUNTED = (pb.MountState.ABSENT, pb.MountState.FAILED)
RANK_RUNNING = ("active", "activating", "deactivating", "reloading")
# The cluster is starting (the coordinator's own start, a bring-up step, a restart's backoff, waiting for a node) or stopping:
# unexporting is refused unless forced.
BUSY_PHASES = (Phase.STARTING, *PHASES, Phase.RESTARTING, Phase.STOPPING, Phase.WAITING)


@dataclass(frozen=True)
class Asked:
    """One agent's answer, or why there is none."""
    answer: object | None = None   # pb.MountState (workers' mounts) or pb.NodeStatus
    error: str = ""


def export_removed(state: pb.ExportState) -> bool:
    """Whether RemoveExport took an export down (False: there was none)."""
    if state.outcome != pb.ExportState.OUTCOME_UNSPECIFIED:
        return state.outcome != pb.ExportState.WAS_NOT_EXPORTED
    return bool(state.path)  # an agent older than the outcome names the path only of what it removed


def holders(mounts: Mapping[str, Asked]) -> list[tuple[str, str]]:
    """(worker, why) for every worker that has the export mounted, or may have: an agent that
    cannot be asked, or a state it does not report, counts, since nothing says it is not mounted."""
    out = []
    for node, asked in mounts.items():
        state = asked.answer
        if state is None:
            out.append((node, f"agent unreachable: {asked.error or 'no answer'}"))
        elif state.state in PINNING:
            out.append((node, PINNING[state.state]))
        elif state.state not in NOT_MOUNTED:
            out.append((node, f"mount state {pb.MountState.State.Name(state.state).lower()}"))
    return sorted(out)


def running_ranks(statuses: Mapping[str, Asked]) -> list[tuple[str, str]]:
    """(node, why) for every node whose rank runs, or may (its agent cannot be asked)."""
    out = []
    for node, asked in statuses.items():
        if asked.answer is None:
            out.append((node, f"agent unreachable: {asked.error or 'no answer'}"))
        elif asked.answer.rank.active_state in RANK_RUNNING:
            out.append((node, f"rank {asked.answer.rank.active_state}"))
    return sorted(out)


def _named(items: list[tuple[str, str]]) -> str:
    return ", ".join(f"{node} ({why})" for node, why in items)


def refusal(path: str, mounted: list[tuple[str, str]], running: list[tuple[str, str]], phase: str = "") -> str:
    """Why unexporting now is refused, and what to do instead; "" when nothing stands in the way."""
    what = f"the export of {path}" if path else "the export"
    reasons = []
    if mounted:
        reasons.append(f"{what} is mounted by {_named(mounted)}")
    if running:
        reasons.append(f"ranks run on {_named(running)}")
    elif phase in BUSY_PHASES:
        reasons.append(f"the cluster is {'stopping' if phase == 'stopping' else 'starting'} (phase {phase})")
    if not reasons:
        return ""
    text = "refused: " + "; ".join(reasons) + ". "
    if mounted:
        text += "Unexporting under a mounted worker can wedge it until it is power-cycled. "
    unmount = "run `dsv41ctl share unexport --unmount`: it unmounts the export on the workers, then unexports"
    if running or phase in BUSY_PHASES:
        text += "Stop the cluster first (dsv41ctl stop --wait 120)" + (f", then {unmount}. " if mounted else ". ")
    elif mounted:
        text += unmount[0].upper() + unmount[1:] + ". "
    text += "Or add --force to unexport anyway" + (", leaving " + ", ".join(n for n, _ in mounted) +
                                                   " with stale mounts" if mounted else "") + "."
    return text


def forced_note(mounted: list[tuple[str, str]], running: list[tuple[str, str]]) -> str:
    """What a forced unexport left behind, for the operator and the incident log ("" when nothing)."""
    if not mounted:
        return ""
    text = f"the mounts on {', '.join(n for n, _ in mounted)} are stale now"
    if running:
        text += " (a running rank that reads its weights from one fails)"
    return text + "; the next bring-up (start after stop, or restart) exports and mounts again"
