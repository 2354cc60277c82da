"""Watches the node's fabric while it serves and reports each change at once.

The netdevs, HCAs and address come from the last fabric check (FabricWatch.watch, kept in a state
file so that a restarted agent goes on watching). Link state, MTU and IPv4 addresses are read again
whenever rtnetlink announces a link or address event on a watched netdev; the RoCE v2 GID index of
the fabric address is read from sysfs every few seconds (the GID table has no event of its own).
The events arrive on a raw netlink socket of the standard library, and the links are read by the
short-lived netlink probe (agent.fabric.probe): the long-lived agent never imports pyroute2.
"""

from __future__ import annotations

import errno
import json
import os
import select
import socket
import struct
import threading
import time
from typing import Callable, Iterable, Sequence

from dsv41.atomicfile import replace_file

from ..roce import find_roce_v2_gid
from .checker import PROBE_ARGV, run_probe
from .checks import netdev_of, split_hca
from .drift import NONE, FabricChange, FabricSnapshot, FabricTarget, changes, describe, link_state
from .sysfs import RdmaSysfs

RTMGRP_LINK, RTMGRP_IPV4_IFADDR = 0x1, 0x10
RTM_NEWLINK, RTM_DELLINK = 16, 17
LINK_MESSAGES = {RTM_NEWLINK, RTM_DELLINK}
GID_POLL_S = 5.0
SETTLE_S = 0.3  # netlink events of one change come in a burst: read the links once after it
STATE_NAME = "fabric-watch.json"
_HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, seq, pid


def parse_messages(data: bytes) -> list[tuple[int, int]]:
    """(type, interface index) of each rtnetlink message in one datagram. ifinfomsg and ifaddrmsg
    both carry the index at bytes 4..8 of their body."""
    out, offset = [], 0
    while offset + _HEADER.size + 8 <= len(data):
        length, kind, _, _, _ = _HEADER.unpack_from(data, offset)
        if length < _HEADER.size:
            break
        (index,) = struct.unpack_from("=i", data, offset + _HEADER.size + 4)
        out.append((kind, index))
        offset += (length + 3) & ~3
    return out


class NetlinkEvents:
    """rtnetlink's link and IPv4 address groups on a raw socket."""

    def __init__(self):
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
        self._sock.bind((0, RTMGRP_LINK | RTMGRP_IPV4_IFADDR))
        # interrupt() ends a wait at once: an agent that stops must not sit out a poll interval.
        self._wake_r, self._wake_w = socket.socketpair()

    def interrupt(self) -> None:
        try:
            self._wake_w.send(b"x", socket.MSG_DONTWAIT)
        except OSError:
            pass  # already woken (buffer full) or closed: either way the wait ends

    def wait(self, timeout_s: float) -> list[tuple[int, int]] | None:
        """The (type, index) of the messages that came within timeout_s (empty: none, or woken by
        interrupt()); None when the kernel dropped some (ENOBUFS): everything must be read again."""
        ready, _, _ = select.select([self._sock, self._wake_r], [], [], timeout_s)
        if self._wake_r in ready:
            return []
        out: list[tuple[int, int]] = []
        while ready:
            try:
                out += parse_messages(self._sock.recv(65536, socket.MSG_DONTWAIT))
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:
                    return None
                raise
        return out

    def close(self) -> None:
        for sock in (self._sock, self._wake_r, self._wake_w):
            sock.close()


