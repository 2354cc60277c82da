"""Fabric drift on the agent: what changed between two looks at the fabric (pure), the rtnetlink
messages' parsing, and the watch over a fake netlink source, a fake probe and a copy of a Spark's
sysfs (the real netlink is in tests/integration/test_fabric_netns.py)."""

from __future__ import annotations

import queue
import threading
import shutil
import struct
from pathlib import Path

import pytest

from agent.fabric.drift import FabricChange, FabricSnapshot, FabricTarget, LinkState, changes, describe, link_state
from agent.fabric.watch import RTM_NEWLINK, FabricWatch, parse_messages
from dsv41.v1 import agent_pb2 as pb

pytestmark = pytest.mark.unit
SPARK = Path(__file__).resolve().parent / "fixtures" / "sysfs_spark"
RTM_NEWADDR = 20


def up(*ipv4: str, mtu: int = 9000) -> LinkState:
    return LinkState("up", mtu, tuple(sorted(ipv4)))


def test_each_kind_of_change_is_named_with_its_before_and_after():
    old = FabricSnapshot({"enp1s0f1np1": up("10.0.0.2/24"), "enp1s0f0np0": up("10.0.22.2/24"),
                          "enP7s7": up("192.168.1.2/24", mtu=1500)}, "rocep1s0f1 port 1 index 5")
    new = FabricSnapshot({"enp1s0f1np1": LinkState("no carrier", 1500, ("10.0.0.2/24", "10.0.0.9/24")),
                          "enp1s0f0np0": None, "enP7s7": up("192.168.1.2/24", mtu=1500)}, "none")
    found = changes(old, new)
    assert found == [
        FabricChange("enp1s0f1np1", "link", "up", "no carrier"),
        FabricChange("enp1s0f1np1", "mtu", "9000", "1500"),
        FabricChange("enp1s0f1np1", "address", "", "10.0.0.9/24"),
        FabricChange("enp1s0f0np0", "link", "up", "missing"),
        FabricChange("rocep1s0f1", "gid_index", "rocep1s0f1 port 1 index 5", "none")]
    assert describe(found).split("; ")[2:4] == ["enp1s0f1np1 address 10.0.0.9/24 added", "enp1s0f0np0 link up -> missing"]
    assert changes(new, new) == []


def test_an_address_removed_and_a_netdev_watched_only_now_is_not_a_change():
    old = FabricSnapshot({"host0": up("10.0.0.2/24", "10.77.0.2/24")})
    new = FabricSnapshot({"host0": up("10.0.0.2/24"), "host1": up("10.1.0.2/24")})
    assert changes(old, new) == [FabricChange("host0", "address", "10.77.0.2/24", "")]
    assert changes(old, new)[0].describe() == "host0 address 10.77.0.2/24 removed"


@pytest.mark.parametrize("probe, state", [
    ({"operstate": "UP", "admin_up": True, "carrier": 1}, "up"),
    ({"operstate": "UNKNOWN", "admin_up": True, "carrier": 1}, "up"),  # lo, some virtual links
    ({"operstate": "DOWN", "admin_up": False, "carrier": 0}, "admin down"),
    ({"operstate": "LOWERLAYERDOWN", "admin_up": True, "carrier": 0}, "no carrier"),
    ({"operstate": "DORMANT", "admin_up": True, "carrier": 1}, "dormant"),
])
def test_link_state_from_the_probe(probe, state):
    assert link_state({**probe, "mtu": 9000, "ipv4": ["10.0.0.2/24"]}) == LinkState(state, 9000, ("10.0.0.2/24",))
    assert link_state(None) is None


def test_rtnetlink_messages_give_their_type_and_interface_index():
    def message(kind: int, index: int, body: int) -> bytes:
        data = struct.pack("=IHHII", 16 + body, kind, 0, 0, 0) + struct.pack("=BBHi", 0, 0, 0, index)
        return data + b"\0" * (body - 8) + b"\0" * ((-(16 + body)) % 4)
    data = message(RTM_NEWLINK, 7, 14) + message(RTM_NEWADDR, 3, 8)
    assert parse_messages(data) == [(RTM_NEWLINK, 7), (RTM_NEWADDR, 3)]
    assert parse_messages(b"\1\0") == []


