"""The supervisor's decisions as pure functions: which request wins and what it interrupts, when a
rank state is a (new) exit, who is blamed, restart attempts and backoff, and the memory wait."""

from dataclasses import replace

import pytest

from coordinator import policy
from coordinator.policy import Action, Activity, ExitResult, RankExit, Request
from dsv41.v1 import agent_pb2 as pb

pytestmark = pytest.mark.unit


# ----- requests

def req(action, **kw):
    return Request(Action(action), **kw)


@pytest.mark.parametrize("queued, new, wins", [
    (None, "stop", "stop"),
    ("restart", "stop", "stop"),  # a stop after a queued restart means stop
    ("stop", "restart", "restart"),
    ("stop", "start", "start"),
    ("start", "stop", "stop"),
    ("shutdown", "start", "shutdown"),  # nothing supersedes a shutdown
    ("shutdown", "restart", "shutdown"),
])
def test_the_newer_request_supersedes_a_queued_one_except_a_shutdown(queued, new, wins):
    merged = policy.merge_requests(req(queued) if queued else None, req(new))
    assert merged.action is Action(wins)


def test_a_second_shutdown_keeps_the_ranks_stop_if_either_asked_for_it():
    merged = policy.merge_requests(req("shutdown", stop_cluster=False), req("shutdown", stop_cluster=True))
    assert merged.action is Action.SHUTDOWN and merged.stop_cluster
    merged = policy.merge_requests(req("shutdown", stop_cluster=True), req("shutdown", stop_cluster=False))
    assert merged.stop_cluster


@pytest.mark.parametrize("activity, preempting", [
    (Activity.BRINGUP, {"stop", "restart", "shutdown"}),  # a start during a bring-up is that bring-up
    (Activity.BACKOFF, {"start", "stop", "restart", "shutdown"}),
    (Activity.MEMORY_WAIT, {"stop", "restart", "shutdown"}),
    (Activity.WAITING, {"start", "stop", "restart", "shutdown"}),  # a start tries again at once
    (Activity.STOPPING, set()),  # every request begins with a stop: the one under way finishes
    (Activity.IDLE, set()),
])
def test_what_each_request_interrupts(activity, preempting):
    got = {a.value for a in Action if policy.preempts(req(a.value), activity)}
    assert got == preempting
    assert not policy.preempts(None, activity)


# ----- exits

def rank(active, invocation, exit_invocation, result="signal", code="killed", status=9, at=100.0, kind=None):
    info = pb.ExitInfo(result=result, code=code, status=status, at_unix_s=at, invocation_id=exit_invocation)
    if kind is not None:
        info.result_kind = kind
    return pb.RankState(active_state=active, invocation_id=invocation, last_exit=info)


def test_an_exit_of_the_launched_rank_is_news_once():
    state = rank("failed", "inv1", "inv1")
    found = policy.new_exit("spark2", state, "inv1", {}, now_unix_s=5.0)
    assert found == RankExit("spark2", "inv1", 100.0, ExitResult.SIGNAL, "signal", "killed", 9, "failed")
    assert found.describe() == "rank unit failed: result signal, killed status 9"
    # the same exit again (failed, then reset to inactive) is not news
    assert policy.new_exit("spark2", rank("inactive", "", "inv1"), "inv1", {"spark2": found}, 6.0) is None


@pytest.mark.parametrize("state, launched", [
    (rank("failed", "old", "old"), "inv2"),  # an earlier rank's last state, delivered after a new launch
    (rank("active", "inv1", "inv1"), "inv1"),  # a run cannot have ended and still be running
    (rank("failed", "inv1", "inv1"), None),  # nothing launched in this generation
    (rank("failed", "inv1", "inv1"), ""),
])
def test_states_that_are_not_an_exit_of_this_generation(state, launched):
    assert policy.new_exit("spark2", state, launched, {}, 1.0) is None


def test_an_exit_without_a_timestamp_takes_the_time_it_was_seen():
    found = policy.new_exit("spark2", rank("failed", "i", "i", at=0.0), "i", {}, now_unix_s=42.5)
    assert found.at_unix_s == 42.5


def test_the_exit_result_is_read_from_the_enum_and_from_an_older_agents_systemd_word():
    assert policy.exit_result(pb.ExitInfo(result="exit-code", result_kind=pb.ExitInfo.OOM_KILL)) is ExitResult.OOM_KILL
    assert policy.exit_result(pb.ExitInfo(result="oom-kill")) is ExitResult.OOM_KILL
    assert policy.exit_result(pb.ExitInfo(result="core-dump")) is ExitResult.CORE_DUMP
    assert policy.exit_result(pb.ExitInfo(result="something-new")) is ExitResult.OTHER
    assert policy.exit_result(pb.ExitInfo()) is ExitResult.UNKNOWN


def ex(node, at, result=ExitResult.EXIT_CODE, code="exited", status=1):
    return RankExit(node, f"inv-{node}", at, result, {ExitResult.SIGNAL: "signal", ExitResult.OOM_KILL: "oom-kill",
                                                      ExitResult.EXIT_CODE: "exit-code"}.get(result, ""),
                    code, status, "failed")


