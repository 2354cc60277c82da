"""The coordinator's partition check over the agents' pack states (coordinator.packcheck)."""

from __future__ import annotations

import pytest

from dsv41 import engram_format as fmt
from coordinator.packcheck import PackProblem, partition_problems
from dsv41.v1 import agent_pb2 as pb

pytestmark = pytest.mark.unit

NODES = ("spark1", "spark2", "spark3")
ROWS = {1: 384_006_168, 14: 384_016_682}  # the real tables


def state(rank: int, ranges: dict[int, tuple[int, int, int]], status: str = "complete") -> pb.PackState:
    return pb.PackState(layers=[pb.PackLayerState(layer=layer, rank=rank, state=status, row_lo=lo, row_hi=hi,
                                                  total_rows=n) for layer, (lo, hi, n) in ranges.items()])


def floor_states(tp: int = 3) -> dict[str, pb.PackState]:
    return {NODES[r]: state(r, {layer: (*fmt.row_range(n, r, tp), n) for layer, n in ROWS.items()})
            for r in range(tp)}


def test_floor_split_packs_partition_both_tables() -> None:
    assert partition_problems(floor_states()) == []


def test_any_agreed_partition_passes() -> None:
    # SGLang's hash-column split is another exact partition.
    n = 1001
    states = {"spark1": state(0, {1: (0, 300, n)}), "spark2": state(1, {1: (300, 800, n)}),
              "spark3": state(2, {1: (800, n, n)})}
    assert partition_problems(states) == []


def test_a_gap_names_the_node_layer_and_rows() -> None:
    states = floor_states()
    lo, hi = fmt.row_range(ROWS[14], 1, 3)
    states["spark2"] = state(1, {1: (*fmt.row_range(ROWS[1], 1, 3), ROWS[1]), 14: (lo + 10, hi, ROWS[14])})
    assert partition_problems(states) == [PackProblem(
        "spark2", 14, f"rows [{lo}, {lo + 10}) of {ROWS[14]} are in no shard (between spark1 rank 0 [0, {lo}) and "
                      f"spark2 rank 1 [{lo + 10}, {hi})); re-pack with `dsv41ctl pack --start`")]
    assert str(partition_problems(states)[0]).startswith(f"spark2: layer 14: rows [{lo}, {lo + 10}) of ")


def test_an_overlap_names_both_shards() -> None:
    n = 1001
    states = {"spark1": state(0, {1: (0, 334, n)}), "spark2": state(1, {1: (333, 667, n)}),
              "spark3": state(2, {1: (667, n, n)})}
    (problem,) = partition_problems(states)
    assert (problem.node, problem.layer) == ("spark2", 1)
    assert problem.message.startswith("rows [333, 334) of 1001 are in two shards: spark1 rank 0 [0, 334) and "
                                      "spark2 rank 1 [333, 667)")


def test_a_missing_tail_and_rows_past_the_end() -> None:
    n = 1001
    short = {"spark1": state(0, {1: (0, 333, n)}), "spark2": state(1, {1: (333, 667, n)})}
    assert [p.message.split(";")[0] for p in partition_problems(short)] == [
        "rows [667, 1001) of 1001 are in no shard (between spark2 rank 1 [333, 667))"]
    long = {"spark1": state(0, {1: (0, 500, n)}), "spark2": state(1, {1: (500, 1002, n)})}
    assert partition_problems(long)[0].message.startswith("rows [1001, 1002) lie past the end of the table")


def test_tables_of_different_sizes_and_a_rank_held_twice() -> None:
    sizes = {"spark1": state(0, {1: (0, 500, 1000)}), "spark2": state(1, {1: (500, 1001, 1001)})}
    (problem,) = partition_problems(sizes)
    assert problem.message.startswith("the shards are of tables of different sizes (spark1 rank 0: 1000 rows, "
                                      "spark2 rank 1: 1001 rows)")
    twice = {"spark1": state(0, {1: (0, 500, 1000)}), "spark2": state(0, {1: (0, 500, 1000)}),
             "spark3": state(1, {1: (500, 1000, 1000)})}
    messages = [p.message for p in partition_problems(twice)]
    assert messages[0] == "rank 0 is held by more than one node (spark1, spark2)"
    assert messages[1].startswith("rows [0, 500) of 1000 are in two shards")


def test_incomplete_layers_are_left_to_the_pack_step_and_old_agents_are_named() -> None:
    states = floor_states()
    states["spark3"] = state(2, {1: (0, 0, 0), 14: (*fmt.row_range(ROWS[14], 2, 3), ROWS[14])})
    states["spark3"].layers[0].state = "packing"
    assert partition_problems(states) == []
    old = floor_states()
    old["spark2"].layers[1].row_lo = old["spark2"].layers[1].row_hi = old["spark2"].layers[1].total_rows = 0
    assert partition_problems(old) == [PackProblem(
        "spark2", 14, "its agent reports no row range for the shard; upgrade dsv41-agent on that node to the "
                      "coordinator's version")]