class FakeNetlink:
    """Messages the test queues; wait() blocks for them up to its timeout, like the socket."""

    def __init__(self):
        self.messages: queue.Queue = queue.Queue()
        self.closed = False

    def wait(self, timeout_s):
        try:
            return self.messages.get(timeout=timeout_s)
        except queue.Empty:
            return []

    def close(self):
        self.closed = True


class Events:
    def __init__(self):
        self.lines = []

    def warning(self, kind, message, **fields):
        self.lines.append((kind, message))

    error = info = warning


class Links:
    """The probe's answers: `state` per netdev; counts the reads."""

    def __init__(self, **state):
        self.state = state
        self.reads = 0
        self.baseline = threading.Event()

    def __call__(self, ifaces):
        self.reads += 1
        self.baseline.set()
        return {"links": {n: self.state.get(n) for n in ifaces}}, ""


def link(*ipv4, mtu=9000):
    return {"operstate": "UP", "admin_up": True, "carrier": 1, "mtu": mtu, "ipv4": list(ipv4)}


@pytest.fixture
def sysfs(tmp_path):
    root = tmp_path / "sys"
    shutil.copytree(SPARK, root, symlinks=True)
    return root


def watch_of(sysfs, tmp_path, links, netlink):
    events = Events()
    indexes = {"enp1s0f1np1": 11, "enp1s0f0np0": 12}
    watch = FabricWatch(events, str(sysfs), str(tmp_path), read_links=links, netlink=lambda: netlink,
                        index_of=lambda name: indexes[name], gid_poll_s=0.05, settle_s=0.01)
    got: queue.Queue = queue.Queue()
    watch.subscribe(got.put)
    return watch, events, got


TARGET = FabricTarget(("enp1s0f1np1",), ("rocep1s0f0", "rocep1s0f1"), "10.0.0.2")


def test_a_netlink_event_on_a_watched_netdev_reads_the_links_and_reports_the_change(sysfs, tmp_path):
    links = Links(enp1s0f1np1=link("10.0.0.2/24"), enp1s0f0np0=link("10.0.22.2/24", mtu=1500))
    netlink = FakeNetlink()
    watch, events, got = watch_of(sysfs, tmp_path, links, netlink)
    watch.watch(TARGET)
    watch.start()
    try:
        assert links.baseline.wait(10)
        netlink.messages.put([(RTM_NEWADDR, 99)])  # another interface's: not read
        netlink.messages.put([])
        links.state["enp1s0f1np1"] = link("10.0.0.2/24", "10.0.0.7/24")
        netlink.messages.put([(RTM_NEWADDR, 11)])
        found = got.get(timeout=10)
    finally:
        watch.stop()
    assert found == (FabricChange("enp1s0f1np1", "address", "", "10.0.0.7/24"),)
    assert links.reads == 2  # the baseline, then the event on index 11 (the HCAs' netdevs are watched too)
    assert ("fabric_changed", "the fabric changed: enp1s0f1np1 address 10.0.0.7/24 added") in events.lines
    assert netlink.closed


def test_the_gid_index_moving_in_sysfs_is_a_change_without_a_netlink_event(sysfs, tmp_path):
    links = Links(enp1s0f1np1=link("10.0.0.2/24"), enp1s0f0np0=link("10.0.22.2/24"))
    watch, events, got = watch_of(sysfs, tmp_path, links, FakeNetlink())
    watch.watch(TARGET)
    watch.start()
    try:
        assert links.baseline.wait(10)
        port = sysfs / "class" / "infiniband" / "rocep1s0f1" / "ports" / "1"
        (port / "gids" / "7").write_text((port / "gids" / "5").read_text())
        (port / "gid_attrs" / "types" / "7").write_text("RoCE v2\n")
        (port / "gids" / "5").write_text("0000:0000:0000:0000:0000:0000:0000:0000\n")
        found = got.get(timeout=10)
    finally:
        watch.stop()
    assert found == (FabricChange("rocep1s0f1", "gid_index", "rocep1s0f1 port 1 index 5",
                                  "rocep1s0f1 port 1 index 7"),)
    assert links.reads == 1  # the GID is read from sysfs; the links only at the baseline