def test_blame_goes_to_the_first_exit_in_time():
    blame = policy.first_failure([ex("spark1", 10.2), ex("spark3", 10.0), ex("spark2", 10.4)])
    assert blame.node == "spark3"
    assert blame.message == ("rank on spark3 died first: rank unit failed: result exit-code, exited status 1; "
                             "then spark1 (result exit-code, exited status 1), spark2 (result exit-code, exited status 1)")


def test_among_exits_too_close_to_order_the_one_ended_from_outside_is_the_cause():
    # spark1 noticed the dead socket 10 ms "before" spark3's kill was reaped: clocks cannot tell
    blame = policy.first_failure([ex("spark1", 10.000), ex("spark3", 10.010, ExitResult.SIGNAL, "killed", 9)])
    assert blame.node == "spark3" and blame.message.startswith("rank on spark3 died first: ")
    assert blame.message.endswith("then spark1 (result exit-code, exited status 1)")
    oom = policy.first_failure([ex("spark1", 10.0), ex("spark2", 10.04, ExitResult.OOM_KILL, "killed", 9)])
    assert oom.node == "spark2"
    # beyond the window, time decides even against a signal
    late = policy.first_failure([ex("spark1", 10.0), ex("spark3", 10.2, ExitResult.SIGNAL, "killed", 9)])
    assert late.node == "spark1"


def test_blame_orders_ranks_by_their_first_process_end_when_a_launcher_outlived_it():
    # SGLang over gloo, rank 0's scheduler killed -9 at 10.0: the workers' launchers killed their
    # trees (SIGKILL, themselves too) at once, rank 0's launcher slept 5 s before doing the same.
    def sigkilled(node, exited, lost=0.0, which=""):
        return replace(ex(node, exited, ExitResult.SIGNAL, "killed", 9), first_loss_at_unix_s=lost, first_loss=which)

    exits = [sigkilled("spark1", 15.3, 10.0, "sglang::scheduler_TP0 (pid 421)"), sigkilled("spark2", 10.4, 10.2),
             sigkilled("spark3", 10.3, 10.2)]
    blame = policy.first_failure(exits)
    assert blame.node == "spark1"
    assert blame.message.startswith("rank on spark1 died first: rank unit failed: result signal, killed status 9 "
                                    "(sglang::scheduler_TP0 (pid 421) ended 5.3 s before); then spark2")
    # by the units' exits alone a worker would have been blamed
    assert policy.first_failure([replace(e, first_loss_at_unix_s=0.0) for e in exits]).node == "spark3"


def test_a_rank_whose_sglang_process_ended_is_lost_before_its_unit_exits():
    running = pb.RankState(active_state="active", invocation_id="inv-1", first_loss_at_unix_s=10.0,
                           first_loss_detail="sglang::scheduler_TP0 (pid 421)")
    lost = policy.new_exit("spark1", running, "inv-1", {}, now_unix_s=10.2)
    assert lost.lost_at_unix_s == 10.0 and lost.describe() == "rank unit active: its sglang::scheduler_TP0 (pid 421) ended"
    # not a rank this generation launched, one already known, or one being stopped
    assert policy.new_exit("spark1", running, "inv-0", {}, 10.2) is None
    assert policy.new_exit("spark1", running, "inv-1", {"spark1": lost}, 10.2) is None
    stopping = pb.RankState(active_state="deactivating", invocation_id="inv-1", first_loss_at_unix_s=10.0)
    assert policy.new_exit("spark1", stopping, "inv-1", {}, 10.2) is None
    blame = policy.first_failure([lost, replace(ex("spark3", 10.3, ExitResult.SIGNAL, "killed", 9),
                                                first_loss_at_unix_s=10.25, first_loss="x")])
    assert blame.node == "spark1"
    follower = RankExit("spark2", "inv-2", 10.1, ExitResult.OTHER, "", "", 0, "active", first_loss_at_unix_s=10.1,
                        first_loss="sglang::scheduler_TP1 (pid 300)")
    assert policy.first_failure([follower, lost]).message == (
        "rank on spark1 died first: rank unit active: its sglang::scheduler_TP0 (pid 421) ended; "
        "then spark2 (its sglang::scheduler_TP1 (pid 300) ended)")


