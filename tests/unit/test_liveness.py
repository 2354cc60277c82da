"""Liveness as pure functions with a fake clock: leases, reboots, which rank hung, and blame when
ranks exit around a node that went dark."""

import pytest

from coordinator import liveness
from coordinator.liveness import Heard
from coordinator.policy import ExitResult, RankExit

pytestmark = pytest.mark.unit
NODES = ["spark1", "spark2", "spark3"]


def test_a_lease_lapses_after_the_lease_without_a_heartbeat():
    assert not liveness.lapsed(100.0, now=105.9, lease_s=6.0, watching_since=0.0)
    assert liveness.lapsed(100.0, now=106.1, lease_s=6.0, watching_since=0.0)
    # never heard from: counted from when the watch began
    assert not liveness.lapsed(None, now=5.0, lease_s=6.0, watching_since=0.0)
    assert liveness.lapsed(None, now=6.5, lease_s=6.0, watching_since=0.0)


def test_a_new_boot_id_is_a_reboot_but_a_first_or_missing_one_is_not():
    assert liveness.rebooted("a1", "b2")
    assert not liveness.rebooted("a1", "a1")
    assert not liveness.rebooted("", "b2")  # first heard
    assert not liveness.rebooted("a1", "")  # an agent that cannot tell


def heard(at, count, stopped_at, active=True):
    return Heard(at, "boot", 0, count, stopped_at, active)


def views(counts, stopped, at=100.0):
    return {n: heard(at, c, s) for n, c, s in zip(NODES, counts, stopped)}


def hang(heard_by_node, pending_since=50.0, now=100.0, hang_s=10.0, first_s=600.0, fresh_s=3.0):
    return liveness.hung(heard_by_node, NODES, pending_since, now, hang_s, first_s, fresh_s)


def test_no_hang_without_pending_work():
    assert hang(views([5, 5, 4], [10, 10, 9]), pending_since=None) is None


def test_the_rank_that_never_started_the_step_is_named():
    # spark3 stopped at step 41; spark1 and spark2 started step 42 and wait in it
    found = hang(views([42, 42, 41], [80.0, 80.0, 79.9]))
    assert (found.node, found.forward_count, found.allowance_s) == ("spark3", 41, 10.0)
    assert found.stalled_s == pytest.approx(20.1)


def test_not_yet_hung_within_the_allowance_counted_from_when_work_was_pending():
    assert hang(views([42, 42, 41], [80.0, 80.0, 79.9]), pending_since=95.0) is None  # quiet 5 s < 10 s
    assert hang(views([42, 42, 42], [95.0, 95.0, 95.0])) is None  # stepping


def test_the_first_forward_after_a_start_gets_its_own_longer_allowance():
    assert hang(views([0, 0, 0], [0.0, 0.0, 0.0], at=500.0), pending_since=10.0, now=500.0) is None  # JIT compiles
    found = hang(views([0, 0, 0], [0.0, 0.0, 0.0], at=700.0), pending_since=10.0, now=700.0)
    assert found.node == "spark1" and found.allowance_s == 600.0  # equal counts: rank 0 starts every step


def test_equal_counts_blame_rank_0_which_starts_every_step():
    found = hang(views([7, 7, 7], [60.0, 61.0, 59.0]))
    assert found.node == "spark1"


def test_a_rank_whose_process_is_stopped_is_named_whatever_the_counts():
    # real SGLang, a worker's scheduler stopped between steps: every counter stops at the same count
    stopped = {**views([7, 7, 7], [60.0, 61.0, 59.0]), "spark3": Heard(100.0, "boot", 0, 7, 59.0, True, True)}
    assert hang(stopped).node == "spark3"
    assert hang({**views([9, 8, 8], [80.0, 70.0, 60.0]), "spark1": Heard(100.0, "boot", 0, 9, 80.0, True, True)}
                ).node == "spark1"
    # a stopped process is still only a hang once work has waited past the allowance
    assert hang(stopped, pending_since=95.0) is None


def test_among_ranks_behind_the_earliest_stop_is_named():
    found = hang(views([9, 8, 8], [80.0, 70.0, 60.0]))
    assert found.node == "spark3"


