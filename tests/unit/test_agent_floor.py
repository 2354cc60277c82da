"""The node's last line (agent/floor.py): the decision, the thread with a scripted node, the
floor's place in the rank spec and in the exit the coordinator reads."""

from __future__ import annotations

import signal
import threading
import time
from types import SimpleNamespace

import pytest

from agent import floor as f
from agent.rank import MEMORY_FLOOR, ExitRecord
from agent.rankspec import NO_FLOOR, FloorSpec, SpecInvalid, check_floor, floor_from_fields, unit_properties
from agent.rpc_rank import exit_pb
from dsv41.v1 import agent_pb2 as pb

pytestmark = pytest.mark.unit
MB = 1_000_000
SPEC = FloorSpec(800 * MB, kill_after_s=1.0, interval_s=0.02)


def test_below_the_floor_sigterm_then_sigkill_once_memory_keeps_falling():
    st = f.FloorState()
    assert f.floor_step(SPEC, st, 900 * MB, 0.0) == (None, st)
    action, st = f.floor_step(SPEC, st, 790 * MB, 1.0)
    assert action == f.TERM and st.phase == f.TERMINATED and st.termed_level == 790 * MB
    assert f.floor_step(SPEC, st, 770 * MB, 1.2)[0] is None  # within the band: not yet "keeps falling"
    action, st = f.floor_step(SPEC, st, 790 * MB - 33 * (1 << 20), 1.3)
    assert action == f.KILL and st.phase == f.KILLED
    assert f.floor_step(SPEC, st, 0, 5.0)[0] is None  # once


def test_a_rank_still_running_at_the_deadline_is_killed_even_when_memory_stopped_falling():
    _, st = f.floor_step(SPEC, f.FloorState(), 790 * MB, 1.0)
    assert f.floor_step(SPEC, st, 795 * MB, 1.99)[0] is None
    assert f.floor_step(SPEC, st, 795 * MB, 2.0)[0] == f.KILL


class Rank:
    def __init__(self, invocation="run-1", spec=SPEC):
        self.current = (invocation, spec)
        self.causes = {}
        self.published = set()
        self.asked = 0  # passes of the floor's thread

    def floor(self):
        self.asked += 1
        return self.current

    def note_cause(self, invocation, cause, detail, publish=True):
        self.causes[invocation] = (cause, detail)
        if publish:
            self.published.add(invocation)

    def withdraw_cause(self, invocation):
        if invocation not in self.published:
            self.causes.pop(invocation, None)


class Sampler:
    def __init__(self, levels):
        self.levels = list(levels)
        self.read = threading.Event()

    def sample(self, details=True):
        level = self.levels.pop(0) if len(self.levels) > 1 else self.levels[0]
        if not self.levels[1:]:
            self.read.set()
        if isinstance(level, Exception):
            raise level
        return SimpleNamespace(available=level)


class Events:
    def __init__(self):
        self.entries = []

    def event(self, kind, message, priority="info", **fields):
        self.entries.append((kind, message, {**fields, "priority": priority}))


def run_floor(rank, levels, kill=None, events=None, until=lambda node: len(node.actions) >= 2):
    sent = []
    events = events or Events()
    node = f.NodeFloor(rank, Sampler(levels), kill or sent.append, events, "spark1", idle_poll_s=0.01, retry_s=0.01)
    node.start()
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and not until(node):
        time.sleep(0.01)
    node.stop()
    return node, sent, events


def test_the_thread_signals_the_rank_unit_notes_the_cause_and_journals_the_numbers():
    rank = Rank()
    node, sent, events = run_floor(rank, [900 * MB, 850 * MB, 790 * MB, 700 * MB, 600 * MB])
    assert sent == [signal.SIGTERM, signal.SIGKILL]
    assert node.actions == [(f.TERM, "run-1"), (f.KILL, "run-1")]
    cause, detail = rank.causes["run-1"]
    assert cause == MEMORY_FLOOR and "below MEMORY_FLOOR_GB 0.800 GB" in detail and "memory kept falling" in detail
    kinds = [k for k, _, _ in events.entries]
    assert kinds == ["memory_floor", "memory_floor"]
    fields = events.entries[0][2]
    assert fields["available_bytes"] == 790 * MB and fields["floor_bytes"] == 800 * MB and fields["signal"] == "SIGTERM"


