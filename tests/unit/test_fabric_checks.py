"""Interface and peer checks from what the netlink probe reports, and request validation
(agent.fabric.checks, agent.fabric.spec). The probe itself runs against real veth pairs in
tests/integration/test_fabric_netns.py."""

import pytest

from agent.fabric.checks import interface_checks, peer_checks
from agent.fabric.spec import Invalid, check_fabric

pytestmark = pytest.mark.unit


def req(**kw):
    args = dict(hcas=["rocep1s0f0", "rocep1s0f1"], iface="enp1s0f1np1", address="10.0.0.2", mtu=9000,
                socket_ifaces=["enP7s7"], peers=[("spark1", "10.0.0.1", 7441), ("spark1 (NFS)", "10.0.22.1", 2049)])
    args.update(kw)
    return check_fabric(**args)


def link(operstate="UP", admin_up=True, carrier=1, mtu=9000, ipv4=("10.0.0.2/24",)):
    return {"operstate": operstate, "admin_up": admin_up, "carrier": carrier, "mtu": mtu, "ipv4": list(ipv4)}


HCA_NETDEVS = {"rocep1s0f0": "enp1s0f0np0", "rocep1s0f1": "enp1s0f1np1"}


def by_name(checks):
    return {c.name: c for c in checks}


def test_healthy_interfaces():
    links = {"enp1s0f1np1": link(), "enp1s0f0np0": link(ipv4=("10.0.22.2/24",)),
             "enP7s7": link(mtu=1500, ipv4=("192.168.1.12/24",))}
    checks = by_name(interface_checks(req(), HCA_NETDEVS, links))
    assert all(c.ok and not c.warning for c in checks.values()), checks
    assert checks["enp1s0f1np1 address"].detail == "has 10.0.0.2"
    assert checks["enP7s7 address"].detail == "NCCL/Gloo bind to 192.168.1.12"
    assert "enP7s7 mtu" not in checks  # a bootstrap interface has no MTU expectation
    assert checks["enp1s0f0np0 mtu"].detail == "MTU 9000"


def test_interface_problems_say_what_to_do():
    links = {"enp1s0f1np1": link(operstate="DOWN", admin_up=False, carrier=0, mtu=1500, ipv4=()),
             "enp1s0f0np0": link(operstate="DOWN", carrier=0), "enP7s7": None}
    checks = by_name(interface_checks(req(), HCA_NETDEVS, links))
    assert checks["enp1s0f1np1 link"].detail == ("administratively down: `ip link set enp1s0f1np1 up` (or fix its "
                                                  "network configuration)")
    assert checks["enp1s0f1np1 address"].detail.startswith("10.0.0.2 is not on enp1s0f1np1 (it has no IPv4 address)")
    mtu = checks["enp1s0f1np1 mtu"]
    assert mtu.ok and mtu.warning and mtu.detail.startswith("MTU 1500, expected 9000")
    assert checks["enp1s0f0np0 link"].detail.startswith("up but no carrier (operstate DOWN): the cable")
    assert not checks["enP7s7"].ok and "no such interface on this node (it is the socket interface" in \
        checks["enP7s7"].detail
    assert [c.ok for c in checks.values()].count(False) == 4


def test_loopback_like_links_with_unknown_operstate_count_as_up():
    checks = by_name(interface_checks(req(hcas=[], socket_ifaces=["lo"], iface="", address="", mtu=0), {},
                                      {"lo": link(operstate="UNKNOWN", mtu=65536, ipv4=("127.0.0.1/8",))}))
    assert checks["lo link"].ok


def test_peers_per_rail():
    r = req(peers=[("a", "10.0.0.1", 7441), ("b", "10.0.22.1", 2049), ("c", "10.0.33.3", 7441),
                   ("d", "10.0.0.3", 7441), ("e", "10.9.9.9", 7441), ("f", "10.0.0.4", 7441)])
    routes = [{"oif": "enp1s0f1np1", "gateway": None}, {"oif": "enp1s0f0np0", "gateway": None},
              {"error": "ENETUNREACH"}, {"oif": "enp1s0f1np1", "gateway": None},
              {"oif": "eth0", "gateway": "192.168.1.1"}, {"oif": "enp1s0f1np1", "gateway": None}]
    connects = [{"ok": True, "ms": 0.3}, {"ok": True, "ms": 0.2}, {"ok": False, "error": "network unreachable"},
                {"ok": False, "error": "refused"}, {"ok": True, "ms": 9.1}, {"ok": False, "error": "timeout"}]
    checks = peer_checks(r, routes, connects, {"enp1s0f1np1", "enp1s0f0np0"}, 1.5)
    a, b, c, d, e, f = checks
    assert a.ok and not a.warning and a.detail == "reachable in 0.3 ms via enp1s0f1np1" and a.name == \
        "peer a 10.0.0.1:7441"
    assert b.ok and "via enp1s0f0np0" in b.detail
    assert not c.ok and c.detail.startswith("no route to 10.0.33.3 (ENETUNREACH): no interface is on this peer's rail")
    assert not d.ok and d.detail.startswith("refused via enp1s0f1np1: 10.0.0.3 answers but nothing listens on port")
    assert e.ok and e.warning and "not over a fabric interface" in e.detail and "gateway 192.168.1.1" in e.detail
    assert not f.ok and f.detail.startswith("no answer within 1.5 s via enp1s0f1np1: the peer is down")


def test_request_validation():
    assert req().hcas == ("rocep1s0f0", "rocep1s0f1")
    assert req(hcas=["mlx5_0:1"]).hcas == ("mlx5_0:1",)
    for field, value, why in [("hcas", ["../x"], "RDMA device name"), ("hcas", ["a:0"], "port must be"),
                              ("hcas", ["a", "a"], "twice"), ("hcas", ["a"] * 17, "at most"),
                              ("iface", "eth0/../x", "interface name"), ("iface", "a" * 16, "interface name"),
                              ("address", "10.0.0", "IPv4"), ("address", "", "required with hcas"),
                              ("mtu", 20, "68..65536"), ("socket_ifaces", ["bad name"], "interface name"),
                              ("peers", [("a", "spark2", 1)], "not an IP"), ("peers", [("a", "10.0.0.1", 0)], "port"),
                              ("peers", [("\n", "10.0.0.1", 1)], "printable")]:
        with pytest.raises(Invalid, match=why):
            req(**{field: value})
