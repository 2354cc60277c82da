"""Memory samples for the guard: MemAvailable, the node cgroup's headroom, PSI, the rank's usage.

Reading is cheap on purpose (one small read per file, no psutil, files kept open and re-read with
pread). What costs is sending: a gRPC message costs more CPU than reading a sample, so a stream can
send only the samples that moved (SendPolicy) while still sampling every 20-50 ms. "Available" is
the tighter of the kernel's MemAvailable and what the node's own memory cgroup still allows: on a
Spark the first one binds, in a container (the test nodes) the second.
"""

from __future__ import annotations

import math
import os
import select
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable

UNLIMITED = 1 << 62  # cgroup v1 reports "no limit" as a page-rounded 2^63-1


@dataclass(frozen=True)
class Pressure:
    avg10: float
    avg60: float
    avg300: float
    total_us: int


NO_PRESSURE = Pressure(0.0, 0.0, 0.0, 0)


@dataclass(frozen=True)
class Sample:
    at_monotonic_s: float
    mem_total: int
    mem_available: int
    cgroup_limit: int  # 0: none
    cgroup_usage: int
    available: int
    some: Pressure
    full: Pressure
    rank_memory: int  # 0: unknown
    psi_triggered: bool = False
    seq: int = 0  # the stream's count of samples taken (0: not from a stream)


MEMINFO_READS = 3


def _meminfo_field(text: bytes, name: bytes) -> int:
    start = text.find(b"\n" + name)
    if start < 0 and text.startswith(name):
        start = -1
    elif start < 0:
        return 0
    start += 1 + len(name)
    end = text.find(b"\n", start)
    fields = text[start:end if end >= 0 else len(text)].split()
    return int(fields[0]) * 1024 if fields else 0


class MeminfoInvalid(ValueError):
    """/proc/meminfo (or a tree standing in for it) has no MemAvailable line."""


def parse_meminfo(text: bytes) -> tuple[int, int]:
    """MemTotal (0 when absent) and MemAvailable in bytes; finds the two lines rather than splitting
    all fifty, since this runs 20-50 times a second. Without MemAvailable it raises MeminfoInvalid:
    read as 0 it would look like a node out of memory, and the guard would act on it."""
    if not (text.startswith(b"MemAvailable:") or b"\nMemAvailable:" in text):
        raise MeminfoInvalid(f"no MemAvailable line in {len(text)} bytes of meminfo")
    return _meminfo_field(text, b"MemTotal:"), _meminfo_field(text, b"MemAvailable:")


def parse_pressure(text: bytes) -> tuple[Pressure, Pressure]:
    some, full = NO_PRESSURE, NO_PRESSURE
    for line in text.split(b"\n"):
        parts = line.split()
        if not parts:
            continue
        fields = dict(p.split(b"=", 1) for p in parts[1:])
        value = Pressure(float(fields[b"avg10"]), float(fields[b"avg60"]), float(fields[b"avg300"]),
                         int(fields[b"total"]))
        if parts[0] == b"some":
            some = value
        elif parts[0] == b"full":
            full = value
    return some, full


class _File:
    """An open file re-read from offset 0 each time; absent files read as None."""

    def __init__(self, path: str):
        try:
            self._fd: int | None = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._fd = None

    def read(self) -> bytes | None:
        if self._fd is None:
            return None
        try:
            return os.pread(self._fd, 4096, 0)
        except OSError:
            return None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _int(data: bytes | None) -> int | None:
    if not data:
        return None
    text = data.strip()
    if text == b"max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


