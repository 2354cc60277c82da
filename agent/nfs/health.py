"""Mount health: run the probe child with a deadline, and judge what it saw.

The child (agent.nfs.probe) may block in the kernel on a stale mount. At the deadline it is
sent SIGKILL; a process in uninterruptible sleep does not die from that, so it is not waited
for: it is remembered as stuck, reaped once it finally exits, and while it is stuck no second
probe is started on the same mount (each would only get stuck too).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

PROBE_ARGV = (sys.executable, "-m", "agent.nfs.probe")
# The directory holding the `agent` package, so the child finds it whatever its cwd.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def probe_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p)
    return env
# Errors that mean the server or file system stopped answering, not that the content is wrong.
STALE_ERRNOS = frozenset({"ESTALE", "EIO", "ETIMEDOUT", "ENOTCONN", "EHOSTDOWN", "EHOSTUNREACH", "ECONNREFUSED",
                          "ECONNABORTED", "ECONNRESET", "ENETUNREACH"})

HEALTHY, WRONG_CONTENT, STALE = "healthy", "wrong_content", "stale"


@dataclass(frozen=True)
class ProbeOutcome:
    finished: bool                # the child answered within the deadline
    result: dict | None           # its result, when it finished
    step: str                     # the last step it announced (where it blocked, when not finished)
    stuck_pid: int = 0            # the child that would not die (0: none)
    reused: bool = False          # no new child: an earlier one is still stuck on this mount
    error: str = ""               # the child failed without a result (e.g. could not start)


@dataclass(frozen=True)
class Health:
    state: str                    # healthy, wrong_content, stale
    detail: str
    shards_seen: int = 0


@dataclass
class _Stuck:
    proc: subprocess.Popen
    key: str
    step: str
    since: float


@dataclass
class _Flight:
    done: threading.Event = field(default_factory=threading.Event)
    outcome: ProbeOutcome | None = None


class ProbeRunner:
    def __init__(self, argv: Sequence[str] = PROBE_ARGV, timeout_s: float = 5.0, kill_wait_s: float = 0.5,
                 max_stuck: int = 4, kill: Callable[[int, int], None] = os.kill,
                 monotonic: Callable[[], float] = time.monotonic):
        self._argv = tuple(argv)
        self.timeout_s = timeout_s
        self._kill_wait = kill_wait_s
        self._max_stuck = max_stuck
        self._kill = kill
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._stuck: list[_Stuck] = []
        self._flights: dict[str, _Flight] = {}

    def stuck(self) -> list[tuple[int, str, float]]:
        """(pid, step, seconds stuck) of children still blocked; reaps the ones that exited."""
        with self._lock:
            self._reap()
            now = self._monotonic()
            return [(s.proc.pid, s.step, now - s.since) for s in self._stuck]

    def _reap(self) -> None:
        self._stuck = [s for s in self._stuck if s.proc.poll() is None]

    def run(self, path: str, expected: int, key: str) -> ProbeOutcome:
        """Probes `path`. Concurrent calls for one key share one child. `key` names the mount
        instance (a remount gets a new key, so a probe stuck on the old one does not block it)."""
        with self._lock:
            self._reap()
            for s in self._stuck:
                if s.key == key:
                    return ProbeOutcome(False, None, s.step, s.proc.pid, reused=True)
            if len(self._stuck) >= self._max_stuck:
                s = self._stuck[-1]
                return ProbeOutcome(False, None, s.step, s.proc.pid, reused=True,
                                    error=f"{len(self._stuck)} probes are stuck in the kernel; not starting more")
            flight = self._flights.get(key)
            leader = flight is None
            if leader:
                flight = self._flights[key] = _Flight()
        assert flight is not None
        if not leader:
            flight.done.wait(self.timeout_s + self._kill_wait + 5.0)
            return flight.outcome or ProbeOutcome(False, None, "", error="probe did not report")
        outcome = None
        try:
            outcome = self._spawn(path, expected, key)
        finally:
            with self._lock:
                del self._flights[key]
            flight.outcome = outcome
            flight.done.set()  # also when spawning raised: followers must not wait for nothing
        return outcome

    def _spawn(self, path: str, expected: int, key: str) -> ProbeOutcome:
        try:
            proc = subprocess.Popen([*self._argv, path, str(expected)], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd="/", close_fds=True,
                                    start_new_session=True, env=probe_env())
        except OSError as exc:
            return ProbeOutcome(False, None, "", error=f"cannot start the probe: {exc}")
        assert proc.stdout is not None
        deadline = self._monotonic() + self.timeout_s
        buffer = b""
        eof = False
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while not eof:
                left = deadline - self._monotonic()
                if left <= 0:
                    break
                if sel.select(left):
                    chunk = os.read(proc.stdout.fileno(), 65536)
                    eof = not chunk
                    buffer += chunk
        proc.stdout.close()
        step, result = _parse(buffer)
        if eof:  # it closed its output: it is exiting, give it until the deadline
            try:
                proc.wait(max(self._kill_wait, deadline - self._monotonic()))
            except subprocess.TimeoutExpired:
                pass
        if proc.poll() is None:
            try:
                self._kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                proc.wait(self._kill_wait)
            except subprocess.TimeoutExpired:
                with self._lock:
                    self._stuck.append(_Stuck(proc, key, step, self._monotonic()))
                return ProbeOutcome(False, None, step, proc.pid)
            if result is None:
                return ProbeOutcome(False, None, step)
        if result is None:
            return ProbeOutcome(False, None, step, error=f"probe exited with status {proc.returncode} "
                                                          "without a result")
        return ProbeOutcome(True, result, step)


def _parse(buffer: bytes) -> tuple[str, dict | None]:
    step, result = "", None
    for line in buffer.decode("utf-8", "replace").splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "step":
            step = rest
        elif kind == "result":
            try:
                result = json.loads(rest)
            except ValueError:
                result = None
    return step, result


_STEP_WORDS = {"stat": "stat", "list": "directory listing", "config": "read of config.json",
               "shards": "read of the shard headers", "": "start"}


def judge(outcome: ProbeOutcome, path: str, expected: int, timeout_s: float) -> Health:
    """What an outcome means for the mount at `path`, with a reason an operator can act on."""
    if not outcome.finished:
        what = _STEP_WORDS.get(outcome.step, outcome.step)
        if outcome.error and not outcome.stuck_pid and not outcome.reused:
            return Health(STALE, f"health check of {path} failed: {outcome.error}")
        detail = f"{what} of {path} did not return within {timeout_s:g} s"
        if outcome.reused:
            detail = f"{what} of {path} is still blocked (probe pid {outcome.stuck_pid} stuck in the kernel)"
        elif outcome.stuck_pid:
            detail += f" (probe pid {outcome.stuck_pid} stuck in the kernel)"
        if outcome.error:
            detail += f"; {outcome.error}"
        return Health(STALE, detail + ": the server does not answer; check it and its link, then Remount")
    r = outcome.result or {}
    error = r.get("error")
    if error:
        text = f"{error.get('step')} of {path}: {error.get('errno')} {error.get('message', '')}".rstrip()
        if error.get("errno") in STALE_ERRNOS:
            return Health(STALE, f"{text}: the mount has gone stale; Remount")
        return Health(WRONG_CONTENT, text)
    problems = []
    config = r.get("config") or {}
    if not config.get("ok"):
        if config.get("errno") in STALE_ERRNOS:
            return Health(STALE, f"config.json in {path}: {config['errno']} {config.get('message', '')}: the "
                                 "mount has gone stale; Remount")
        if config.get("errno") == "ENOENT":
            sample = ", ".join(r.get("sample", [])) or "nothing"
            problems.append(f"no config.json in {path} ({r.get('entries', 0)} entries: {sample}): is the "
                            "export the model directory?")
        elif "invalid" in config:
            problems.append(f"config.json: {config['invalid']}")
        else:
            problems.append(f"config.json: {config.get('errno')} {config.get('message', '')}".rstrip())
    seen = int(r.get("seen", 0))
    for bad in r.get("bad", []):
        if bad.get("errno") in STALE_ERRNOS:
            return Health(STALE, f"{bad['name']}: {bad['errno']} {bad.get('message', '')}: the mount has gone "
                                 "stale; Remount", seen)
    if seen < expected:
        others = {t: n for t, n in (r.get("totals") or {}).items() if int(t) != expected}
        text = f"{seen} of {expected} model-*-of-{expected:05d}.safetensors shards visible"
        if r.get("missing"):
            text += ", missing " + ", ".join(f"{i:05d}" for i in r["missing"]) + (" ..." if expected - seen > 5
                                                                                   else "")
        if others:
            text += "; found shards of another checkpoint (" + ", ".join(
                f"{n} of {int(t):05d}" for t, n in others.items()) + ")"
        problems.append(text)
    for bad in r.get("bad", []):
        problems.append(f"{bad['name']}: {bad.get('problem') or (bad.get('errno', '') + ' ' + bad.get('message', ''))}")
    if problems:
        return Health(WRONG_CONTENT, "; ".join(problems), seen)
    return Health(HEALTHY, f"config.json and {seen} of {expected} shards readable in {path}", seen)
