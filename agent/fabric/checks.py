"""The fabric checks: pure functions from what sysfs and the netlink probe saw to pass/fail
checks, each with a reason an operator can act on."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from ..roce import mapped_gid
from .spec import FabricRequest
from .sysfs import Device, Port

V2 = "RoCE v2"
_MAPPED_PREFIX = "0000:0000:0000:0000:0000:ffff:"


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    warning: bool = False


@dataclass(frozen=True)
class GidChoice:
    hca: str
    port: int
    index: int
    ndev: str | None


@dataclass(frozen=True)
class FabricResult:
    ok: bool
    checks: tuple[Check, ...]
    gid: GidChoice | None

    @property
    def gid_index(self) -> int:
        return self.gid.index if self.gid else -1


def _word(value: str | None) -> str:
    """"4: ACTIVE" -> "ACTIVE"."""
    return (value or "").split(":")[-1].strip()


def mapped_ipv4(gid: str) -> str | None:
    """The IPv4 address of an IPv4-mapped GID (::ffff:a.b.c.d), else None."""
    if not gid.startswith(_MAPPED_PREFIX):
        return None
    hexes = gid[len(_MAPPED_PREFIX):].replace(":", "")
    try:
        return str(ipaddress.IPv4Address(bytes.fromhex(hexes)))
    except ValueError:
        return None


def split_hca(spec: str) -> tuple[str, int | None]:
    name, _, port = spec.partition(":")
    return name, int(port) if port else None


def selected_ports(device: Device, port: int | None) -> list[Port]:
    return [p for p in device.ports if port is None or p.number == port]


def netdev_of(device: Device) -> str | None:
    if device.netdevs:
        return device.netdevs[0]
    for port in device.ports:
        for gid in port.gids:
            if gid.ndev:
                return gid.ndev
    return None


def port_check(hca: str, port: Port, netdev: str | None) -> Check:
    name = f"{hca} port {port.number}"
    state, phys, layer = _word(port.state), _word(port.phys_state), port.link_layer or "?"
    nd = netdev or "its netdev"
    if layer != "Ethernet":
        return Check(name, False, f"link layer {layer}: RoCE needs Ethernet; set the port type to Ethernet "
                                  "(mlxconfig LINK_TYPE_P<n>=2) and reboot")
    if state != "ACTIVE" or phys != "LinkUp":
        why = f"state {port.state or 'unreadable'}, phys_state {port.phys_state or 'unreadable'}"
        if phys != "LinkUp":
            hint = f"no physical link: check the cable and transceiver, and `ip link show {nd}`"
        else:
            hint = f"link is up but the port is not ACTIVE: is {nd} up (`ip link set {nd} up`)?"
        return Check(name, False, f"{why}: {hint}")
    return Check(name, True, f"{port.state}, {port.phys_state}, {layer}" + (f", netdev {netdev}" if netdev else ""))


def rdma_checks(req: FabricRequest, present: list[str] | None, devices: dict[str, Device | None],
                base: str) -> tuple[list[Check], dict[str, str], GidChoice | None]:
    """Checks of the HCAs; also returns each HCA's netdev and the RoCE v2 GID chosen for req.address."""
    checks: list[Check] = []
    netdevs: dict[str, str] = {}
    if not req.hcas:
        return checks, netdevs, None
    if not present:
        where = f"{base} is missing" if present is None else f"{base} is empty"
        checks.append(Check("rdma devices", False, f"no RDMA devices on this node ({where}): load the RDMA driver "
                            "(modprobe mlx5_ib) or fix IB_HCA; NCCL would fall back to TCP sockets"))
        return checks, netdevs, None
    for spec in req.hcas:
        name, port_number = split_hca(spec)
        device = devices.get(name)
        if device is None:
            checks.append(Check(name, False, f"no such RDMA device; this node has {', '.join(present)}: fix IB_HCA"))
            continue
        netdev = netdev_of(device)
        if netdev:
            netdevs[name] = netdev
        checks.append(Check(f"{name} netdev", netdev is not None, netdev or
                            "no network interface for this device (device/net is empty): is the Ethernet driver "
                            "(mlx5_core) bound?"))
        ports = selected_ports(device, port_number)
        if not ports:
            have = ", ".join(str(p.number) for p in device.ports) or "none"
            checks.append(Check(f"{name} port {port_number or '?'}", False, f"no such port (ports: {have})"))
        for port in ports:
            checks.append(port_check(name, port, netdev))
    gid_check, choice = gid_checks(req, present, devices)
    checks.extend(gid_check)
    return checks, netdevs, choice


