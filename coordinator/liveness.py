"""Liveness decisions, as pure functions over what the agents' heartbeats said and when: a node's
lease, a reboot, a hung rank, and who is to blame when ranks exit around a node that went dark.
Times are the coordinator's time.monotonic(), given as arguments; nothing here reads a clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from .policy import RankExit, first_failure
from .state import IncidentKind


@dataclass(frozen=True)
class Heard:
    """A node's last heartbeat, as the supervisor keeps it."""
    at: float  # when it arrived
    boot_id: str
    seq: int
    forward_count: int | None  # the node's rank's forward steps (the lowest, with several); None: no counter
    stopped_at: float | None  # when that rank last stepped, on our clock (arrival minus its age)
    rank_active: bool
    process_stopped: bool = False  # a rank process of the node is stopped (SIGSTOP): it cannot step


def lapsed(last_heard_at: float | None, now: float, lease_s: float, watching_since: float,
           resumed_at: float | None = None) -> bool:
    """Whether a node's lease has lapsed: nothing heard for lease_s (counted from when the watch
    began, for a node not heard from yet; and from when the coordinator ran again after a pause,
    for a node not heard from since: the pause is not the node's silence)."""
    since = watching_since if last_heard_at is None else last_heard_at
    if resumed_at is not None:
        since = max(since, resumed_at)
    return now - since > lease_s


@dataclass(frozen=True)
class Tick:
    """When the supervisor checked leases: on the monotonic clock (leases are counted on it) and on
    the boot-time clock, which also runs while the machine is suspended."""
    monotonic: float
    boottime: float


def pause_threshold_s(lease_s: float) -> float:
    """A gap between two checks longer than this is the coordinator's pause. Checks come every
    TICK_S (0.25 s) when idle and after every message; a lease can lapse for want of a check once
    the gap exceeds a lease less one heartbeat interval (a quarter lease): half a lease catches
    every such gap with room for a late heartbeat, and is far above a tick."""
    return lease_s / 2


def paused_for(last: Tick | None, now: Tick, lease_s: float) -> float | None:
    """The length of the coordinator's pause between two checks (the longer of the two clocks'
    gaps: a suspend shows on the boot-time clock only), or None when the gap is a normal one."""
    if last is None:
        return None
    gap = max(now.monotonic - last.monotonic, now.boottime - last.boottime)
    return gap if gap > pause_threshold_s(lease_s) else None


@dataclass(frozen=True)
class Pause:
    """The coordinator did not check leases from `began_at` until `resumed_at` (monotonic)."""
    began_at: float
    resumed_at: float
    length_s: float
    boots: Mapping[str, str]  # each node's boot ID as known when it ran again


@dataclass(frozen=True)
class AfterPause:
    """The nodes as heard since a pause ended."""
    answered: tuple[str, ...]  # heard from since, in the same boot: kept
    rebooted: tuple[str, ...]  # heard from since, in another boot (recorded as a reboot)
    silent: tuple[str, ...]  # no answer since (nothing, or only what waited in its socket)
    over: bool  # every node answered, or a lease gone by since: the pause can be told


def answer_spacing_s(lease_s: float) -> float:
    """What the agents sent during the pause waits in the sockets and arrives in a burst (within
    milliseconds) as the coordinator runs again; a live agent's next heartbeat comes a quarter
    lease later. A node has answered once it was heard this long after its first arrival since."""
    return lease_s / 8


def after_pause(pause: Pause, heard: Mapping[str, Heard], first_after: Mapping[str, float], nodes: Sequence[str],
                now: float, lease_s: float) -> AfterPause:
    """Only heartbeats that arrived after the pause count (`first_after`: each node's first arrival
    since), and not a burst of what waited in its socket alone: a node answers within a lease of
    the pause, or it is silent (and its lease, counted from the pause's end, lapses as any other).
    Any heartbeat since from another boot is a reboot."""
    since = [n for n in nodes if n in first_after and n in heard]
    new_boot = tuple(n for n in since if rebooted(pause.boots.get(n, ""), heard[n].boot_id))
    answered = tuple(n for n in since if n not in new_boot
                     and heard[n].at - first_after[n] >= answer_spacing_s(lease_s))
    silent = tuple(n for n in nodes if n not in answered and n not in new_boot)
    return AfterPause(answered, new_boot, silent, not silent or now - pause.resumed_at > lease_s)