class FabricWatch:
    """A thread over the watched fabric; subscribers get each batch of changes (FabricChange)."""

    def __init__(self, events, sysfs_root: str = "/sys", state_dir: str | None = None,
                 read_links: Callable[[list[str]], tuple[dict | None, str]] | None = None,
                 netlink: Callable[[], object] = NetlinkEvents,
                 index_of: Callable[[str], int] = socket.if_nametoindex,
                 gid_poll_s: float = GID_POLL_S, settle_s: float = SETTLE_S,
                 probe_argv: Sequence[str] = PROBE_ARGV):
        """read_links(ifaces) -> (the probe's answer, or None and why); netlink() -> an object with
        wait(timeout_s) and close() like NetlinkEvents; index_of: an interface's index by name."""
        self._events = events
        self._sysfs_root = sysfs_root
        self._rdma = RdmaSysfs(sysfs_root)
        self._state_path = os.path.join(state_dir, STATE_NAME) if state_dir else None
        self._read_links = read_links or (lambda ifaces: run_probe(probe_argv, ifaces, [], 1.0, 15.0))
        self._netlink_factory = netlink
        self._index_of = index_of
        self._gid_poll_s, self._settle_s = gid_poll_s, settle_s
        self._lock = threading.Lock()
        self._next_target: FabricTarget | None = None
        self._subscribers: list[Callable[[tuple[FabricChange, ...]], None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fabric-watch", daemon=True)
        # The watch thread's own:
        self._target = FabricTarget()
        self._netdevs: tuple[str, ...] = ()
        self._indexes: dict[str, int] = {}
        self._last: FabricSnapshot | None = None
        self._netlink: object | None = None  # the thread's, for stop() to interrupt its wait

    # -- public, thread-safe

    def watch(self, target: FabricTarget) -> None:
        """Watch this from now on (a fabric check's netdevs, HCAs and address); what the node has
        now is the new baseline, not a change."""
        with self._lock:
            self._next_target = target
        if self._state_path:
            try:
                replace_file(self._state_path, json.dumps(target.to_json()).encode(), 0o644)
            except OSError as exc:
                self._events.warning("fabric_watch_state", f"cannot keep the fabric watch's target in "
                                     f"{self._state_path}: {exc.strerror or exc}")

    def subscribe(self, listener: Callable[[tuple[FabricChange, ...]], None]) -> Callable[[], None]:
        with self._lock:
            self._subscribers.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._subscribers:
                    self._subscribers.remove(listener)
        return unsubscribe

    def start(self) -> "FabricWatch":
        with self._lock:
            if self._next_target is None:
                self._next_target = self._saved_target()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        interrupt = getattr(self._netlink, "interrupt", None)
        if interrupt is not None:
            interrupt()
        self._thread.join(5.0)

    # -- the thread

    def _saved_target(self) -> FabricTarget | None:
        if not self._state_path:
            return None
        try:
            with open(self._state_path, encoding="utf-8") as f:
                return FabricTarget.from_json(json.load(f))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, AttributeError) as exc:
            self._events.warning("fabric_watch_state", f"ignoring {self._state_path}: {exc}")
            return None

    def _run(self) -> None:
        try:
            netlink = self._netlink_factory()
        except OSError as exc:
            self._events.warning("fabric_watch_unavailable", f"no netlink events ({exc.strerror or exc}): the "
                                 f"fabric's links are read every {self._gid_poll_s * 6:g} s instead")
            netlink = None
        self._netlink = netlink
        polls = 0
        try:
            while not self._stop.is_set():
                self._take_target()
                if netlink is None:
                    self._stop.wait(self._gid_poll_s)
                    polls += 1
                    self.look(links=polls % 6 == 0)
                    continue
                messages = netlink.wait(self._gid_poll_s)
                if self._stop.is_set():
                    break
                if messages is None or self._touched(messages):
                    while (more := netlink.wait(self._settle_s)):  # the rest of the burst
                        messages = (messages or []) + more
                    self.look(links=True)
                elif not messages:
                    self.look(links=False)
        except Exception as exc:  # noqa: BLE001 - the agent serves on without the watch; it says so
            self._events.error("fabric_watch_failed", f"the fabric watch stopped: {exc!r}")
        finally:
            if netlink is not None:
                netlink.close()

    def _take_target(self) -> None:
        with self._lock:
            target, self._next_target = self._next_target, None
        if target is None:
            return
        self._target, self._last = target, None
        self.look(links=True)

    def _touched(self, messages: Iterable[tuple[int, int]]) -> bool:
        """Whether these messages are about a watched netdev (one renamed, made or removed too)."""
        for kind, index in messages:
            if index in self._indexes.values():
                return True
            if kind in LINK_MESSAGES and self._resolve() != self._indexes:
                return True
        return False

    def _resolve(self) -> dict[str, int]:
        out = {}
        for name in self._netdevs:
            try:
                out[name] = self._index_of(name)
            except OSError:
                pass
        return out

    def look(self, links: bool) -> list[FabricChange]:
        """Reads the fabric (the links only when `links`), reports what changed since the last look."""
        if self._target.empty:
            return []
        hca_netdevs = []
        for spec in self._target.hcas:
            device = self._rdma.device(split_hca(spec)[0])
            if device is not None and (netdev := netdev_of(device)):
                hca_netdevs.append(netdev)
        self._netdevs = tuple(dict.fromkeys([*self._target.ifaces, *hca_netdevs]))
        self._indexes = self._resolve()
        gid = NONE
        if self._target.hcas and self._target.address:
            match = find_roce_v2_gid(self._sysfs_root, self._target.hcas, self._target.address)
            gid = f"{match.hca} port {match.port} index {match.index}" if match else NONE
        previous = self._last
        found_links = previous.links if previous is not None else None
        if links or found_links is None:
            probe, why = self._read_links(list(self._netdevs))
            if probe is None:
                self._events.warning("fabric_watch_unreadable", f"cannot read the fabric's links: {why}")
                if found_links is None:
                    return []
            else:
                found_links = {n: link_state(probe.get("links", {}).get(n)) for n in self._netdevs}
        now = FabricSnapshot(dict(found_links), gid)
        self._last = now
        found = changes(previous, now) if previous is not None else []
        if found:
            self._report(found)
        return found

    def _report(self, found: list[FabricChange]) -> None:
        text = describe(found)
        self._events.warning("fabric_changed", f"the fabric changed: {text}",
                             netdevs=",".join(dict.fromkeys(c.netdev for c in found)), changes=len(found))
        with self._lock:
            subscribers = list(self._subscribers)
        for listener in subscribers:
            listener(tuple(found))
