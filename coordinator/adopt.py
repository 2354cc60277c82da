"""A restarted coordinator takes over ranks that run the current plans instead of restarting them:
every node's rank runs, each from the plan the coordinator renders now, and rank 0 answers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from dsv41.v1 import agent_pb2 as pb

from . import serving
from .bringup.step import StepContext, StepFailed
from .bringup.tables import render_plans
from .plan import NodePlan

RUNNING = ("active", "activating")


@dataclass(frozen=True)
class Adoption:
    plans: tuple[NodePlan, ...]
    ranks: dict[str, pb.RankState]  # node -> the rank found running

    @property
    def launched(self) -> dict[str, str]:
        return {node: rank.invocation_id for node, rank in self.ranks.items()}


def read_statuses(ctx: StepContext) -> dict[str, pb.NodeStatus] | None:
    """Every agent's status; None (and why, in the journal) when one cannot be asked."""
    try:
        return ctx.each(lambda c: c.status())
    except StepFailed as exc:
        ctx.log.warning("adopt_skipped", f"cannot see every agent ({exc}); bringing the cluster up instead")
        return None


def floor_stops(statuses: Mapping[str, pb.NodeStatus]) -> list[tuple[str, pb.ExitInfo]]:
    """(node, exit) of each rank not running whose last run its node's memory floor ended, oldest
    first: a coordinator starting now may not have seen it happen."""
    found = [(n, s.rank.last_exit) for n, s in statuses.items()
             if s.rank.active_state not in RUNNING and s.rank.last_exit.cause == pb.ExitInfo.MEMORY_FLOOR]
    return sorted(found, key=lambda item: item[1].at_unix_s)


def find_running(ctx: StepContext, statuses: Mapping[str, pb.NodeStatus]) -> Adoption | None:
    """The running ranks when every node's matches its current plan; None (and why, in the
    journal) when they do not, or when nothing runs."""
    running = {n for n, s in statuses.items() if s.rank.active_state in RUNNING}
    if not running:
        return None
    try:
        plans = render_plans(ctx, sync=False)
    except StepFailed as exc:
        ctx.log.warning("adopt_skipped", f"cannot render the plans ({exc}); bringing the cluster up instead")
        return None
    matches = all(statuses[p.node].rank.fingerprint == p.fingerprint for p in plans)
    if running != set(ctx.clients) or not matches:
        ctx.log.warning("adopt_refused", "ranks running do not match the current plans on every node "
                        f"(running on {', '.join(sorted(running))}); restarting the cluster")
        return None
    return Adoption(plans, {n: s.rank for n, s in statuses.items()})


def answers(ctx: StepContext) -> bool:
    """Whether the adopted cluster's rank 0 answers /health."""
    result = ctx.call(lambda: serving.health(ctx.base_url))
    if not result.ok:
        ctx.log.warning("adopt_refused", f"running ranks do not answer ({result.detail}); restarting")
    return result.ok
