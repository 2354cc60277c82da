"""The supervisor's decisions, as pure functions over plain values: which operator request wins,
what it interrupts, when a rank has exited (once), who is to blame, whether and when to restart,
and whether memory is back. No I/O and no clock of their own: times come in as arguments.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from dsv41.v1 import agent_pb2 as pb

STABLE_SERVING_S = 600.0  # serving this long resets the restart attempt counter
BLAME_WINDOW_S = 0.05  # exits this close together cannot be ordered across nodes' clocks


# ----------------------------------------------------------------------------- operator requests

class Action(str, enum.Enum):
    START = "start"
    STOP = "stop"
    RESTART = "restart"
    SHUTDOWN = "shutdown"  # the coordinator itself is stopping


class Activity(str, enum.Enum):
    """What the supervisor is doing, for deciding what a new request interrupts."""
    IDLE = "idle"  # serving, stopped or failed: waiting for the next message
    BRINGUP = "bringup"  # a bring-up step
    BACKOFF = "backoff"  # waiting before a restart attempt
    MEMORY_WAIT = "memory_wait"  # waiting for memory to come back before a restart
    WAITING = "waiting"  # waiting for a node that cannot be reached to answer again
    STOPPING = "stopping"  # stopping the ranks: never interrupted, it is what every request starts with
    DRAINING = "draining"  # letting rank 0's requests finish before a restart that can wait


@dataclass(frozen=True)
class Request:
    action: Action
    reason: str = ""  # shown as the phase detail and, for a guard's stop, recorded as an incident
    stop_cluster: bool = True  # SHUTDOWN only: stop the ranks before the coordinator exits
    source: str = "dsv41ctl"
    drain: bool = False  # a restart that can wait: rank 0 stops admitting and in-flight requests finish first


def merge_requests(queued: Request | None, new: Request) -> Request:
    """The request to serve next when `new` arrives while `queued` waits: the newer one supersedes
    (a stop after a queued restart means stop), except that nothing supersedes a shutdown, and a
    shutdown keeps the ranks' stop if either asked for it."""
    if queued is not None and queued.action is Action.SHUTDOWN:
        if new.action is Action.SHUTDOWN:
            return Request(Action.SHUTDOWN, queued.reason, queued.stop_cluster or new.stop_cluster, queued.source)
        return queued
    return new


_PREEMPTS = {
    Activity.BRINGUP: {Action.STOP, Action.RESTART, Action.SHUTDOWN},
    Activity.BACKOFF: {Action.START, Action.STOP, Action.RESTART, Action.SHUTDOWN},
    Activity.MEMORY_WAIT: {Action.STOP, Action.RESTART, Action.SHUTDOWN},
    Activity.WAITING: {Action.START, Action.STOP, Action.RESTART, Action.SHUTDOWN},
    Activity.DRAINING: {Action.STOP, Action.RESTART, Action.SHUTDOWN},
    Activity.STOPPING: set(),
    Activity.IDLE: set(),  # the idle loop takes every request as it comes
}


def preempts(request: Request | None, activity: Activity) -> bool:
    """Whether `request` cancels what the supervisor is doing now (a start does not cancel a
    bring-up: it is one)."""
    return request is not None and request.action in _PREEMPTS[activity]


# ----------------------------------------------------------------------------- rank exits

class ExitResult(enum.IntEnum):
    """systemd's Result of a rank's run (the wire's ExitInfo.Result)."""
    UNKNOWN = pb.ExitInfo.RESULT_UNSPECIFIED
    SUCCESS = pb.ExitInfo.SUCCESS
    EXIT_CODE = pb.ExitInfo.EXIT_CODE
    SIGNAL = pb.ExitInfo.SIGNAL
    CORE_DUMP = pb.ExitInfo.CORE_DUMP
    TIMEOUT = pb.ExitInfo.TIMEOUT
    OOM_KILL = pb.ExitInfo.OOM_KILL
    WATCHDOG = pb.ExitInfo.WATCHDOG
    START_LIMIT_HIT = pb.ExitInfo.START_LIMIT_HIT
    RESOURCES = pb.ExitInfo.RESOURCES
    OTHER = pb.ExitInfo.OTHER