def gid_checks(req: FabricRequest, present: list[str], devices: dict[str, Device | None]
               ) -> tuple[list[Check], GidChoice | None]:
    want = mapped_gid(req.address)
    name = f"RoCE v2 GID for {req.address}"
    listed = [(split_hca(s), devices.get(split_hca(s)[0])) for s in req.hcas]
    candidates = [(hca, port) for (hca, number), dev in listed if dev for port in selected_ports(dev, number)]
    choice = None
    v1_only = []
    for hca, port in candidates:
        for gid in port.gids:
            if gid.gid != want:
                continue
            if gid.type == V2 and choice is None:
                choice = GidChoice(hca, port.number, gid.index, gid.ndev)
            elif gid.type != V2:
                v1_only.append(f"{hca} port {port.number} index {gid.index} ({gid.type or 'type unreadable'})")
    if choice is not None:
        checks = [Check(name, True, f"{choice.hca} port {choice.port} index {choice.index}"
                                    + (f" (netdev {choice.ndev})" if choice.ndev else "")
                                    + f": NCCL_IB_GID_INDEX={choice.index}")]
        checks += _index_warnings(choice, candidates)
        return checks, choice
    names = ", ".join(hca for (hca, _), _ in listed)
    hints = []
    if v1_only:
        hints.append("only RoCE v1 entries: " + "; ".join(v1_only) + " (RoCE v2 is off for this device)")
    elsewhere = [f"{dev} port {p.number} index {g.index}" for dev in present if dev not in {h for (h, _), _ in listed}
                 for p in (devices.get(dev).ports if devices.get(dev) else ()) for g in p.gids
                 if g.gid == want and g.type == V2]
    if elsewhere:
        hints.append(f"{req.address} is on {', '.join(elsewhere)}, which IB_HCA does not list")
    ipv4 = [f"{mapped_ipv4(g.gid)} ({hca} index {g.index})" for hca, port in candidates for g in port.gids
            if g.type == V2 and mapped_ipv4(g.gid)]
    if not hints:
        if ipv4:
            hints.append("RoCE v2 IPv4 GIDs there: " + ", ".join(ipv4) + f"; is {req.address} this node's address?")
        else:
            nds = sorted({netdev_of(dev) or hca for (hca, _), dev in listed if dev})
            hints.append(f"no IPv4 GIDs at all: configure {req.address} on {', '.join(nds) or 'the HCA netdev'}")
    return [Check(name, False, f"no RoCE v2 GID for {req.address} on {names}: " + "; ".join(hints))], None


def _index_warnings(choice: GidChoice, candidates: list[tuple[str, Port]]) -> list[Check]:
    """NCCL_IB_GID_INDEX is one number for every HCA: say where it names something else."""
    out = []
    for hca, port in candidates:
        if (hca, port.number) == (choice.hca, choice.port):
            continue
        v2_ipv4 = [g for g in port.gids if g.type == V2 and mapped_ipv4(g.gid)]
        if not v2_ipv4:
            continue
        at = next((g for g in port.gids if g.index == choice.index), None)
        if at is not None and at.type == V2 and mapped_ipv4(at.gid):
            continue
        what = f"{at.type} {at.gid}" if at else "empty"
        out.append(Check(f"{hca} port {port.number} GID index", True,
                         f"NCCL_IB_GID_INDEX={choice.index} applies to every HCA; here index {choice.index} is "
                         f"{what}, while its RoCE v2 IPv4 GID is index {v2_ipv4[0].index}", warning=True))
    return out


def _link_ok(link: dict) -> bool:
    state = link.get("operstate")
    return state == "UP" or (state == "UNKNOWN" and link.get("admin_up") and link.get("carrier") != 0)