class MemorySampler:
    """Reads one Sample. Roots are constructor arguments so tests can point at fixture trees.

    The node cgroup's limit is re-read at most every `limit_refresh_s` (it changes only when an
    operator sets it), and its usage is read only while there is a limit: on a Spark the root
    cgroup has none, so a sample is two small reads.
    """

    def __init__(self, proc_root: str = "/proc", cgroup_root: str = "/sys/fs/cgroup",
                 rank_memory: Callable[[], int] = lambda: 0, clock: Callable[[], float] = time.monotonic,
                 limit_refresh_s: float = 1.0):
        self._meminfo = _File(f"{proc_root}/meminfo")
        self._pressure = _File(f"{proc_root}/pressure/memory")
        # cgroup v2 at the root the node sees, else v1's memory controller
        if os.path.exists(f"{cgroup_root}/memory.max") or os.path.exists(f"{cgroup_root}/cgroup.controllers"):
            self._limit, self._usage = _File(f"{cgroup_root}/memory.max"), _File(f"{cgroup_root}/memory.current")
        else:
            self._limit = _File(f"{cgroup_root}/memory/memory.limit_in_bytes")
            self._usage = _File(f"{cgroup_root}/memory/memory.usage_in_bytes")
        self._rank_memory = rank_memory
        self._clock = clock
        self._limit_refresh_s = limit_refresh_s
        self._limit_value: int | None = None
        self._limit_read_at = float("-inf")

    def _cgroup_limit(self, now: float, total: int) -> int:
        if now - self._limit_read_at >= self._limit_refresh_s or now < self._limit_read_at:
            self._limit_value, self._limit_read_at = _int(self._limit.read()), now
        limit = self._limit_value
        return 0 if limit is None or limit >= UNLIMITED or limit >= total > 0 else limit

    def sample(self, psi_triggered: bool = False, details: bool = True, seq: int = 0) -> Sample:
        """details False: only what "available" needs (PSI zero, rank memory unknown), for a stream
        that decides on available first and reads the rest with with_details() for what it sends.
        seq: the stream's count of samples taken, carried in the sample."""
        now = self._clock()
        total, available = self._meminfo_values()
        limit = self._cgroup_limit(now, total)
        usage = (_int(self._usage.read()) or 0) if limit else 0
        headroom = available if not limit else min(available, max(0, limit - usage))
        sample = Sample(now, total, available, limit, usage, headroom, NO_PRESSURE, NO_PRESSURE, 0, psi_triggered,
                        seq)
        return self.with_details(sample) if details else sample

    def _meminfo_values(self) -> tuple[int, int]:
        # The kernel makes /proc/meminfo whole on each read; a file standing in for it may be
        # caught mid-rewrite, so a read without MemAvailable is tried again before it counts.
        for attempt in range(MEMINFO_READS):
            try:
                return parse_meminfo(self._meminfo.read() or b"")
            except MeminfoInvalid:
                if attempt == MEMINFO_READS - 1:
                    raise
        raise AssertionError("unreachable")

    def with_details(self, sample: Sample) -> Sample:
        """The sample with PSI and the rank's memory read now."""
        pressure = self._pressure.read()
        some, full = parse_pressure(pressure) if pressure else (NO_PRESSURE, NO_PRESSURE)
        return replace(sample, some=some, full=full, rank_memory=self._rank_memory())

    def close(self) -> None:
        for f in (self._meminfo, self._pressure, self._limit, self._usage):
            f.close()


class RankMemoryReader:
    """The rank unit's cgroup memory usage (0: unknown), read directly: cheaper than a D-Bus call per
    sample. The file stays open while the unit keeps its control group; a failed read (the group was
    removed and made again when the rank restarted) reopens it on the next call."""

    def __init__(self, control_group: Callable[[], str], cgroup_root: str = "/sys/fs/cgroup"):
        self._control_group = control_group
        self._root = cgroup_root
        self._group: str | None = None
        self._file: _File | None = None

    def __call__(self) -> int:
        group = self._control_group()
        if group != self._group:
            self._open(group)
        data = self._file.read() if self._file is not None else None
        if data is None:
            self._group = None  # try again next time
            return 0
        return _int(data) or 0

    def _open(self, group: str) -> None:
        self.close()
        self._group = group
        if not group:
            return
        for path in (f"{self._root}{group}/memory.current", f"{self._root}/memory{group}/memory.usage_in_bytes"):
            candidate = _File(path)
            if candidate.read() is not None:
                self._file = candidate
                return
            candidate.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


@dataclass(frozen=True)
class SendPolicy:
    """Which samples a memory stream transmits. min_change_bytes 0: every one.

    Otherwise a sample is sent when the available bytes (what the guard acts on) moved at least
    min_change_bytes from the last one sent, when a PSI trigger pushed it, or when heartbeat_s has
    passed since the last one sent. A sample sent for a change is preceded by the samples held back
    since the last one sent (the most recent `replay`) and followed by the next `follow` samples
    whatever they are, so a consumer fitting a trend or confirming over consecutive samples sees
    every sample around a change, while a quiet node costs one message per heartbeat instead of one
    per sample: on gRPC each message costs far more CPU than reading the sample.
    """
    min_change_bytes: int = 0
    heartbeat_s: float = 1.0
    replay: int = 0
    follow: int = 0


