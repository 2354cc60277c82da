"""Fabric checks against real interfaces: veth pairs between two network namespaces made here
stand in for a Spark's two rails and its peer, the RDMA side comes from the Spark sysfs fixture
(whose netdev names the veths take), and the netlink probe runs inside the node's namespace.
Needs root (ip netns); no booted node."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from agent.fabric.checker import FabricChecker
from agent.fabric.spec import check_fabric

pytestmark = pytest.mark.integration
SPARK = Path(__file__).resolve().parents[1] / "unit" / "fixtures" / "sysfs_spark"

LISTENER = """
import socket, sys
s = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("listening", flush=True)
while True:
    s.accept()[0].close()
"""


def ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, f"ip {' '.join(args)}: {r.stderr}"


@pytest.fixture
def rails():
    """spark2's namespace (rail 1 enp1s0f1np1 10.0.0.2/24 MTU 9000, rail 2 enp1s0f0np0 10.0.22.2/24 MTU 1500,
    bootstrap enP7s7 with no carrier) wired to spark1's namespace (10.0.0.1 and 10.0.22.1), where an agent port
    listens on 7441 and nothing on 2049."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    tag = secrets.token_hex(3)
    me, peer = f"dsv41f-{tag}-a", f"dsv41f-{tag}-b"
    listener = None
    ip("netns", "add", me)
    try:
        ip("netns", "add", peer)
        for name, other, mine, theirs, mtu in [("enp1s0f1np1", "r1", "10.0.0.2/24", "10.0.0.1/24", "9000"),
                                               ("enp1s0f0np0", "r2", "10.0.22.2/24", "10.0.22.1/24", "1500")]:
            ip("link", "add", name, "netns", me, "type", "veth", "peer", "name", other, "netns", peer)
            ip("-n", me, "link", "set", name, "mtu", mtu, "up")
            ip("-n", me, "addr", "add", mine, "dev", name)
            ip("-n", peer, "link", "set", other, "mtu", mtu, "up")
            ip("-n", peer, "addr", "add", theirs, "dev", other)
        ip("-n", me, "link", "add", "enP7s7", "type", "veth", "peer", "name", "lan-peer")
        ip("-n", me, "link", "set", "enP7s7", "up")  # its peer stays down: no carrier
        ip("-n", me, "link", "set", "lo", "up")
        listener = subprocess.Popen(["ip", "netns", "exec", peer, sys.executable, "-c", LISTENER, "7441"],
                                    stdout=subprocess.PIPE, text=True)
        assert listener.stdout.readline().strip() == "listening"
        yield me
    finally:
        if listener is not None:
            listener.kill()
            listener.wait()
        for ns in (me, peer):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        assert not {me, peer} & set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
                                    .stdout.split())


def check(ns, **kw):
    args = dict(hcas=["rocep1s0f0", "rocep1s0f1"], iface="enp1s0f1np1", address="10.0.0.2", mtu=9000,
                socket_ifaces=["enP7s7"],
                peers=[("spark1", "10.0.0.1", 7441), ("spark1 (NFS)", "10.0.22.1", 2049),
                       ("spark3", "10.0.33.3", 7441), ("ghost", "10.0.0.9", 7441)])
    args.update(kw)
    checker = FabricChecker(str(SPARK), probe_argv=["ip", "netns", "exec", ns, sys.executable, "-m",
                                                     "agent.fabric.probe"], connect_timeout_s=1.0)
    result = checker.check(check_fabric(**args))
    return result, {c.name: c for c in result.checks}


def test_interfaces_and_peers_per_rail(rails):
    result, checks = check(rails)
    assert result.gid_index == 5 and not result.ok
    assert checks["enp1s0f1np1 link"].ok and checks["enp1s0f1np1 link"].detail == "up, MTU 9000, IPv4 10.0.0.2/24"
    assert checks["enp1s0f1np1 address"].ok and checks["enp1s0f1np1 mtu"].detail == "MTU 9000"
    rail2 = checks["enp1s0f0np0 mtu"]  # the other HCA's netdev, at the wrong MTU
    assert rail2.ok and rail2.warning and rail2.detail.startswith("MTU 1500, expected 9000")
    assert not checks["enP7s7 link"].ok
    assert checks["enP7s7 link"].detail.startswith("up but no carrier (operstate LOWERLAYERDOWN)")
    assert not checks["enP7s7 address"].ok
    assert checks["peer spark1 10.0.0.1:7441"].ok
    assert checks["peer spark1 10.0.0.1:7441"].detail.endswith("via enp1s0f1np1")
    nfs = checks["peer spark1 (NFS) 10.0.22.1:2049"]
    assert not nfs.ok and nfs.detail.startswith("refused via enp1s0f0np0: 10.0.22.1 answers but nothing listens")
    assert checks["peer spark3 10.0.33.3:7441"].detail.startswith("no route to 10.0.33.3 (ENETUNREACH)")
    ghost = checks["peer ghost 10.0.0.9:7441"]
    assert not ghost.ok and "via enp1s0f1np1" in ghost.detail
    assert ghost.detail.startswith(("no answer within 1 s", "host unreachable"))  # ARP gets no answer

    # Fix what the checks said: the bootstrap link gets its carrier and an address, the rail its MTU.
    ip("-n", rails, "link", "set", "lan-peer", "up")
    ip("-n", rails, "addr", "add", "192.168.77.2/24", "dev", "enP7s7")
    ip("-n", rails, "link", "set", "enp1s0f0np0", "mtu", "9000")
    result, checks = check(rails, peers=[("spark1", "10.0.0.1", 7441)])
    assert result.ok, [c for c in result.checks if not c.ok]
    assert checks["enP7s7 address"].detail == "NCCL/Gloo bind to 192.168.77.2"
    assert not any(c.warning for c in result.checks if c.name != "rocep1s0f0 port 1 GID index")


def test_administratively_down_rail_and_missing_address(rails):
    ip("-n", rails, "link", "set", "enp1s0f1np1", "down")
    result, checks = check(rails, address="10.0.0.5", hcas=[], socket_ifaces=[], peers=[("spark1", "10.0.0.1", 7441)])
    assert not result.ok and result.gid_index == -1
    assert checks["enp1s0f1np1 link"].detail.startswith("administratively down: `ip link set enp1s0f1np1 up`")
    assert checks["enp1s0f1np1 address"].detail.startswith("10.0.0.5 is not on enp1s0f1np1 (it has 10.0.0.2/24)")
    # With the rail down its route is gone too: the peer is unreachable from this node.
    assert not checks["peer spark1 10.0.0.1:7441"].ok