def stall_counted_from(pending_since: float | None, resumed_at: float | None) -> float | None:
    """Since when a rank's missing steps count against it: from when work was pending, but never
    across the coordinator's pause (a frozen head stops rank 0 and with it every collective; and
    the heartbeats the coordinator reads just after a pause may predate it)."""
    if pending_since is None or resumed_at is None:
        return pending_since
    return max(pending_since, resumed_at)


def rebooted(known_boot_id: str, boot_id: str) -> bool:
    """A heartbeat from another boot of the node than the one known: its ranks are gone."""
    return bool(known_boot_id) and bool(boot_id) and boot_id != known_boot_id


@dataclass(frozen=True)
class Hang:
    node: str  # the rank whose counter stopped first
    forward_count: int
    stalled_s: float  # how long the most stalled rank has not stepped while work was pending
    allowance_s: float


def hung(heard: Mapping[str, Heard], order: Sequence[str], pending_since: float | None, now: float,
         hang_s: float, first_step_s: float, fresh_s: float) -> Hang | None:
    """A hang: while work is pending (requests in flight, or a canary not answered) since
    `pending_since`, some rank has not stepped for its allowance (first_step_s before its first
    forward, hang_s after). Decided only when every node's counter is fresh (heard within
    fresh_s) and every rank runs: a node that does not answer is a lost node, not a hang.

    The rank blamed is one whose process is stopped (seen on real SGLang: with a worker's
    scheduler stopped between steps, every rank's counter stops at the same count), else the one
    whose counter stopped first: the lowest count (it never started the step the others wait in),
    the earliest stop among those; when all counts are equal no rank started the next step, and the
    rank that starts every step is rank 0, first in `order`."""
    if pending_since is None:
        return None
    views = {node: heard.get(node) for node in order}
    for v in views.values():
        if v is None or now - v.at > fresh_s or v.forward_count is None or v.stopped_at is None or not v.rank_active:
            return None
    worst: tuple[float, float] | None = None
    for v in views.values():
        allowance = first_step_s if v.forward_count == 0 else hang_s
        quiet = now - max(v.stopped_at, pending_since)
        if quiet > allowance and (worst is None or quiet > worst[0]):
            worst = (quiet, allowance)
    if worst is None:
        return None
    lowest = min(v.forward_count for v in views.values())
    behind = [n for n in order if views[n].forward_count == lowest]
    stopped = [n for n in order if views[n].process_stopped]
    first = stopped[0] if stopped else order[0] if len(behind) == len(order) else \
        min(behind, key=lambda n: (views[n].stopped_at, order.index(n)))
    return Hang(first, views[first].forward_count, worst[0], worst[1])


def unaccounted(nodes: Sequence[str], exits: Mapping[str, RankExit], heard: Mapping[str, Heard],
                since: float) -> list[str]:
    """Nodes that have neither reported their rank's exit nor been heard from since `since` (when
    the first exit was learned): until they do, blame cannot be decided."""
    return [n for n in nodes if n not in exits and (n not in heard or heard[n].at <= since)]


@dataclass(frozen=True)
class Cause:
    node: str
    kind: IncidentKind  # NODE_LOST, RANK_EXIT, or MEMORY_FLOOR (a rank exit its node's floor caused)
    message: str


def blame(exits: Sequence[RankExit], lost: Mapping[str, float], now: float) -> Cause:
    """The first cause: a node that went dark (lost: node -> when last heard) ranks before the rank
    exits that followed it; among exits alone, policy.first_failure decides."""
    if lost:
        order = sorted(lost, key=lambda n: lost[n])
        node = order[0]
        message = f"{node} lost: not heard from for {now - lost[node]:.1f} s"
        if order[1:]:
            message += "; also lost: " + ", ".join(order[1:])
        if exits:
            ordered = sorted(exits, key=lambda e: e.at_unix_s)
            message += "; then rank exits on " + ", ".join(f"{e.node} ({e.outcome()})" for e in ordered)
        return Cause(node, IncidentKind.NODE_LOST, message)
    found = first_failure(exits)
    return Cause(found.node, IncidentKind.MEMORY_FLOOR if found.floor else IncidentKind.RANK_EXIT, found.message)