# An agent older than ExitInfo.result_kind sends only systemd's Result value (a fixed vocabulary,
# systemd.exec(5) $SERVICE_RESULT), which maps one to one.
_RESULT_VALUES = {"success": ExitResult.SUCCESS, "exit-code": ExitResult.EXIT_CODE, "signal": ExitResult.SIGNAL,
                  "core-dump": ExitResult.CORE_DUMP, "timeout": ExitResult.TIMEOUT, "oom-kill": ExitResult.OOM_KILL,
                  "watchdog": ExitResult.WATCHDOG, "start-limit-hit": ExitResult.START_LIMIT_HIT,
                  "resources": ExitResult.RESOURCES}
# Ended from outside the process (a signal, the OOM killer, a core dump): among exits too close to
# order, that one is the cause and the others followed it.
EXTERNAL = frozenset({ExitResult.SIGNAL, ExitResult.OOM_KILL, ExitResult.CORE_DUMP})


@dataclass(frozen=True)
class RankExit:
    node: str
    invocation_id: str
    at_unix_s: float  # systemd's own timestamp of the exit on that node
    result: ExitResult
    result_name: str  # systemd's word for it, for people
    code: str  # exited, killed, dumped
    status: int  # exit status, or the signal number
    active_state: str  # the unit's state when the exit was seen
    floor: str = ""  # the node's memory floor stopped it: what its agent saw ("" when it did not)
    # When its first SGLang process ended, if before the unit exited (0: not seen), and which.
    first_loss_at_unix_s: float = 0.0
    first_loss: str = ""
    # Its own output said its collective failed because a peer went away (peerfailure.py): it followed.
    peer_failure: str = ""

    @property
    def lost_at_unix_s(self) -> float:
        """When the run was lost on its node: its first process's end, else the unit's exit."""
        return self.first_loss_at_unix_s or self.at_unix_s

    @property
    def _engine_said(self) -> str:
        return f"; its engine: {self.peer_failure}" if self.peer_failure else ""

    def describe(self) -> str:
        engine = self._engine_said
        if self.floor and not self.result_name:
            return f"rank unit {self.active_state}: being stopped by the node's memory floor: {self.floor}"
        if self.first_loss and not self.result_name:
            return f"rank unit {self.active_state}: its {self.first_loss} ended{engine}"
        why = f" (stopped by the node's memory floor: {self.floor})" if self.floor else ""
        lost = (f" ({self.first_loss} ended {self.at_unix_s - self.first_loss_at_unix_s:.1f} s before)"
                if self.first_loss_at_unix_s else "")
        return (f"rank unit {self.active_state}: result {self.result_name or 'unknown'}, "
                f"{self.code or 'exit'} status {self.status}{why}{lost}{engine}")

    def outcome(self) -> str:
        """The exit without the unit state, for the list of ranks that followed."""
        if self.first_loss and not self.result_name:
            what = f"its {self.first_loss} ended"
        else:
            what = f"result {self.result_name or 'unknown'}, {self.code or 'exit'} status {self.status}"
        return what + self._engine_said


def exit_result(info: pb.ExitInfo) -> ExitResult:
    if info.result_kind != pb.ExitInfo.RESULT_UNSPECIFIED:
        try:
            return ExitResult(info.result_kind)
        except ValueError:
            return ExitResult.OTHER
    if not info.result:
        return ExitResult.UNKNOWN
    return _RESULT_VALUES.get(info.result, ExitResult.OTHER)


def new_exit(node: str, rank: pb.RankState, launched_invocation: str | None, known: Mapping[str, RankExit],
             now_unix_s: float) -> RankExit | None:
    """The exit this rank state reports, when it is news: an exit is known by the invocation it
    ended (streams can deliver an earlier rank's last state after a new launch, and one exit is
    reported several times: failed, then reset to inactive), and only for the rank this
    generation launched on that node. A run first seen lost by its process's end is seen again
    when its node's floor says it ended it (the floor's signal ends the scheduler at once, and the
    agent can report that end before the cause it publishes right after sending)."""
    if not launched_invocation:
        return None
    earlier = known.get(node)
    if rank.stopping_cause == pb.ExitInfo.MEMORY_FLOOR and rank.invocation_id == launched_invocation and (
            earlier is None or (earlier.first_loss and not earlier.result_name and not earlier.floor)):
        # The node's floor is ending the run: it is lost to the group now, before it exits (a rank 0
        # drains first and tells the workers to go, whose exits would otherwise come first).
        floor = rank.stopping_detail or "below MEMORY_FLOOR_GB"
        if earlier is not None:
            return replace(earlier, active_state=rank.active_state, floor=floor)
        return RankExit(node, rank.invocation_id, now_unix_s, ExitResult.OTHER, "", "", 0, rank.active_state, floor)
    if earlier is not None:
        return None
    if rank.first_loss_at_unix_s and rank.invocation_id == launched_invocation and \
            rank.active_state in ("active", "activating"):  # deactivating: someone is stopping it
        # One of its SGLang processes ended: lost to the group now, though its launcher may take
        # seconds to exit (SGLang's sleeps 5 s for crash diagnostics) while the peers' exit at once.
        return RankExit(node, rank.invocation_id, rank.first_loss_at_unix_s, ExitResult.OTHER, "", "", 0,
                        rank.active_state, first_loss_at_unix_s=rank.first_loss_at_unix_s,
                        first_loss=rank.first_loss_detail)
    info = rank.last_exit
    if info.invocation_id != launched_invocation:
        return None
    if rank.active_state in ("active", "activating") and rank.invocation_id == info.invocation_id:
        return None  # a run cannot have ended and still be running: not an exit
    floor = (info.cause_detail or "below MEMORY_FLOOR_GB") if info.cause == pb.ExitInfo.MEMORY_FLOOR else ""
    return RankExit(node, info.invocation_id, info.at_unix_s or now_unix_s, exit_result(info), info.result,
                    info.code, info.status, rank.active_state, floor, info.first_loss_at_unix_s,
                    info.first_loss_detail)