def test_a_rank_whose_engine_lost_a_peer_followed_whenever_its_node_saw_it():
    # Seen on SGLang 0.5.23 in a full CI run: rank 0's scheduler killed -9; spark3's launcher killed
    # its tree on gloo's error and systemd stamped that exit before rank 0's busy agent noted its loss.
    rank0 = RankExit("spark1", "inv-1", 10.030, ExitResult.OTHER, "", "", 0, "active", first_loss_at_unix_s=10.030,
                     first_loss="sglang::scheduler_TP0 (pid 778)")
    spark3 = replace(ex("spark3", 10.010, ExitResult.SIGNAL, "killed", 9),
                     peer_failure="Connection closed by peer [192.168.241.11]:42374")
    spark2 = replace(ex("spark2", 10.012, ExitResult.SIGNAL, "killed", 9),
                     peer_failure="Read error [192.168.241.11]:42374: Connection reset by peer")
    blame = policy.first_failure([spark3, spark2, rank0])
    assert blame.node == "spark1"
    assert blame.message == (
        "rank on spark1 died first: rank unit active: its sglang::scheduler_TP0 (pid 778) ended; then "
        "spark3 (result signal, killed status 9; its engine: Connection closed by peer [192.168.241.11]:42374), "
        "spark2 (result signal, killed status 9; its engine: Read error [192.168.241.11]:42374: Connection reset "
        "by peer)")
    # without that evidence, time alone blamed spark3
    assert policy.first_failure([replace(e, peer_failure="") for e in (spark3, spark2, rank0)]).node == "spark3"
    # every rank lost a peer (a network failure): time decides, and the blamed rank says what it saw
    everyone = [spark3, spark2, replace(rank0, peer_failure="Connection closed by peer [192.168.241.12]:1")]
    blame = policy.first_failure(everyone)
    assert blame.node == "spark3" and "its engine: Connection closed by peer [192.168.241.11]" in blame.message
    # a rank stopped by its node's floor is still the cause
    floor = replace(ex("spark2", 10.5), floor="MemAvailable 0.4 GiB", peer_failure="closed by peer")
    assert policy.first_failure([rank0, floor]).node == "spark2"


def test_a_run_seen_lost_by_its_process_end_is_seen_again_when_its_floor_says_it_ended_it():
    # the floor's SIGTERM ends a real scheduler at once: its end can be reported before the cause
    lost = pb.RankState(active_state="active", invocation_id="inv-1", first_loss_at_unix_s=10.0,
                        first_loss_detail="sglang::scheduler_TP2 (pid 9)")
    first = policy.new_exit("spark3", lost, "inv-1", {}, now_unix_s=10.1)
    assert not first.floor
    floor = pb.RankState(active_state="deactivating", invocation_id="inv-1", first_loss_at_unix_s=10.0,
                         stopping_cause=pb.ExitInfo.MEMORY_FLOOR, stopping_detail="available 0.3 GB below ...")
    again = policy.new_exit("spark3", floor, "inv-1", {"spark3": first}, now_unix_s=10.2)
    assert again.floor == "available 0.3 GB below ..." and again.lost_at_unix_s == 10.0
    assert policy.first_failure([again, ex("spark1", 9.99)]).floor
    # once: the floor's exit, or one systemd reported, is not replaced
    assert policy.new_exit("spark3", floor, "inv-1", {"spark3": again}, now_unix_s=10.3) is None
    exited = ex("spark3", 10.0, ExitResult.SIGNAL, "killed", 9)
    assert policy.new_exit("spark3", floor, "inv-1", {"spark3": exited}, now_unix_s=10.3) is None


def test_blame_is_decided_on_the_result_not_on_message_text():
    # a clean exit whose words mention signals is still not "ended from outside"
    tricky = RankExit("spark1", "i", 10.0, ExitResult.EXIT_CODE, "result signal oom-kill", "exited", 1, "failed")
    blame = policy.first_failure([ex("spark2", 10.01), tricky])
    assert blame.node == "spark1"  # the earlier one: neither is external
    blame = policy.first_failure([tricky, ex("spark2", 10.02, ExitResult.SIGNAL, "killed", 9)])
    assert blame.node == "spark2"


def test_blame_needs_an_exit():
    with pytest.raises(ValueError):
        policy.first_failure([])


# ----- restarts

def test_restarts_back_off_exponentially_and_give_up_after_the_limit():
    plans = [policy.next_restart(n, max_attempts=3, backoff_s=30.0) for n in range(4)]
    assert [(p.attempt, p.delay_s, p.give_up) for p in plans] == [
        (1, 30.0, False), (2, 60.0, False), (3, 120.0, False), (4, 0.0, True)]
    assert policy.next_restart(0, max_attempts=0, backoff_s=1.0).give_up


def test_serving_long_enough_resets_the_attempts():
    now = 1_000_000.0
    assert policy.attempts_so_far(2, serving_since_unix_s=now - 601, now_unix_s=now) == 0
    assert policy.attempts_so_far(2, serving_since_unix_s=now - 599, now_unix_s=now) == 2
    assert policy.attempts_so_far(2, serving_since_unix_s=0.0, now_unix_s=now) == 2  # never served
    assert policy.attempts_so_far(3, now - 50, now, stable_s=30) == 0


@pytest.mark.parametrize("retryable, transient, retry", [
    (True, False, True), (False, True, True), (False, False, False), (True, True, True)])
def test_a_failure_is_retried_when_the_step_allows_it_or_it_was_transient(retryable, transient, retry):
    assert policy.retry_can_fix(retryable, transient) is retry


# ----- memory

def test_nodes_whose_memory_is_not_back():
    assert policy.memory_short({"spark1": 10, "spark2": 5, "spark3": None}, need_bytes=8) == ["spark2", "spark3"]
    assert policy.memory_short({"spark1": 8}, need_bytes=8) == []