class ChangeFilter:
    """Applies a SendPolicy to a sequence of samples; pure (no clock but the samples' own)."""

    def __init__(self, policy: SendPolicy):
        self._policy = policy
        self._held: deque[Sample] = deque(maxlen=max(0, policy.replay))
        self._last: Sample | None = None
        self._following = 0

    def offer(self, sample: Sample) -> list[Sample]:
        """The samples to transmit now, oldest first (often none)."""
        p, last = self._policy, self._last
        if p.min_change_bytes <= 0 or last is None:
            return self._send([sample])
        if abs(sample.available - last.available) >= p.min_change_bytes or sample.psi_triggered:
            self._following = p.follow
            return self._send([*self._held, sample])
        if self._following > 0:
            self._following -= 1
            return self._send([sample])
        if sample.at_monotonic_s - last.at_monotonic_s >= p.heartbeat_s:
            return self._send([sample])
        if self._held.maxlen:
            self._held.append(sample)
        return []

    def _send(self, samples: list[Sample]) -> list[Sample]:
        self._held.clear()
        self._last = samples[-1]
        return samples


class PsiTrigger:
    """A kernel PSI trigger on memory pressure; `wait()` blocks until it fires or the timeout passes.

    Without CAP_SYS_RESOURCE the window must be a multiple of 2 s, and the written string must end
    with a NUL byte; a trigger alone therefore reacts in seconds, which is why it only supplements
    the fast MemAvailable sampling.
    """

    def __init__(self, path: str = "/proc/pressure/memory", stall_us: int = 150_000, window_us: int = 2_000_000):
        self.error: str | None = None
        self._fd: int | None = None
        try:
            fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
            os.write(fd, f"some {stall_us} {window_us}".encode() + b"\0")
            self._fd = fd
            self._poll = select.poll()
            self._poll.register(fd, select.POLLPRI)
        except OSError as exc:
            self.error = f"{path}: {exc.strerror}"

    @property
    def armed(self) -> bool:
        return self._fd is not None

    def wait(self, timeout_s: float) -> bool:
        if self._fd is None:
            time.sleep(timeout_s)
            return False
        events = self._poll.poll(int(timeout_s * 1000))
        for _, mask in events:
            if mask & select.POLLERR:
                self.close()
                self.error = "the pressure source went away"
                return False
            if mask & select.POLLPRI:
                return True
        return False

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class Wakeup:
    """A timed wait that another thread can cut short: an eventfd polled with a timeout. One poll
    per tick costs a fraction of threading.Event.wait's lock dance, which matters at 20-50 ticks a
    second (bench/agent_footprint)."""

    def __init__(self):
        self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._poll = select.poll()
        self._poll.register(self._fd, select.POLLIN)
        self._lock = threading.Lock()  # a set() racing close() must not write to a reused fd number

    def set(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.eventfd_write(self._fd, 1)

    def wait(self, timeout_s: float) -> bool:
        """True when set (and then cleared) before the timeout passed."""
        if not self._poll.poll(max(0, math.ceil(timeout_s * 1000))):
            return False
        try:
            os.eventfd_read(self._fd)
        except BlockingIOError:
            return False
        return True

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


class TriggerWatcher:
    """One thread waiting on a PSI trigger and calling every listener when it fires."""

    def __init__(self, trigger: PsiTrigger):
        self._trigger = trigger
        self._listeners: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, listener: Callable[[], None]) -> Callable[[], None]:
        with self._lock:
            self._listeners.append(listener)
            if self._thread is None and self._trigger.armed:
                self._thread = threading.Thread(target=self._run, name="psi-trigger", daemon=True)
                self._thread.start()

        def remove() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)
        return remove

    def _run(self) -> None:
        while not self._stopped.is_set() and self._trigger.armed:
            if self._trigger.wait(1.0):
                with self._lock:
                    listeners = list(self._listeners)
                for listener in listeners:
                    listener()

    def stop(self) -> None:
        self._stopped.set()