def test_what_the_signal_reached_beside_the_unit_is_in_the_journal_line():
    def kill(signum):
        sent.append(signum)
        return "; sent also to the 3 process(es) of container 5c5c5c5c5c5c"
    sent = []
    node, _, events = run_floor(Rank(), [700 * MB, 600 * MB], kill=kill)
    assert sent == [signal.SIGTERM, signal.SIGKILL]
    messages = [m for k, m, _ in events.entries if k == "memory_floor"]
    assert len(messages) == 2 and all(m.endswith("3 process(es) of container 5c5c5c5c5c5c") for m in messages)


def test_no_rank_running_or_no_floor_means_nothing_is_read_or_sent():
    for current in (("", NO_FLOOR), ("run-1", NO_FLOOR)):
        rank = Rank()
        rank.current = current
        sampler = Sampler([0])
        node = f.NodeFloor(rank, sampler, lambda s: pytest.fail("signalled"), Events(), "spark1", idle_poll_s=0.01)
        node.start()
        deadline = time.monotonic() + 5
        while rank.asked < 5:  # five passes that could have read and signalled
            assert time.monotonic() < deadline, f"the floor's thread made {rank.asked} passes"
            time.sleep(0.01)
        node.stop()
        assert not sampler.read.is_set() and node.actions == []


def test_a_signal_that_fails_is_journalled_and_tried_again():
    calls = []

    def kill(signum):
        calls.append(signum)
        if len(calls) == 1:
            raise RuntimeError("systemd busy")
    rank = Rank()
    node, _, events = run_floor(rank, [700 * MB], kill=kill)
    assert calls[:2] == [signal.SIGTERM, signal.SIGTERM]
    kind, message, fields = events.entries[0]
    assert kind == "memory_floor_failed" and "systemd busy" in message and fields["priority"] == "err"
    assert fields["available_bytes"] == 700 * MB and fields["floor_bytes"] == 800 * MB


def test_the_cause_shows_only_once_the_signal_was_sent():
    rank = Rank()
    seen = []

    def kill(signum):
        seen.append((signum, set(rank.published), dict(rank.causes)))
        if len(seen) == 1:
            raise RuntimeError("systemd busy")
    run_floor(rank, [700 * MB], kill=kill)
    # held for a quick exit during the send, but not published; withdrawn when the send failed
    assert seen[0][1] == set() and "run-1" in seen[0][2]
    assert seen[1][1] == set() and "run-1" in seen[1][2]
    assert "run-1" in rank.published and rank.causes["run-1"][0] == MEMORY_FLOOR


def test_a_send_that_fails_and_is_never_sent_leaves_no_cause():
    rank = Rank()
    calls = []

    def kill(signum):
        calls.append(signum)
        raise RuntimeError("systemd busy")
    node, _, events = run_floor(rank, [700 * MB], kill=kill, until=lambda node: len(calls) >= 5)
    assert len(calls) >= 5 and rank.causes == {} and rank.published == set() and node.actions == []
    # the same failure, tried again every sample, is journalled once
    assert [k for k, _, _ in events.entries] == ["memory_floor_failed"]


def test_a_pass_that_fails_is_journalled_once_and_the_floor_keeps_guarding():
    rank = Rank()
    levels = [900 * MB, ValueError("invalid literal for int()"), ValueError("invalid literal for int()"),
              OSError("EIO"), 700 * MB, 600 * MB]
    node, sent, events = run_floor(rank, levels)
    assert sent == [signal.SIGTERM, signal.SIGKILL]
    failed = [(m, fl) for k, m, fl in events.entries if k == "memory_floor_failed"]
    assert len(failed) == 2 and all(fl["priority"] == "err" for _, fl in failed)
    assert "ValueError: invalid literal" in failed[0][0] and failed[1][1]["error"] == "OSError: EIO"
    assert failed[0][1]["available_bytes"] == 900 * MB and failed[0][1]["floor_bytes"] == 800 * MB


