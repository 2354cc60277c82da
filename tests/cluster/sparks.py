"""What the cluster and real-engine tiers look for in the booted spark nodes of testbed.sparks: units,
incidents in the coordinator's journal, the test-only NFS client, and with groups a client sending a
request a second and a watcher sampling each group's phase."""

from __future__ import annotations

import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from testbed.nspawn import Node
from testbed.sparks import chat, gateway_workers, group_phases, rank_pids, status

# The test-only stand-in for a worker's NFS client (the kernel here has none); see the script.
NFS_CLIENT_STANDIN = Path(__file__).with_name("standin_mount_nfs4.sh")


def install_nfs_client_standin(node: Node) -> None:
    """Replaces the node's mount.nfs4 (nfs-common's, which needs the kernel's NFS client) with the
    test-only stand-in: mount(8) runs it for the agent's nfs4 mount unit."""
    node.run(["rm", "-f", "/usr/sbin/mount.nfs4"])  # a symbolic link to mount.nfs: not written through
    node.write_file("/usr/sbin/mount.nfs4", NFS_CLIENT_STANDIN.read_text(), mode=0o755)


def unit_pid(node: Node, unit: str) -> int:
    return int(node.show(unit, "MainPID")["MainPID"])


def coordinator_events(head, incident: str | None = None) -> list[dict]:
    matches = ["DSV41_EVENT=incident"] + ([f"DSV41_INCIDENT={incident}"] if incident else [])
    return head.journal(unit="dsv41-coordinator.service", fields=None, matches=matches)


def incidents(head, kind: str) -> list[dict]:
    return coordinator_events(head, kind)


def wait_for(predicate, timeout: float, what: str, step: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, what
        time.sleep(step)


def new_incident(head, kind: str, seen: int, timeout: float) -> dict:
    return wait_for(lambda: incidents(head, kind)[seen:] and incidents(head, kind)[-1], timeout,
                    f"no new {kind} incident within {timeout} s: {status(head).get('phase_detail')}", step=0.1)


@dataclass(frozen=True)
class Answer:
    at_s: float        # monotonic, when the request was sent
    status: int        # 0: no HTTP answer
    body: str


class RequestLoop:
    """A client sending one chat completion a second to url from a thread, each answer recorded."""

    def __init__(self, url: str, period_s: float = 1.0, api_key: str | None = None) -> None:
        self.url, self.period_s, self.api_key = url, period_s, api_key
        self.answers: list[Answer] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="request-loop", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            sent = time.monotonic()
            self.answers.append(Answer(sent, *chat(self.url, api_key=self.api_key)))
            self._stop.wait(max(0.0, self.period_s - (time.monotonic() - sent)))

    def __enter__(self) -> "RequestLoop":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def wait_count(self, count: int, timeout: float) -> None:
        wait_for(lambda: len(self.answers) >= count, timeout, f"fewer than {count} requests in {timeout} s")

    def failures(self) -> list[Answer]:
        return [a for a in list(self.answers) if a.status != 200]

    def summary(self) -> str:
        answers = list(self.answers)
        ok = sum(a.status == 200 for a in answers)
        lines = [f"{ok} of {len(answers)} requests answered 200"]
        start = answers[0].at_s if answers else 0.0
        lines += [f"  +{a.at_s - start:.1f} s: {a.status} {a.body[:300]}" for a in self.failures()]
        return "\n".join(lines)


@dataclass(frozen=True)
class Sample:
    at_s: float
    phases: dict[str, str]      # group -> phase
    pids: dict[str, int]        # node -> rank PID
    workers: dict[str, bool]    # the gateway's workers: group -> healthy


class StatusWatcher:
    """Samples `dsv41ctl status --json` on the head from a thread: each group's phase, as often as
    the command answers (about twice a second here)."""

    def __init__(self, head: Node) -> None:
        self.head = head
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="status-watcher", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                body = status(self.head)
                self.samples.append(Sample(time.monotonic(), group_phases(body), rank_pids(body),
                                           gateway_workers(body)))
            except (ValueError, subprocess.SubprocessError):
                pass
            self._stop.wait(0.1)

    def __enter__(self) -> "StatusWatcher":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=90)

    def not_serving(self, group: str) -> list[Sample]:
        return [s for s in self.samples if s.phases.get(group) != "serving"]

    def none_serving(self) -> list[Sample]:
        return [s for s in self.samples if "serving" not in s.phases.values()]

    def timeline(self, start_s: float) -> str:
        """Each change of the groups' phases or the gateway's workers, at seconds from start_s."""
        lines, last = [], None
        for s in self.samples:
            seen = (s.phases, s.workers)
            if seen != last:
                workers = " ".join(f"{g}:{'healthy' if ok else 'unhealthy'}" for g, ok in s.workers.items())
                lines.append(f"  +{s.at_s - start_s:.1f} s: {s.phases} gateway: {workers or 'no workers'}")
                last = seen
        return "\n".join(lines)