@pytest.mark.parametrize("change", [
    {"spark2": heard(90.0, 41, 79.0)},  # spark2's counter is not fresh: a lost node, not a hang
    {"spark2": None},
    {"spark3": heard(100.0, None, None)},  # no counter on that node
    {"spark3": heard(100.0, 41, 79.0, active=False)},  # its rank is not running
])
def test_a_hang_is_decided_only_with_fresh_counters_from_every_running_rank(change):
    base = views([42, 42, 41], [80.0, 80.0, 79.9])
    base.update(change)
    assert hang({k: v for k, v in base.items() if v is not None}) is None


def ex(node, at, result=ExitResult.EXIT_CODE):
    return RankExit(node, "i", at, result, "exit-code" if result is ExitResult.EXIT_CODE else "signal",
                    "exited" if result is ExitResult.EXIT_CODE else "killed", 1 if result is ExitResult.EXIT_CODE else 9,
                    "failed")


def test_nodes_neither_exited_nor_heard_since_the_first_exit_are_unaccounted():
    exits = {"spark1": ex("spark1", 10.0)}
    got = liveness.unaccounted(NODES, exits, {"spark2": heard(20.5, 1, 1), "spark3": heard(19.0, 1, 1)}, since=20.0)
    assert got == ["spark3"]
    assert liveness.unaccounted(NODES, exits, {}, since=20.0) == ["spark2", "spark3"]


def test_a_node_that_went_dark_is_blamed_before_the_exits_that_followed_it():
    # spark3 lost power: spark1 and spark2 saw its connection close and exited
    cause = liveness.blame([ex("spark2", 10.02), ex("spark1", 10.01)], {"spark3": 95.0}, now=101.5)
    assert cause.node == "spark3" and cause.kind == "node_lost"
    assert cause.message == ("spark3 lost: not heard from for 6.5 s; then rank exits on spark1 (result exit-code, "
                             "exited status 1), spark2 (result exit-code, exited status 1)")


def test_with_several_lost_the_first_to_go_dark_is_named():
    cause = liveness.blame([], {"spark3": 95.0, "spark2": 94.0}, now=101.0)
    assert cause.node == "spark2" and cause.message == "spark2 lost: not heard from for 7.0 s; also lost: spark3"


def test_without_a_lost_node_blame_is_the_rank_exits_own():
    cause = liveness.blame([ex("spark1", 10.0), ex("spark3", 10.01, ExitResult.SIGNAL)], {}, now=0.0)
    assert (cause.node, cause.kind) == ("spark3", "rank_exit")


# ----- the coordinator's own pause

def tick(mono, boot=None):
    return liveness.Tick(mono, mono if boot is None else boot)


def test_a_gap_between_checks_longer_than_half_a_lease_is_the_coordinators_pause():
    assert liveness.paused_for(None, tick(100.0), lease_s=6.0) is None  # the first check
    assert liveness.paused_for(tick(100.0), tick(100.25), lease_s=6.0) is None  # a tick
    assert liveness.paused_for(tick(100.0), tick(102.9), lease_s=6.0) is None  # under half a lease
    assert liveness.paused_for(tick(100.0), tick(120.2), lease_s=6.0) == pytest.approx(20.2)


def test_a_suspend_shows_on_the_boot_time_clock_only_and_counts_as_a_pause():
    # CLOCK_MONOTONIC stands still while the machine sleeps; CLOCK_BOOTTIME runs on
    assert liveness.paused_for(tick(100.0, 500.0), tick(100.25, 530.25), lease_s=6.0) == pytest.approx(30.25)


def pause(resumed_at=120.0, boots=None):
    return liveness.Pause(100.0, resumed_at, 20.0, boots or {n: "boot" for n in NODES})


def test_after_a_pause_only_heartbeats_that_arrived_after_it_count():
    # spark1 heard at 120.1 and again at 121.0; spark2 at 120.0, as the coordinator ran again (it
    # may have waited in a socket all along); spark3 before the pause
    seen = {"spark1": heard(121.0, 5, 99.0), "spark2": heard(120.0, 5, 99.0), "spark3": heard(99.5, 5, 99.0)}
    after = liveness.after_pause(pause(), seen, {"spark1": 120.1}, NODES, now=121.0, lease_s=6.0)
    assert after.answered == ("spark1",) and after.silent == ("spark2", "spark3") and not after.over


