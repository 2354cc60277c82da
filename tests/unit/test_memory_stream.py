"""WatchMemory's loop in-process: a PSI trigger cuts the wait short and its sample is sent even when
nothing moved; the stream ends when the client goes away and leaves no listener behind."""

from __future__ import annotations

import os
import threading
import time

import pytest

from agent import memory
from agent.rpc_memory import MemoryRpcs
from dsv41.v1 import agent_pb2 as pb

pytestmark = pytest.mark.unit


class Triggers:
    """Stands in for the TriggerWatcher (a kernel PSI trigger fires only under a real memory stall)."""

    def __init__(self):
        self.listeners = []

    def add(self, listener):
        self.listeners.append(listener)
        return lambda: self.listeners.remove(listener)

    def fire(self):
        for listener in list(self.listeners):
            listener()


class Context:
    def __init__(self):
        self.active = True

    def is_active(self):
        return self.active

    def abort(self, code, details):
        raise AssertionError(f"aborted: {code}: {details}")


def service(tmp_path, triggers, monotonic=time.monotonic):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text("MemTotal: 1000000 kB\nMemAvailable: 500000 kB\n")
    (tmp_path / "proc/pressure").mkdir()
    (tmp_path / "proc/pressure/memory").write_text("some avg10=1.25 avg60=0.00 avg300=0.00 total=4242\n")
    sampler = memory.MemorySampler(str(tmp_path / "proc"), str(tmp_path / "cg"))
    return MemoryRpcs(sampler, triggers, monotonic=monotonic)


@pytest.mark.parametrize("send", [{}, {"min_change_bytes": 1 << 30, "heartbeat_ms": 10_000}])
def test_a_psi_trigger_sends_a_sample_at_once_between_ticks(tmp_path, send):
    triggers, context = Triggers(), Context()
    stream = service(tmp_path, triggers).WatchMemory(
        pb.WatchMemoryRequest(interval_ms=5_000, psi_trigger=True, **send), context)
    first = next(stream)
    assert not first.psi_triggered and first.available_bytes == 500000 * 1024
    assert first.some.avg10 == 1.25 and first.some.total_us == 4242  # read for what is sent, in both modes
    threading.Timer(0.05, triggers.fire).start()
    t0 = time.monotonic()
    pushed = next(stream)
    assert pushed.psi_triggered and time.monotonic() - t0 < 2.5  # not the 5 s tick
    assert pushed.some.total_us == 4242
    assert (first.seq, pushed.seq) == (1, 2)  # the pushed sample counts as one taken
    context.active = False  # the client went away: the loop ends at its next check
    with pytest.raises(StopIteration):
        next(stream)
    assert triggers.listeners == []


def test_without_psi_trigger_no_listener_is_added(tmp_path):
    triggers, context = Triggers(), Context()
    stream = service(tmp_path, triggers).WatchMemory(pb.WatchMemoryRequest(interval_ms=20), context)
    assert not next(stream).psi_triggered and triggers.listeners == []
    context.active = False
    stream.close()


def rewrite_in_place(path, text):
    """New content of the same length, written over the old in one write: a reader never sees the
    file empty or cut short, as it could after a truncating write_text. Not os.replace: the sampler
    keeps the file open, as it does /proc/meminfo, and would go on reading the old one."""
    data = text.encode()
    assert len(data) == path.stat().st_size
    fd = os.open(path, os.O_WRONLY)
    try:
        assert os.pwrite(fd, data, 0) == len(data)
    finally:
        os.close(fd)


def test_seq_counts_the_samples_taken_so_a_client_sees_how_many_were_not_sent(tmp_path):
    triggers, context = Triggers(), Context()
    meminfo = tmp_path / "proc/meminfo"
    stream = service(tmp_path, triggers).WatchMemory(
        pb.WatchMemoryRequest(interval_ms=20, min_change_bytes=100 << 20, heartbeat_ms=60_000), context)
    assert next(stream).seq == 1  # the first sample is always sent
    threading.Timer(0.2, rewrite_in_place, [meminfo, "MemTotal: 1000000 kB\nMemAvailable: 300000 kB\n"]).start()
    moved = next(stream)  # held back until available fell by 195 MiB, some ten ticks later
    assert moved.available_bytes == 300000 * 1024 and moved.seq > 5
    context.active = False
    stream.close()


def test_a_missed_tick_is_taken_at_once_not_an_interval_later(tmp_path):
    """The reader (or the CPU) held the loop past its next tick: the next sample comes at once, and
    the cadence resumes from it. Waiting a further interval would leave a node that falls fast
    unseen for up to two intervals (the memory guard's slowest reactions)."""
    triggers, context = Triggers(), Context()
    clock = {"now": 100.0}
    stream = service(tmp_path, triggers, monotonic=lambda: clock["now"]).WatchMemory(
        pb.WatchMemoryRequest(interval_ms=1_000), context)
    assert next(stream).seq == 1
    clock["now"] += 1.4  # the consumer took 1.4 s to come back: the 1 s tick is 0.4 s overdue
    t0 = time.monotonic()
    late = next(stream)
    assert late.seq == 2 and time.monotonic() - t0 < 0.5, "the overdue tick waited a further interval"
    clock["now"] += 0.25  # back on cadence: the next tick is 1 s after the late one, 0.75 s from here
    got = []
    reader = threading.Thread(target=lambda: got.append(next(stream)), daemon=True)
    reader.start()
    reader.join(0.4)
    assert not got, "a tick on cadence came early: the missed ticks were replayed as a burst"
    reader.join(2.0)
    assert [s.seq for s in got] == [3]
    context.active = False
    stream.close()
