"""What a bring-up step is, what it is given, and how it fails.

A step is a function of a StepContext and its deadline. It never sleeps, polls or calls an agent
except through the context, so the supervisor can interrupt any wait within moments (an
operator's stop), keep applying rank events while the step waits, and turn every agent that
cannot be reached or refuses into that step's failure naming the node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from dsv41.journal import EventLog

from ..agents import AgentClient, AgentUnavailable
from ..config import ClusterConfig
from ..parallel import on_each
from ..plan import NodePlan
from ..state import Phase, Ranks

T = TypeVar("T")


class StepFailed(Exception):
    """A step could not complete; `transient` when the cause may clear by itself (an agent that
    could not be reached), so the restart policy may try again whatever the step. `unreachable`:
    nodes to wait for (phase `waiting`) before the bring-up runs again, spending no restart
    attempt. `incident`: the incident kind to record instead of "<step>_failed"."""

    def __init__(self, step: str, node: str | None, reason: str, transient: bool = False,
                 unreachable: tuple[str, ...] = (), incident: str | None = None):
        super().__init__(f"{step}: {node + ': ' if node else ''}{reason}")
        self.step, self.node, self.reason, self.transient = step, node, reason, transient
        self.unreachable, self.incident = unreachable, incident


class Preempted(Exception):
    """An operator's request (or the memory guard's stop) cancelled what the supervisor was doing."""

    def __init__(self, request: Any):
        super().__init__(f"preempted by {getattr(request, 'action', request)}")
        self.request = request


@dataclass(frozen=True)
class Step:
    name: Phase  # the phase shown while it runs
    deadline_key: str  # the cluster.env key holding its deadline in seconds
    retryable: bool  # whether a restart can fix its failure (a rank that crashed can start again)
    ranks: Ranks  # whether ranks run during it: from the first that says so on, the memory guard watches
    run: Callable[["StepContext", float], None]
    skip: Callable[[ClusterConfig], bool] = lambda cfg: False
    skip_warning: tuple[str, str] = ("", "")  # (event, message) logged at each bring-up that skips it


@dataclass
class BringUp:
    """What one bring-up has found and done so far; owned by the supervisor thread."""
    plans: tuple[NodePlan, ...] = ()
    generation: str = ""
    launched: dict[str, str] = field(default_factory=dict)  # node -> invocation ID of the rank this bring-up started
    fabric: dict = field(default_factory=dict)  # node -> FabricReport
    collective: Any = None  # the collective gate's CollectiveTestReport, once it ran

    def plan(self, node: str) -> NodePlan:
        return next(p for p in self.plans if p.node == node)


class StepContext:
    """Everything a step may use. `wait`, `call` and `set_detail` come from the supervisor (in
    unit tests: a fake clock, a direct call, a list)."""

    def __init__(self, step: str, cfg: ClusterConfig, clients: dict[str, AgentClient], log: EventLog,
                 bring: BringUp, *, wait: Callable[[float], None], call: Callable[..., Any],
                 monotonic: Callable[[], float], set_detail: Callable[[str], None],
                 record_rank: Callable[[str, Any], None] = lambda node, rank: None,
                 state_dir: str = "/var/lib/dsv41/coordinator", table_dir: str = "/var/lib/dsv41/state",
                 api_key: str | None = None, base_url: str = ""):
        self.step = step
        self.cfg = cfg
        self.clients = clients
        self.log = log
        self.bring = bring
        self.wait = wait  # sleeps, interruptibly; may raise Preempted or StepFailed (a rank exited)
        # call(fn, to_end=False) runs fn() while staying interruptible and may raise the same; a
        # call that changes a node (to_end=True) is waited for before Preempted is raised, so the
        # stop that follows cannot race it (a StartRank still on its way would start a rank after it).
        self.call = call
        self.monotonic = monotonic
        self.set_detail = set_detail
        self.record_rank = record_rank  # a rank state a step learned (launch's StartRank answers)
        self.state_dir = state_dir
        self.table_dir = table_dir
        self.api_key = api_key
        self.base_url = base_url

    @property
    def head(self) -> str:
        return self.cfg.head.name

    def fail(self, node: str | None, reason: str, transient: bool = False) -> StepFailed:
        return StepFailed(self.step, node, reason, transient)

    def fail_unreachable(self, nodes: tuple[str, ...], reason: str) -> StepFailed:
        """The step cannot go on until these nodes answer: the first is named, `reason` is its."""
        return StepFailed(self.step, nodes[0], reason, transient=True, unreachable=nodes)

    def unreachable(self, node: str, exc: AgentUnavailable) -> StepFailed:
        """The step's failure for an agent that did not answer or refused: names the node and says
        which; one that could not be reached is transient."""
        target = self.clients[node].target
        if exc.unreachable:
            return self.fail(node, f"agent at {target} {exc.meaning()}", transient=True)
        return self.fail(node, f"agent at {target}: {exc.what}: {exc.meaning()}")

    def ask(self, node: str, fn: Callable[[AgentClient], T], mutates: bool = False) -> T:
        """fn(client of node), interruptibly; an agent error is this step's failure naming the node."""
        try:
            return self.call(lambda: fn(self.clients[node]), to_end=mutates)
        except AgentUnavailable as exc:
            raise self.unreachable(node, exc) from None

    def each(self, fn: Callable[[AgentClient], T], nodes: list[str] | None = None,
             mutates: bool = False) -> dict[str, T]:
        """fn on every node (or `nodes`) at once; the first agent error fails the step naming its node."""
        names = list(self.clients) if nodes is None else nodes

        results = self.call(lambda: on_each(lambda name: fn(self.clients[name]), names,
                                            catch=(AgentUnavailable, StepFailed)), to_end=mutates)
        for name in names:
            outcome = results[name]
            if isinstance(outcome, AgentUnavailable):
                raise self.unreachable(name, outcome)
            if isinstance(outcome, StepFailed):
                raise outcome
        return results
