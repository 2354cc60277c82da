"""When the rank's run was lost on this node: the moment its first SGLang process ended.

That can be long before the unit exits, and the unit's exit is what the coordinator would
otherwise order nodes by. Seen on SGLang 0.5.23 over gloo: kill -9 of rank 0's scheduler made the
workers' schedulers fail at once on the broken socket and their launchers kill their own trees,
while rank 0's launcher first slept 5 s "for crash diagnostics"; every unit then ended with
SIGKILL (the launchers kill their own tree, themselves included), so by the units' exits a worker
died first. A process's end is seen through a pidfd (its exact moment), else by polling.

Watched: the unit's main process and the processes SGLang names `sglang::...` (scheduler,
detokenizer, ...), found in the unit's control group; short-lived helpers are not. When the main
process is the first to end nothing is noted: that is the unit's exit, which systemd reports.
"""

from __future__ import annotations

import os
import select
import threading
import time
from typing import Callable, Protocol

SCAN_S = 0.2  # how often the control group is read for new processes
SGLANG_TITLE = "sglang::"


class RankView(Protocol):
    def floor(self) -> tuple[str, object]: ...  # (invocation ID while the unit runs, ...)

    def main_pid(self) -> int: ...

    def control_group(self) -> str: ...

    def note_first_loss(self, invocation_id: str, at_unix_s: float, detail: str) -> None: ...


def process_title(proc_root: str, pid: int) -> str:
    """argv[0] as the process set it (SGLang's children set `sglang::scheduler_TP0`), "" if gone."""
    try:
        with open(f"{proc_root}/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0", 1)[0].decode(errors="replace")
    except OSError:
        return ""


def process_stopped(pid: int, proc_root: str = "/proc") -> bool:
    """Whether the process is stopped (state T or t in /proc/PID/stat); False when it cannot be
    read (gone, or in another PID namespace: a container's)."""
    try:
        with open(f"{proc_root}/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] in (b"T", b"t")


def watched(pid: int, main_pid: int, title: str) -> bool:
    return pid == main_pid or title.startswith(SGLANG_TITLE)


class ProcessTreeWatch:
    """A thread that tells the rank manager when the first watched process of a run ends."""

    def __init__(self, rank: RankView, cgroup_roots: tuple[str, ...], proc_root: str = "/proc",
                 clock: Callable[[], float] = time.time, scan_s: float = SCAN_S) -> None:
        self._rank = rank
        self._roots = cgroup_roots
        self._proc = proc_root
        self._clock = clock
        self._scan_s = scan_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="treewatch", daemon=True)
        self._invocation = ""
        # pid -> (pidfd or None, what it is, whether it is the unit's main process)
        self._watched: dict[int, tuple[int | None, str, bool]] = {}
        self._reported = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)
        self._forget()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.scan()
                self._wait()
            except Exception:  # noqa: BLE001 - a watcher's fault must not end the agent; try again
                self._stop.wait(self._scan_s)

    def _pids(self, group: str) -> list[int]:
        for root in self._roots:
            try:
                with open(f"{root}{group}/cgroup.procs") as f:
                    return [int(p) for p in f.read().split()]
            except OSError:
                continue
        return []

    def scan(self) -> None:
        """Follow the run now in the unit: new watched processes get a pidfd."""
        invocation = self._rank.floor()[0]
        if invocation != self._invocation:
            self._forget()
            self._invocation, self._reported = invocation, False
        if not invocation or self._reported:
            return
        main = self._rank.main_pid()
        for pid in self._pids(self._rank.control_group()):
            if pid in self._watched:
                continue
            title = process_title(self._proc, pid)
            if not watched(pid, main, title):
                continue
            try:
                fd: int | None = os.pidfd_open(pid)
            except OSError:  # gone already, or no pidfds here: polled instead
                fd = None
            self._watched[pid] = (fd, f"{title.split('/')[-1] or 'pid'} (pid {pid})", pid == main)

    def _wait(self) -> None:
        """Until a watched process ends or the next scan is due; reports the first end of the run."""
        fds = {fd: pid for pid, (fd, _, _) in self._watched.items() if fd is not None}
        if fds:
            ready = select.select(list(fds), [], [], self._scan_s)[0]
            ended = [fds[fd] for fd in ready]
        else:
            self._stop.wait(self._scan_s)
            ended = []
        ended += [pid for pid, (fd, _, _) in self._watched.items() if fd is None and not os.path.exists(
            f"{self._proc}/{pid}")]
        if ended and not self._reported:
            at = self._clock()
            self._reported = True
            # The main process's end is the unit's own exit, which systemd reports with its status
            # (known from the scan: by now systemd may already say MainPID=0).
            if not any(self._watched[p][2] for p in ended):
                self._rank.note_first_loss(self._invocation, at,
                                           " and ".join(self._watched[p][1] for p in sorted(ended)))
        for pid in ended:
            fd = self._watched.pop(pid)[0]
            if fd is not None:
                os.close(fd)

    def _forget(self) -> None:
        for fd, _, _ in self._watched.values():
            if fd is not None:
                os.close(fd)
        self._watched.clear()