def test_a_burst_of_what_waited_in_the_socket_is_no_answer():
    # a node that died during the pause: the heartbeats it sent before arrive within milliseconds
    # as the coordinator runs again, and nothing after them
    burst = {n: heard(120.004, 5, 99.0) for n in NODES}
    firsts = {n: 120.001 for n in NODES}
    assert liveness.after_pause(pause(), burst, firsts, NODES, now=121.0, lease_s=6.0).silent == tuple(NODES)
    # a live agent's next heartbeat, a quarter lease later, is its answer
    live = {**burst, "spark2": heard(121.5, 5, 99.0)}
    after = liveness.after_pause(pause(), live, firsts, NODES, now=121.5, lease_s=6.0)
    assert after.answered == ("spark2",) and after.silent == ("spark1", "spark3")


def test_the_pause_is_over_when_every_node_answered_or_a_lease_went_by():
    firsts = {n: 120.2 for n in NODES}
    every_node = {n: heard(121.0, 5, 99.0) for n in NODES}
    after = liveness.after_pause(pause(), every_node, firsts, NODES, now=121.0, lease_s=6.0)
    assert after.answered == tuple(NODES) and not after.silent and after.over
    two = {n: heard(121.0, 5, 99.0) for n in NODES[:2]}
    assert not liveness.after_pause(pause(), two, firsts, NODES, now=126.0, lease_s=6.0).over
    late = liveness.after_pause(pause(), two, firsts, NODES, now=126.1, lease_s=6.0)
    assert late.over and late.silent == ("spark3",)


def test_a_node_heard_after_the_pause_in_another_boot_is_not_kept():
    seen = {n: Heard(121.0, "boot2" if n == "spark2" else "boot", 0, 5, 99.0, True) for n in NODES}
    after = liveness.after_pause(pause(), seen, {n: 120.2 for n in NODES}, NODES, now=121.0, lease_s=6.0)
    assert after.rebooted == ("spark2",) and after.answered == ("spark1", "spark3") and after.over


def test_a_lease_is_counted_again_from_the_end_of_the_coordinators_pause():
    # heard last at 99, the coordinator paused from 100 to 120: not lapsed until a lease after 120
    assert not liveness.lapsed(99.0, now=125.9, lease_s=6.0, watching_since=0.0, resumed_at=120.0)
    assert liveness.lapsed(99.0, now=126.1, lease_s=6.0, watching_since=0.0, resumed_at=120.0)
    assert liveness.lapsed(None, now=126.1, lease_s=6.0, watching_since=0.0, resumed_at=120.0)
    # heard after it: its own lease, as ever
    assert liveness.lapsed(121.0, now=127.1, lease_s=6.0, watching_since=0.0, resumed_at=120.0)


def test_a_stall_is_not_counted_across_the_coordinators_pause():
    assert liveness.stall_counted_from(50.0, None) == 50.0
    assert liveness.stall_counted_from(None, 120.0) is None  # no work pending: no stall at all
    assert liveness.stall_counted_from(50.0, 120.0) == 120.0
    assert liveness.stall_counted_from(125.0, 120.0) == 125.0
    # every rank's last step predates the pause (the head was frozen with rank 0): 0.5 s after it,
    # no rank has been quiet for the 10 s allowance, though 20.5 s passed since the last step
    stalled = views([5, 5, 5], [99.0, 99.0, 99.0], at=120.4)
    assert hang(stalled, pending_since=liveness.stall_counted_from(90.0, 120.0), now=120.5) is None
    assert hang(stalled, pending_since=90.0, now=120.5) is not None  # measured across it, a hang
    late = views([5, 5, 5], [99.0, 99.0, 99.0], at=130.4)
    assert hang(late, pending_since=liveness.stall_counted_from(90.0, 120.0), now=130.5).stalled_s == \
        pytest.approx(10.5)  # still not stepping 10 s after it: hung
