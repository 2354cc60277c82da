"""The rank's state after an exit is systemd's newest word, whatever order the reads come back in.

An exit is recorded by a read of the unit's properties off the signal thread. A stop that finds
the unit failed resets it and re-reads it (the unit is gone) meanwhile; the exit's read, begun
before the reset, must not put the unit back as "failed": the coordinator's stop confirmation
would then say a stopped rank may still run. systemd's D-Bus is scripted here (the interleaving
is the point); the agent's integration tests run the same code against a real systemd."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from agent.rank import MEMORY_FLOOR, RankManager
from agent.rankspec import RANK_UNIT
from agent.systemd import NO_SUCH_UNIT, UNIT_IFACE, SystemdError, unit_path
from dsv41.journal import EventLog

pytestmark = pytest.mark.unit

INVOCATION = bytes.fromhex("ab" * 16)
ACTIVE = {"LoadState": "loaded", "ActiveState": "active", "SubState": "running", "InvocationID": INVOCATION,
          "MainPID": 4242}
FAILED = {**ACTIVE, "ActiveState": "failed", "SubState": "failed", "MainPID": 0, "Result": "exit-code",
          "ExecMainCode": 1, "ExecMainStatus": 1, "ExecMainExitTimestamp": 1_700_000_000_000_000}


class ScriptedSystemd:
    """The few calls RankManager makes, over one unit whose properties the test sets; a read can
    be held (`hold_next_read`) to return what it saw when it began, later."""

    def __init__(self, props: dict | None):
        self.props = props
        self.resets = 0
        self.stops = 0
        self.ends_before_stop = False
        self.on_stop = None  # (): the unit's fate while a stop is in flight, scripted by the test
        self._signal = None
        self._hold: threading.Event | None = None
        self.read_begun = threading.Event()

    def on_properties_changed(self, callback) -> None:
        self._signal = callback

    def on_reconnect(self, callback) -> None:
        pass

    def hold_next_read(self) -> threading.Event:
        self._hold = threading.Event()
        return self._hold

    def properties(self, name: str, interfaces) -> dict | None:
        seen = None if self.props is None else dict(self.props)
        hold, self._hold = self._hold, None
        if hold is not None:
            self.read_begun.set()
            assert hold.wait(5)
        return seen

    def reset_failed(self, name: str) -> None:
        self.resets += 1
        if self.props is not None and self.props["ActiveState"] == "failed":
            self.props = None  # a transient unit is garbage-collected once reset

    def stop(self, name: str, timeout_s: float):
        self.stops += 1
        if self.ends_before_stop:
            self.props = None  # it exited cleanly and systemd unloaded it just before the call
        if self.props is None:
            raise SystemdError(f"Unit {name} not loaded.", NO_SUCH_UNIT)
        if self.on_stop is not None:
            self.on_stop()
            return SimpleNamespace(result="done", job="/job/1")
        raise AssertionError("this script only covers a unit that is gone when the stop arrives")

    def emit(self, changed: dict) -> None:
        self.props = {**(self.props or {}), **changed}
        self._signal(unit_path(RANK_UNIT), UNIT_IFACE, changed)


def manager(systemd: ScriptedSystemd) -> RankManager:
    rank = RankManager(systemd, "spark2", EventLog("dsv41-agent", {}, sender=lambda **e: None), "/tmp")
    rank.refresh()
    return rank


def wait_exits(rank: RankManager, n: int) -> None:
    deadline = time.monotonic() + 5
    while rank._exits < n:
        assert time.monotonic() < deadline, "the exit was never recorded"
        time.sleep(0.01)


def test_an_exit_read_that_returns_after_the_units_reset_does_not_bring_back_failed():
    systemd = ScriptedSystemd(dict(ACTIVE))
    rank = manager(systemd)
    release = systemd.hold_next_read()
    systemd.props = dict(FAILED)
    systemd.emit({"ActiveState": "failed", "SubState": "failed"})  # the worker ended by itself
    assert systemd.read_begun.wait(5)
    outcome, record, _ = rank.stop(5.0)   # the coordinator's stop: finds it failed, resets it
    assert outcome == "WAS_NOT_RUNNING" and systemd.props is None
    assert rank.status().active_state == "absent"
    release.set()                        # the exit's read, begun before the reset, comes back
    wait_exits(rank, 1)
    assert rank.settled_status().active_state == "absent"
    assert rank.status().last_exit.result == "exit-code" and rank.status().last_exit.status == 1


def test_a_rank_that_failed_by_itself_reads_absent_once_the_agent_reset_it():
    systemd = ScriptedSystemd(dict(ACTIVE))
    rank = manager(systemd)
    systemd.props = dict(FAILED)
    systemd.emit({"ActiveState": "failed", "SubState": "failed"})
    wait_exits(rank, 1)
    deadline = time.monotonic() + 5
    while systemd.resets == 0 or rank.status().active_state != "absent":
        assert time.monotonic() < deadline, (systemd.resets, rank.status().active_state)
        time.sleep(0.01)
    assert rank.status().last_exit.invocation_id == INVOCATION.hex()


def test_a_newer_signal_during_the_exit_read_is_kept_too():
    systemd = ScriptedSystemd(dict(ACTIVE))
    rank = manager(systemd)
    release = systemd.hold_next_read()
    systemd.emit({"ActiveState": "inactive", "SubState": "dead"})
    assert systemd.read_begun.wait(5)
    systemd.emit({"ActiveState": "activating", "SubState": "start", "InvocationID": INVOCATION})  # newer news
    release.set()
    wait_exits(rank, 1)
    assert rank.status().active_state == "activating"


def test_a_rank_that_ends_between_the_read_and_the_stop_is_reported_not_running():
    # Seen on the cluster tier: a thawed node's rank ended by itself (status 0, so its transient unit
    # was unloaded at once) while the coordinator's StopRank was between its read and StopUnit.
    systemd = ScriptedSystemd(dict(ACTIVE))
    rank = manager(systemd)
    systemd.ends_before_stop = True
    outcome, _, leftover = rank.stop(5.0)
    assert systemd.stops == 1
    assert (outcome, leftover) == ("WAS_NOT_RUNNING", 0)
    assert rank.status().active_state == "absent"


def test_a_floor_stop_that_a_stop_request_records_keeps_the_floor_as_its_cause():
    # The coordinator sees stopping_cause, waits SETTLE_S and sends StopRank while the floor's
    # SIGKILL lands: the unit fails, the exit's read records it, then the stop finds the unit
    # failed and records the exit again before resetting it. Both records carry the cause.
    systemd = ScriptedSystemd(dict(ACTIVE))
    rank = manager(systemd)
    detail = "available 0.700 GB below MEMORY_FLOOR_GB 0.800 GB: SIGTERM"
    rank.note_cause(INVOCATION.hex(), MEMORY_FLOOR, detail)
    assert rank.status().stopping_cause == MEMORY_FLOOR

    def killed_during_the_stop():
        systemd.props = {**FAILED, "Result": "signal", "ExecMainCode": 2, "ExecMainStatus": 9}
        systemd.emit({"ActiveState": "failed", "SubState": "failed"})
        wait_exits(rank, 1)  # the exit's own read is done first
    systemd.on_stop = killed_during_the_stop
    outcome, record, _ = rank.stop(5.0)
    assert systemd.resets == 1 and rank.status().active_state == "absent"
    assert (record.invocation_id, record.status) == (INVOCATION.hex(), 9)
    assert (record.cause, record.cause_detail) == (MEMORY_FLOOR, detail)
    last = rank.settled_status().last_exit
    assert (last.cause, last.cause_detail) == (MEMORY_FLOOR, detail)


def test_a_floor_stopped_unit_found_failed_by_the_next_stop_keeps_the_floor_as_its_cause():
    systemd = ScriptedSystemd(dict(ACTIVE))
    rank = manager(systemd)
    rank.note_cause(INVOCATION.hex(), MEMORY_FLOOR, "below")
    release = systemd.hold_next_read()
    systemd.props = dict(FAILED)
    systemd.emit({"ActiveState": "failed", "SubState": "failed"})
    assert systemd.read_begun.wait(5)
    outcome, record, _ = rank.stop(5.0)  # finds it failed: records the exit and resets it
    assert outcome == "WAS_NOT_RUNNING" and record.cause == MEMORY_FLOOR
    release.set()
    wait_exits(rank, 1)
    assert rank.settled_status().last_exit.cause == MEMORY_FLOOR


def test_a_cause_held_for_a_signal_not_yet_sent_is_not_the_stopping_cause_and_can_be_withdrawn():
    systemd = ScriptedSystemd(dict(ACTIVE))
    rank = manager(systemd)
    heard = []
    rank.watch(heard.append)
    rank.note_cause(INVOCATION.hex(), MEMORY_FLOOR, "below", publish=False)  # before the floor's send
    assert rank.status().stopping_cause == "" and heard == []
    rank.withdraw_cause(INVOCATION.hex())  # the send failed
    systemd.props = dict(FAILED)
    systemd.emit({"ActiveState": "failed", "SubState": "failed"})  # the rank ends by itself
    wait_exits(rank, 1)
    assert rank.settled_status().last_exit.cause == ""


def test_a_cause_published_once_its_signal_was_sent_is_heard_at_once_and_stays():
    systemd = ScriptedSystemd(dict(ACTIVE))
    rank = manager(systemd)
    heard = []
    rank.watch(heard.append)
    rank.note_cause(INVOCATION.hex(), MEMORY_FLOOR, "below", publish=False)
    rank.note_cause(INVOCATION.hex(), MEMORY_FLOOR, "below")  # sent
    assert rank.status().stopping_cause == MEMORY_FLOOR and [s.stopping_cause for s in heard] == [MEMORY_FLOOR]
    rank.note_cause(INVOCATION.hex(), MEMORY_FLOOR, "below; SIGKILL", publish=False)  # the SIGKILL's send
    rank.withdraw_cause(INVOCATION.hex())  # failed: the SIGTERM sent still stands
    assert rank.status().stopping_cause == MEMORY_FLOOR and len(heard) == 1
