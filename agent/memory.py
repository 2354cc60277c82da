"""Memory samples for the guard: MemAvailable, the node cgroup's headroom, PSI, the rank's usage.

Reading is cheap on purpose (one small read per file, no psutil, files kept open and re-read with
pread), so 20-50 ms sampling costs a negligible share of a core. "Available" is the tighter of the
kernel's MemAvailable and what the node's own memory cgroup still allows: on a Spark the first one
binds, in a container (the test nodes) the second.
"""

from __future__ import annotations

import os
import select
import threading
import time
from dataclasses import dataclass
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


def parse_meminfo(text: bytes) -> tuple[int, int]:
    total = available = 0
    for line in text.split(b"\n"):
        if line.startswith(b"MemTotal:"):
            total = int(line.split()[1]) * 1024
        elif line.startswith(b"MemAvailable:"):
            available = int(line.split()[1]) * 1024
            break
    return total, available


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
    """Reads one Sample. Roots are constructor arguments so tests can point at fixture trees."""

    def __init__(self, proc_root: str = "/proc", cgroup_root: str = "/sys/fs/cgroup",
                 rank_memory: Callable[[], int] = lambda: 0, clock: Callable[[], float] = time.monotonic):
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

    def sample(self, psi_triggered: bool = False) -> Sample:
        total, available = parse_meminfo(self._meminfo.read() or b"")
        pressure = self._pressure.read()
        some, full = parse_pressure(pressure) if pressure else (NO_PRESSURE, NO_PRESSURE)
        limit = _int(self._limit.read())
        usage = _int(self._usage.read()) or 0
        if limit is None or limit >= UNLIMITED or limit >= total > 0:
            limit = 0
        headroom = available if not limit else min(available, max(0, limit - usage))
        return Sample(self._clock(), total, available, limit, usage if limit else 0, headroom, some, full,
                      self._rank_memory(), psi_triggered)

    def close(self) -> None:
        for f in (self._meminfo, self._pressure, self._limit, self._usage):
            f.close()


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
