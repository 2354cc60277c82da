"""The rank container's processes, found and signalled without dockerd in the loop.

In the container runtime the rank unit's cgroup holds the `docker run` client; the server's
processes are dockerd's children in a cgroup of the container's own. A signal to the unit reaches
SGLang's launcher (through the client's signal proxy), not the scheduler processes that hold the
memory. The client writes the container's id to its --cidfile (in the unit's RuntimeDirectory,
fresh for every start, removed at stop); the container's processes are those whose /proc/PID/cgroup
names that id (`docker-ID.scope` under systemd's cgroup driver, `/docker/ID` under cgroupfs). A
node short of memory must not wait on a daemon's socket, so nothing here talks to dockerd.
The file is the rank unit's to write, which in this runtime holds the docker client and so
dockerd's socket already; an id reaches only the processes of a container by that id.
"""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass
from typing import Callable

CIDFILE_DIR = "dsv41-rank"  # the rank unit's RuntimeDirectory
CIDFILE = f"/run/{CIDFILE_DIR}/container.id"
_CONTAINER_ID = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Signalled:
    container_id: str  # "" when no container runs (the host runtime, or not created yet)
    pids: tuple[int, ...] = ()

    def note(self) -> str:
        """For the journal: what was signalled beside the rank unit."""
        if not self.container_id:
            return ""
        return f"; sent also to the {len(self.pids)} process(es) of container {self.container_id[:12]}"


def cgroup_lines_of(cgroup_text: str, container_id: str) -> list[str]:
    """The lines of one /proc/PID/cgroup (`ID:CONTROLLERS:PATH`, one per hierarchy) whose path is
    the container's: the id must be a whole path element, or the element `docker-ID.scope`."""
    lines = []
    for line in cgroup_text.splitlines():
        _, _, path = line.partition(":")[2].partition(":")
        if any(part in (container_id, f"docker-{container_id}.scope") for part in path.split("/")):
            lines.append(line)
    return lines


class ContainerProcesses:
    """The processes of the container the rank unit's client started, and signals to them."""

    def __init__(self, cidfile: str = CIDFILE, proc_root: str = "/proc", cgroup_root: str = "/sys/fs/cgroup",
                 send: Callable[[int, int], None] = os.kill):
        self._cidfile = cidfile
        self._proc = proc_root
        self._cgroup_root = cgroup_root
        self._send = send

    def container_id(self) -> str:
        """The id the client wrote, "" when there is none (no container runtime, not created yet)."""
        try:
            with open(self._cidfile, encoding="ascii", errors="replace") as f:
                text = f.read(128).strip()
        except FileNotFoundError:
            return ""
        if not _CONTAINER_ID.fullmatch(text):
            raise ValueError(f"{self._cidfile}: not a container id ({text[:80]!r}); expected 64 hex digits")
        return text

    def find(self, container_id: str) -> tuple[list[int], str]:
        """The container's processes, and its cgroup v2 directory when there is one ("" otherwise)."""
        pids, unified = [], ""
        for name in os.listdir(self._proc):
            if not name.isdigit():
                continue
            try:
                with open(os.path.join(self._proc, name, "cgroup"), encoding="utf-8", errors="replace") as f:
                    lines = cgroup_lines_of(f.read(), container_id)
            except OSError:  # ended while we looked
                continue
            if lines:
                pids.append(int(name))
                # cgroup v2's line is "0::PATH"
                unified = unified or next((line[3:] for line in lines if line.startswith("0::")), "")
        return sorted(pids), unified

    def signal(self, signum: int) -> Signalled:
        """Sends signum to every process of the container; for SIGKILL also through the cgroup's
        cgroup.kill, which reaches a process forked after the scan."""
        container_id = self.container_id()
        if not container_id:
            return Signalled("")
        pids, unified = self.find(container_id)
        # By pid, a moment after the scan: a pid reused in between is the risk any kill(1) takes.
        for pid in pids:
            try:
                self._send(pid, signum)
            except ProcessLookupError:  # ended between the scan and the signal
                pass
        if signum == signal.SIGKILL and unified:
            try:
                with open(os.path.join(self._cgroup_root, unified.lstrip("/"), "cgroup.kill"), "w") as f:
                    f.write("1")
            except OSError:  # no cgroup.kill (a kernel before 5.14, a v1 hierarchy): the scan's SIGKILLs stand
                pass
        return Signalled(container_id, tuple(pids))


def signal_rank(unit_kill: Callable[[int], None], container: ContainerProcesses, signum: int) -> str:
    """The floor's signal: to every process of the rank unit (the host runtime's server, the
    container runtime's client) and of its container. Both are tried; the first failure is raised
    after both (the floor journals it and tries again on its next sample). Returns the note."""
    failure: Exception | None = None
    try:
        unit_kill(signum)
    except Exception as exc:
        failure = exc
    try:
        note = container.signal(signum).note()
    except Exception as exc:
        note, failure = "", failure or exc
    if failure is not None:
        raise failure
    return note
