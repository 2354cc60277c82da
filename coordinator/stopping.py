"""Stopping the ranks: rank 0 first (it drains in-flight requests, then tells the group to shut
down), then the workers at once; then every agent is asked whether any rank unit or process is
left, and the answer is logged per node. Used by every stop: an operator's, a shutdown, a
recovery, and the clean-up after a failed or cancelled bring-up."""

from __future__ import annotations

from typing import Any, Callable, Collection

from dsv41.journal import EventLog
from dsv41.v1 import agent_pb2 as pb

from .agents import AgentClient, AgentUnavailable
from .parallel import on_each

STOPPED_STATES = ("absent", "inactive")
# A worker has nothing to drain and SGLang's workers only log SIGTERM: once rank 0 has stopped (and
# told the group to shut down) a worker exits by itself within moments, or never (it had not joined,
# or lost rank 0). The drain budget is for rank 0; a worker is killed after this.
WORKER_STOP_GRACE_S = 5


def _stop_one(client: AgentClient, deadline_s: int) -> str:
    try:
        reply = client.stop_rank(deadline_s)
        return pb.StopRankResponse.Outcome.Name(reply.outcome).lower()
    except AgentUnavailable as exc:
        return f"not confirmed: {exc.code}: {exc.details}"


def _confirm(client: AgentClient) -> tuple[bool, str]:
    try:
        state = client.status().rank.active_state
        return state in STOPPED_STATES, f"rank unit {state}"
    except AgentUnavailable as exc:
        return False, f"agent unreachable: {exc.details}"


def stop_ranks(clients: dict[str, AgentClient], head: str, deadline_s: int, log: EventLog,
               call: Callable[[Callable[[], Any]], Any] = lambda fn: fn(),
               lost: Collection[str] = ()) -> dict[str, bool]:
    """Stops every node's rank, head first; returns node -> confirmed stopped. `call` runs each
    blocking part (the supervisor passes one that keeps its inbox moving). A `lost` node (not heard
    from for its lease) is not asked: its rank is stopped when its agent answers again."""
    reachable = [name for name in clients if name not in lost]
    outcomes = {name: "not asked: node lost" for name in clients if name in lost}
    if head in reachable:
        outcomes[head] = call(lambda: _stop_one(clients[head], deadline_s))
    workers = [name for name in reachable if name != head]
    grace = min(deadline_s, WORKER_STOP_GRACE_S)
    outcomes.update(call(lambda: on_each(lambda n: _stop_one(clients[n], grace), workers)))
    confirmations = {name: (False, "its rank may still run") for name in clients if name in lost}
    confirmations.update(call(lambda: on_each(lambda n: _confirm(clients[n]), reachable)))
    for node in clients:
        confirmed, detail = confirmations[node]
        log.event("rank_stop_confirmed" if confirmed else "rank_stop_unconfirmed",
                  f"{node}: stop {outcomes[node]}; {detail}", "info" if confirmed else "err", node_name=node)
    return {node: confirmations[node][0] for node in clients}