@dataclass(frozen=True)
class Blame:
    node: str
    message: str
    floor: bool = False  # the rank blamed was stopped by its node's memory floor


def first_failure(exits: Sequence[RankExit], window_s: float = BLAME_WINDOW_S) -> Blame:
    """Who died first. A rank whose own output says its collective lost a peer followed another,
    whenever its node saw it (a busy node's agent can note its rank's loss late); the others are
    ordered by when each was lost on its node (its first SGLang process's end, else its unit's exit:
    a launcher may outlive its dead scheduler by seconds). Those times on different nodes are only
    comparable to a few milliseconds (a peer notices a dead socket at once): among ranks lost that
    close together, one ended from outside is the cause. A rank its node's memory floor stopped is
    the cause in any case. When every rank lost a peer (a network failure), time alone decides."""
    if not exits:
        raise ValueError("first_failure needs at least one exit")
    ordered = sorted(exits, key=lambda e: e.lost_at_unix_s)
    candidates = [e for e in ordered if not e.peer_failure] or ordered
    close = [e for e in candidates if e.lost_at_unix_s - candidates[0].lost_at_unix_s <= window_s]
    external = [e for e in close if e.result in EXTERNAL]
    # A rank its node's floor stopped is the cause whenever it ended: the floor signalled it first,
    # and a rank 0 that drains on SIGTERM tells the workers to exit before it does.
    floors = [e for e in ordered if e.floor]
    first = floors[0] if floors else external[0] if external else candidates[0]
    message = f"rank on {first.node} died first: {first.describe()}"
    followers = [f"{e.node} ({e.outcome()})" for e in ordered if e is not first]
    if followers:
        message += "; then " + ", ".join(followers)
    return Blame(first.node, message, bool(first.floor))


# ----------------------------------------------------------------------------- restarts

@dataclass(frozen=True)
class RestartPlan:
    attempt: int  # the attempt about to be made (1-based)
    delay_s: float  # wait this long first
    give_up: bool  # attempts are spent: do not restart


def attempts_so_far(attempt: int, serving_since_unix_s: float, now_unix_s: float,
                    stable_s: float = STABLE_SERVING_S) -> int:
    """Attempts counted against the limit: a cluster that served for `stable_s` starts afresh."""
    if serving_since_unix_s and now_unix_s - serving_since_unix_s > stable_s:
        return 0
    return attempt


def next_restart(attempts: int, max_attempts: int, backoff_s: float) -> RestartPlan:
    """After `attempts` restarts, the next one: exponential backoff, bounded in number."""
    attempt = attempts + 1
    if attempt > max_attempts:
        return RestartPlan(attempt, 0.0, True)
    return RestartPlan(attempt, backoff_s * 2 ** (attempt - 1), False)


def retry_can_fix(step_retryable: bool, transient: bool) -> bool:
    """A failed step is retried when the step says a retry can fix it (a rank that crashed while
    loading), or when the failure was transient (an agent that could not be reached)."""
    return step_retryable or transient


# ----------------------------------------------------------------------------- memory

def memory_short(available: Mapping[str, int | None], need_bytes: int) -> list[str]:
    """Nodes whose available memory is not back to what a rank needs (None: not known yet)."""
    return sorted(node for node, value in available.items() if value is None or value < need_bytes)
