"""What the cluster and real-engine tiers look for in the booted spark nodes of testbed.sparks: units,
incidents in the coordinator's journal, and the test-only NFS client."""

from __future__ import annotations

import time
from pathlib import Path

from testbed.nspawn import Node
from testbed.sparks import status

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