def interface_checks(req: FabricRequest, hca_netdevs: dict[str, str], links: dict) -> list[Check]:
    roles: dict[str, list[str]] = {}
    if req.iface:
        roles.setdefault(req.iface, []).append("FABRIC_IFACE")
    for name in req.socket_ifaces:
        roles.setdefault(name, []).append("socket interface (NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME)")
    for hca, netdev in hca_netdevs.items():
        roles.setdefault(netdev, []).append(f"netdev of {hca}")
    checks = []
    for name, role in roles.items():
        link = links.get(name)
        if link is None:
            checks.append(Check(name, False, f"no such interface on this node (it is the {', '.join(role)}): fix the "
                                             "configuration or the node's network setup"))
            continue
        addrs = link.get("ipv4") or []
        mtu = link.get("mtu")
        if _link_ok(link):
            checks.append(Check(f"{name} link", True, f"up, MTU {mtu}, IPv4 {', '.join(addrs) or 'none'}"))
        elif not link.get("admin_up"):
            checks.append(Check(f"{name} link", False, f"administratively down: `ip link set {name} up` (or fix "
                                                       "its network configuration)"))
        elif link.get("carrier") == 0:
            checks.append(Check(f"{name} link", False, f"up but no carrier (operstate {link.get('operstate')}): the "
                                                       "cable, the transceiver or the peer's port is down"))
        else:
            checks.append(Check(f"{name} link", False, f"operstate {link.get('operstate')}"))
        bare = [a.split("/")[0] for a in addrs]
        if name == req.iface and req.address:
            ok = req.address in bare
            checks.append(Check(f"{name} address", ok, f"has {req.address}" if ok else
                                f"{req.address} is not on {name} (it has {', '.join(addrs) or 'no IPv4 address'}): "
                                "NCCL and the RoCE GID need the node's fabric address there"))
        elif any(r.startswith("socket") for r in role):
            checks.append(Check(f"{name} address", bool(addrs), f"NCCL/Gloo bind to {bare[0]}" if addrs else
                                "no IPv4 address: NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME need one for bootstrap"))
        if req.mtu and (name == req.iface or any(r.startswith("netdev") for r in role)):
            if mtu == req.mtu:
                checks.append(Check(f"{name} mtu", True, f"MTU {mtu}"))
            else:
                checks.append(Check(f"{name} mtu", True, f"MTU {mtu}, expected {req.mtu}: RoCE and NCCL use the "
                                    f"smaller MTU of both ends (`ip link set {name} mtu {req.mtu}` on every node)",
                                    warning=True))
    return checks


def peer_checks(req: FabricRequest, routes: list, connects: list, fabric_ifaces: set[str],
                timeout_s: float) -> list[Check]:
    checks = []
    for peer, route, conn in zip(req.peers, routes, connects):
        name = f"peer {peer.name} {peer.address}:{peer.port}"
        route = route or {}
        conn = conn or {"ok": False, "error": "not tried"}
        if "error" in route and not conn.get("ok"):
            checks.append(Check(name, False, f"no route to {peer.address} ({route['error']}): no interface is on "
                                             "this peer's rail; configure the rail's address on this node"))
            continue
        via = route.get("oif") or "?"
        gateway = route.get("gateway")
        path = f"via {via}" + (f" through gateway {gateway}" if gateway else "")
        if conn.get("ok"):
            detail = f"reachable in {conn.get('ms')} ms {path}"
            off_rail = bool(fabric_ifaces) and via not in fabric_ifaces
            if off_rail:
                detail += (f"; not over a fabric interface ({', '.join(sorted(fabric_ifaces))}): traffic to this peer "
                           "leaves by another link; check the rail's addresses and routes")
            elif gateway:
                detail += "; routed through a gateway, not directly on the rail: check the rail's addresses"
            checks.append(Check(name, True, detail, warning=off_rail or bool(gateway)))
        elif conn.get("error") == "refused":
            checks.append(Check(name, False, f"refused {path}: {peer.address} answers but nothing listens on port "
                                             f"{peer.port} (is the service running there?)"))
        elif conn.get("error") == "timeout":
            checks.append(Check(name, False, f"no answer within {timeout_s:g} s {path}: the peer is down, not on this "
                                             f"rail, or a firewall drops port {peer.port}"))
        else:
            checks.append(Check(name, False, f"{conn.get('error')} {path}"))
    return checks


def assemble(checks: list[Check], gid: GidChoice | None) -> FabricResult:
    return FabricResult(all(c.ok for c in checks), tuple(checks), gid)