def test_the_target_is_kept_for_a_restarted_agent(sysfs, tmp_path):
    links = Links(enp1s0f1np1=link("10.0.0.2/24"), enp1s0f0np0=link("10.0.22.2/24"))
    first, _, _ = watch_of(sysfs, tmp_path, links, FakeNetlink())
    first.watch(TARGET)  # a fabric check, then the agent restarts
    netlink = FakeNetlink()
    again, _, got = watch_of(sysfs, tmp_path, links, netlink)
    read = []
    again._read_links = lambda ifaces: (read.append(ifaces), links(ifaces))[1]
    again.start()  # it watches what the last check named
    try:
        assert links.baseline.wait(10)
        links.state["enp1s0f1np1"] = link("10.0.0.2/24", mtu=1500)
        netlink.messages.put([(RTM_NEWLINK, 11)])
        found = got.get(timeout=10)
    finally:
        again.stop()
    assert found == (FabricChange("enp1s0f1np1", "mtu", "9000", "1500"),)
    assert read[0] == ["enp1s0f1np1", "enp1s0f0np0"]  # FABRIC_IFACE, then the HCAs' netdevs from sysfs


def test_a_saved_target_that_is_not_one_is_ignored_with_a_warning(sysfs, tmp_path):
    (tmp_path / "fabric-watch.json").write_text('{"ifaces": ["no/such"]}')
    watch, events, _ = watch_of(sysfs, tmp_path, Links(), FakeNetlink())
    assert watch._saved_target() is None
    assert events.lines[0][0] == "fabric_watch_state"


def test_every_watch_rank_stream_carries_a_fabric_change_at_once_in_an_event_of_its_own():
    from agent.rank import RankStatus
    from agent.rpc_rank import RankRpcs

    class Rank:
        def watch(self, callback):
            return lambda: None

        def status(self):
            return RankStatus("active", "running", 42, 0.0, 0, "fp", "inv", "", 0, None, "/x")

    class Context:
        def is_active(self):
            return True
    listeners = []

    def subscribe(listener):
        listeners.append(listener)
        return lambda: listeners.remove(listener)
    rpcs = RankRpcs(None, Rank(), Events(), lambda: None, list, "boot1", fabric_changes=subscribe)
    stream = rpcs.WatchRank(pb.WatchRankRequest(heartbeat_ms=60_000), Context())
    first = next(stream)
    assert not first.fabric_changes and listeners
    listeners[0]((FabricChange("host0", "address", "", "10.77.0.2/24"),))
    event = next(stream)
    assert not event.heartbeat and event.rank.main_pid == 42 and event.seq == 2
    assert [(c.netdev, c.what, c.before, c.after) for c in event.fabric_changes] == [
        ("host0", "address", "", "10.77.0.2/24")]
    stream.close()
    assert listeners == []  # the stream's end unsubscribes it


def test_stopping_the_watch_ends_a_netlink_wait_at_once_not_after_the_poll_interval(sysfs, tmp_path):
    # An agent restart must not sit out the watch's poll (it went past the node's lease before):
    # with a 60 s poll, the thread must be gone once stop() returns (it joins for at most 5 s).
    watch = FabricWatch(Events(), str(sysfs), str(tmp_path), read_links=Links(), gid_poll_s=60.0)
    watch.start()
    wait_for_netlink = threading.Event()
    while not wait_for_netlink.wait(0.01):
        if watch._netlink is not None:  # the thread's real rtnetlink socket is open and waited on
            wait_for_netlink.set()
    watch.stop()
    assert not watch._thread.is_alive()
