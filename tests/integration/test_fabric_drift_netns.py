"""Fabric drift through real netlink: the agent's fabric watch runs inside a network namespace whose
veths stand in for a Spark's two rails (tests/integration/test_fabric_netns.py's `rails`), with the
kernel's rtnetlink events on its raw socket and the netlink probe reading the links; the RDMA side is
a copy of the Spark sysfs fixture. Changes made with `ip` are reported once each, as they happen; a
change on an interface it does not watch is not. Needs root (ip netns); no booted node."""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.integration.test_fabric_netns import SPARK, ip, rails  # noqa: F401

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]

# The watch as the agent runs it (real netlink, the real probe), printing each batch of changes.
WATCHER = """
import json, sys, threading
from agent.fabric.checker import PROBE_ARGV, run_probe
from agent.fabric.drift import FabricTarget
from agent.fabric.watch import FabricWatch

class Events:
    def warning(self, kind, message, **fields):
        print(json.dumps({"event": kind, "message": message}), flush=True)
    info = error = warning

reads = []
def read_links(ifaces):
    found = run_probe(PROBE_ARGV, ifaces, [], 1.0, 15.0)
    reads.append(1)
    if len(reads) == 1:
        print(json.dumps({"ready": sorted(found[0]["links"])}), flush=True)
    return found

watch = FabricWatch(Events(), sys.argv[1], read_links=read_links, gid_poll_s=1.0)
watch.subscribe(lambda found: print(json.dumps({"changes": [[c.netdev, c.what, c.before, c.after]
                                                             for c in found]}), flush=True))
watch.watch(FabricTarget(("enp1s0f1np1",), ("rocep1s0f0", "rocep1s0f1"), "10.0.0.2"))
watch.start()
sys.stdin.read()
watch.stop()
"""


class Watcher:
    def __init__(self, ns: str, sysfs: Path):
        self.proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", WATCHER, str(sysfs)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
                                     env={**os.environ, "PYTHONPATH": str(REPO)})
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(json.loads(line)) for line in self.proc.stdout],
                         daemon=True).start()

    def next(self, key: str, timeout: float = 15.0):
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no {key} line within {timeout:g} s") from None
            if key in line:
                return line[key]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=15)


def test_changes_through_real_netlink_are_reported_as_they_happen(rails, tmp_path):
    sysfs = tmp_path / "sys"
    shutil.copytree(SPARK, sysfs, symlinks=True)
    watcher = Watcher(rails, sysfs)
    try:
        assert watcher.next("ready") == ["enp1s0f0np0", "enp1s0f1np1"]  # FABRIC_IFACE and the HCAs' netdevs
        ip("-n", rails, "addr", "add", "192.168.77.2/24", "dev", "enP7s7")  # not watched: no report
        ip("-n", rails, "addr", "add", "10.0.0.7/24", "dev", "enp1s0f1np1")
        assert watcher.next("changes") == [["enp1s0f1np1", "address", "", "10.0.0.7/24"]]
        ip("-n", rails, "link", "set", "enp1s0f0np0", "mtu", "9000")
        assert watcher.next("changes") == [["enp1s0f0np0", "mtu", "1500", "9000"]]
        ip("-n", rails, "link", "set", "enp1s0f1np1", "down")
        down = watcher.next("changes")
        assert ["enp1s0f1np1", "link", "up", "admin down"] in down
        # The RoCE v2 GID of the fabric address moves (the driver re-adds it at another index).
        port = sysfs / "class" / "infiniband" / "rocep1s0f1" / "ports" / "1"
        (port / "gids" / "7").write_text((port / "gids" / "5").read_text())
        (port / "gid_attrs" / "types" / "7").write_text("RoCE v2\n")
        (port / "gids" / "5").write_text("0000:0000:0000:0000:0000:0000:0000:0000\n")
        assert watcher.next("changes") == [["rocep1s0f1", "gid_index", "rocep1s0f1 port 1 index 5",
                                            "rocep1s0f1 port 1 index 7"]]
    finally:
        watcher.close()
