"""Whether the nodes' packed Engram shards partition each table exactly (a pure decision).

Every rank looks up every row and the TP all-reduce sums the ranks' answers, so each row must be
owned by exactly one rank: a row no shard holds reads as zeros and a row two shards hold is
doubled, silently in both cases. The rank's adapter serves the rows its file's header names, so
the check runs on the headers' ranges the agents report (PackLayerState.row_lo, row_hi,
total_rows), before launch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dsv41.engram_format import coverage_faults
from dsv41.v1 import agent_pb2 as pb

from .packstate import layer_state


@dataclass(frozen=True)
class PackProblem:
    node: str  # the node to look at first (the one whose shard starts the gap or the overlap)
    layer: int
    message: str

    def __str__(self) -> str:
        return f"{self.node}: layer {self.layer}: {self.message}"


@dataclass(frozen=True)
class _Shard:
    node: str
    rank: int
    row_lo: int
    row_hi: int
    total_rows: int

    def describe(self) -> str:
        return f"{self.node} rank {self.rank} [{self.row_lo}, {self.row_hi})"


def partition_problems(states: Mapping[str, Any]) -> list[PackProblem]:
    """Problems with the complete shards of every layer, given each node's PackState (by node name);
    [] when every layer's ranges partition its table exactly.

    Only layers whose shards are all complete are judged (an incomplete one is the pack step's
    own failure). A shard without row fields (an agent from before they existed) is a problem."""
    by_layer: dict[int, list[tuple[str, Any]]] = {}
    for node in sorted(states):
        for shard in states[node].layers:
            by_layer.setdefault(int(shard.layer), []).append((node, shard))
    problems: list[PackProblem] = []
    for layer in sorted(by_layer):
        entries = by_layer[layer]
        if any(layer_state(s) != pb.PackLayerState.COMPLETE for _, s in entries):
            continue
        unreported = [node for node, s in entries if s.total_rows == 0]
        for node in unreported:
            problems.append(PackProblem(node, layer, "its agent reports no row range for the shard; upgrade "
                                                     "dsv41-agent on that node to the coordinator's version"))
        if unreported:
            continue
        shards = [_Shard(node, int(s.rank), int(s.row_lo), int(s.row_hi), int(s.total_rows)) for node, s in entries]
        problems += _layer_problems(layer, shards)
    return problems


def _layer_problems(layer: int, shards: list[_Shard]) -> list[PackProblem]:
    totals = sorted({s.total_rows for s in shards})
    if len(totals) > 1:
        sizes = ", ".join(f"{s.node} rank {s.rank}: {s.total_rows} rows" for s in shards)
        return [PackProblem(shards[0].node, layer, f"the shards are of tables of different sizes ({sizes}); "
                                                   "re-pack them from one checkpoint with `dsv41ctl pack --start`")]
    problems = []
    ranks = [s.rank for s in shards]
    for rank in sorted({r for r in ranks if ranks.count(r) > 1}):
        nodes = ", ".join(s.node for s in shards if s.rank == rank)
        problems.append(PackProblem(next(s.node for s in shards if s.rank == rank), layer,
                                    f"rank {rank} is held by more than one node ({nodes})"))
    for fault in coverage_faults([(s.row_lo, s.row_hi) for s in shards], totals[0]):
        around = [shards[i] for i in fault.ranges]
        node = around[-1].node if around else shards[0].node
        who = " and ".join(s.describe() for s in around)
        if fault.kind == "gap":
            text = f"rows [{fault.lo}, {fault.hi}) of {totals[0]} are in no shard" + (f" (between {who})" if who else "")
        elif fault.kind == "overlap":
            text = f"rows [{fault.lo}, {fault.hi}) of {totals[0]} are in two shards: {who}"
        else:
            text = f"rows [{fault.lo}, {fault.hi}) lie past the end of the table of {totals[0]} rows: {who}"
        problems.append(PackProblem(node, layer, text + "; re-pack with `dsv41ctl pack --start`"))
    return problems