def test_unreadable_memory_is_journalled_once_per_episode_and_again_when_it_reads():
    rank = Rank()
    bad = f.MeminfoInvalid("no MemAvailable line")
    node, sent, events = run_floor(rank, [900 * MB, bad, bad, bad, 850 * MB, 700 * MB, 600 * MB])
    assert sent == [signal.SIGTERM, signal.SIGKILL]
    kinds = [k for k, _, _ in events.entries]
    assert kinds == ["memory_floor_unreadable", "memory_floor_readable", "memory_floor", "memory_floor"]
    unreadable, readable = events.entries[0][2], events.entries[1][2]
    assert unreadable["last_available_bytes"] == 900 * MB and unreadable["floor_bytes"] == 800 * MB
    assert readable["available_bytes"] == 850 * MB and readable["unreadable_s"] >= 0


def test_a_journal_that_blocks_does_not_hold_back_the_sigkill():
    release = threading.Event()

    class StuckJournal(Events):
        def event(self, kind, message, priority="info", **fields):
            assert release.wait(5)
            super().event(kind, message, priority, **fields)
    rank = Rank()
    events = StuckJournal()
    node = f.NodeFloor(rank, Sampler([700 * MB, 600 * MB]), [].append, events, "spark1", idle_poll_s=0.01)
    node.start()
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and len(node.actions) < 2:
        time.sleep(0.01)
    actions = list(node.actions)
    release.set()
    node.stop()
    assert actions == [(f.TERM, "run-1"), (f.KILL, "run-1")]
    assert [k for k, _, _ in events.entries] == ["memory_floor", "memory_floor"]  # written once it unblocked


def test_the_floor_is_checked_sent_with_the_unit_and_read_back_by_a_restarted_agent():
    assert check_floor(0, 0, 0) == NO_FLOOR
    spec = check_floor(800 * MB, 0, 0)
    assert spec == FloorSpec(800 * MB, 1.0, 0.02)
    for args, fragment in (((10 * MB, 0, 0), "64 MiB .. 1 TiB"), ((800 * MB, 50, 0), "100 .. 60000"),
                           ((800 * MB, 0, 5000), "10 .. 1000"), ((0, 1000, 0), "only with memory_floor_bytes")):
        with pytest.raises(SpecInvalid, match=fragment):
            check_floor(*args)
    launch = SimpleNamespace(rank=0, fingerprint="ab", generation="g", runtime="host", argv=("/usr/bin/x",),
                             stop_timeout_s=10, exec_start_pre=(), exec_stop_post=(), binds=(), memory_max=0,
                             memory_high=0, cache_dir="", floor=FloorSpec(800 * MB, 2.5, 0.05))
    props = dict((name, value) for name, _, value in unit_properties(launch, {}, "spark1", "/var/lib/dsv41"))
    assert floor_from_fields(props["LogExtraFields"]) == FloorSpec(800 * MB, 2.5, 0.05)
    assert floor_from_fields([b"DSV41_NODE=spark1"]) == NO_FLOOR


def test_the_exit_it_causes_says_so_on_the_wire():
    record = ExitRecord("signal", "killed", 9, 1.0, "run-1", MEMORY_FLOOR, "available 0.7 GB below ...")
    info = exit_pb(record)
    assert info.cause == pb.ExitInfo.MEMORY_FLOOR and info.cause_detail.startswith("available 0.7 GB")
    assert exit_pb(ExitRecord("exit-code", "exited", 1, 1.0, "run-2")).cause == pb.ExitInfo.CAUSE_UNSPECIFIED
