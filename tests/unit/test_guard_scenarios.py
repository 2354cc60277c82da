"""bench/memory_guard's scenario section (bench/guard_scenarios.py): the stand-in's engine on a
simulated clock, the real policy in the loop, and the oracle it is judged against."""

from __future__ import annotations

import pytest

from dataclasses import replace

from bench import guard_scenarios as gs
from dsv41.cost import CostModel

pytestmark = pytest.mark.unit

MiB = 1 << 20


def several(base: int = 640 * MiB) -> gs.Scenario:
    # the integration test's prompts: each fits alone, together they do not; 10k and 14k fit together
    return gs.Scenario(0, base, (gs.Spec("p10k", "long", 0.0, 10_000, 0, 3.0),
                                 gs.Spec("p14k", "long", 0.01, 14_000, 0, 3.0),
                                 gs.Spec("p18k", "long", 0.02, 18_000, 0, 3.0)))


def test_the_oracle_aborts_the_fewest_and_the_guard_matches_it_on_the_integration_tests_prompts():
    v = gs.judge(several(), seed=3)
    assert v.unguarded.lowest < gs.SETTINGS.guard_bytes  # nothing acting, the node goes below the guard
    assert v.oracle_aborts == 1 and frozenset({"p18k"}) in v.oracle_sets
    assert v.guard.aborted == {"p18k"} and v.kept_by_oracle == set() and v.needless == set()
    assert v.guard.completed == {"p10k", "p14k"} and v.guard.lowest >= gs.SETTINGS.guard_bytes
    assert v.guard.kinds("abort_all") == 0 and v.guard.kinds("stop") == 0


def test_a_workload_that_fits_needs_no_abort_and_gets_none():
    v = gs.judge(several(base=2_000 * MiB), seed=3)
    assert v.oracle_aborts == 0 and v.guard.aborted == set() and v.kept_by_oracle == set()
    assert v.guard.completed == {"p10k", "p14k", "p18k"}


def test_the_scenarios_are_deterministic_for_a_seed():
    def outcome(seed):
        return [(v.scenario, sorted(v.guard.aborted), v.guard.lowest, v.oracle_aborts)
                for v in gs.run_scenarios(4, seed)]
    assert outcome(7) == outcome(7)
    assert outcome(7) != outcome(8)


def test_a_fork_replays_the_guards_run_to_its_action_and_then_lets_the_requests_in_flight_run():
    s = several()
    keep_all = gs.simulate(s, guarded=True, seed=3, fork=gs.Fork(0, frozenset()))
    assert keep_all.live == {"p10k", "p14k", "p18k"} and keep_all.lowest < gs.SETTINGS.guard_bytes
    without = gs.simulate(s, guarded=True, seed=3, fork=gs.Fork(0, frozenset({"p18k"})))
    assert without.lowest >= gs.SETTINGS.guard_bytes and without.aborted == {"p18k"}


def test_the_same_moment_oracle_names_the_aborts_a_wrong_cost_model_made():
    # A cost model that takes each token for twice its KV sees a crossing where there is none.
    wrong = replace(gs.SETTINGS, cost=CostModel(2 * gs.TOKEN_BYTES, gs.TRANSIENT_BYTES, gs.CHUNK, gs.HOOK_TOKENS))
    s = several(base=1_000 * MiB)
    assert gs.simulate(s, guarded=False, seed=3).lowest >= gs.SETTINGS.guard_bytes  # it all fits
    guarded = gs.simulate(s, guarded=True, seed=3, settings=wrong)
    assert guarded.aborted, "the wrong model should have aborted something"
    assert gs.needless_at_decisions(s, 3, guarded, wrong) == guarded.aborted


def test_the_report_has_both_engines_and_their_targets_line(capsys) -> None:
    # a small report end to end, as bench/memory_guard --scenarios-only prints it (its targets
    # line reads the gated figures from what report() returns)
    lines: list[str] = []
    figures = gs.report(3, 1, out=lines.append)
    assert figures["gated"]["scenarios"] == figures["gated_held"]["scenarios"] == 3
    assert any("with the admission gate" in line for line in lines)
    row = next(line for line in lines if line.startswith("scenarios below the guard, with the guard"))
    assert len(row.split()[-4:]) == 4 and all(x.isdigit() for x in row.split()[-4:])
    # and with the guard's model wrong, each factor both ways
    wrong = [line for line in lines if line.startswith("the guard's cost model charging")]
    assert len(wrong) == 2 * len(gs.WRONG_FACTORS) and all("the node ran out in" in line for line in wrong)
    assert set(figures["wrong_model"]) == {(f, h) for f in gs.WRONG_FACTORS for h in (False, True)}


def test_a_waiting_prefix_cache_hit_listed_with_its_match_is_kept_and_listed_cold_costs_an_abort():
    # A 30k-token prompt, 27k of it in the prefix cache, arrives while a 10k prompt prefills. The
    # two fit (the hit's KV is 3k tokens' worth). Listed with its match (the adapter's), the guard
    # keeps both; listed as SGLang alone lists a waiting hit (a cold prompt: fcfs matches it only
    # at its first step), it is charged 30k tokens of KV and aborted before it starts.
    s = gs.Scenario(0, 640 * MiB, (gs.Spec("p10k", "long", 0.0, 10_000, 0, 3.0),
                                   gs.Spec("hit", "cached", 0.01, 30_000, 27_000, 3.0)))
    matched = gs.judge(s, seed=3)
    assert matched.oracle_aborts == 0 and matched.unguarded.lowest >= gs.SETTINGS.guard_bytes
    assert matched.guard.aborted == set() and matched.guard.completed == {"p10k", "hit"}
    cold = gs.judge(s, seed=3, cold_waiting_hits=True)
    assert cold.guard.aborted == {"hit"} and cold.needless == {"hit"}
    (first, *_) = [d for _, d in cold.guard.decisions if d.kind == "abort"]
    assert "hit waits with a 30000-token prompt" in first.reason
