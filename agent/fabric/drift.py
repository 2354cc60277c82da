"""Fabric drift: what changed between two looks at the node's fabric. Pure.

A look (FabricSnapshot) holds, for each watched netdev, its link state, MTU and IPv4 addresses (as
the netlink probe reports them), and the RoCE v2 GID index of the node's fabric address (sysfs).
NCCL does not reconnect when any of these change under a running group (a `netplan apply` by another
tool, a firmware reboot of the NIC): the engine dies later with an error pointing elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from dsv41.fabricchange import FabricChange

from .spec import check_ifname

NONE = "none"


@dataclass(frozen=True)
class FabricTarget:
    """What to watch: the netdevs the last fabric check named (FABRIC_IFACE, the socket interfaces),
    the HCAs (their netdevs are found in sysfs) and the node's fabric address."""
    ifaces: tuple[str, ...] = ()
    hcas: tuple[str, ...] = ()
    address: str = ""

    @property
    def empty(self) -> bool:
        return not self.ifaces and not self.hcas

    def to_json(self) -> dict:
        return {"ifaces": list(self.ifaces), "hcas": list(self.hcas), "address": self.address}

    @classmethod
    def from_json(cls, body: dict) -> "FabricTarget":
        ifaces = tuple(check_ifname(str(n), "ifaces") for n in body.get("ifaces", []))
        return cls(ifaces, tuple(str(h) for h in body.get("hcas", [])), str(body.get("address", "")))


@dataclass(frozen=True)
class LinkState:
    state: str                     # "up", "admin down", "no carrier", or the operstate in lower case
    mtu: int | None
    ipv4: tuple[str, ...]          # "10.0.0.2/24", sorted


@dataclass(frozen=True)
class FabricSnapshot:
    links: dict[str, LinkState | None] = field(default_factory=dict)  # None: no such netdev
    gid: str = NONE                # "rocep1s0f0 port 1 index 3", or NONE (no RoCE v2 GID, or not watched)


def link_state(link: dict | None) -> LinkState | None:
    """One interface as agent.fabric.probe reports it (None: it does not exist)."""
    if link is None:
        return None
    operstate = str(link.get("operstate") or "UNKNOWN")
    carrier = link.get("carrier")
    if not link.get("admin_up"):
        state = "admin down"
    elif operstate == "UP" or (operstate == "UNKNOWN" and carrier != 0):
        state = "up"
    elif carrier == 0:
        state = "no carrier"
    else:
        state = operstate.lower()
    mtu = link.get("mtu")
    return LinkState(state, int(mtu) if mtu is not None else None, tuple(sorted(link.get("ipv4") or ())))


def _link_changes(name: str, old: LinkState | None, new: LinkState | None) -> list[FabricChange]:
    if old is None and new is None:
        return []
    if old is None or new is None:
        return [FabricChange(name, "link", "missing" if old is None else old.state,
                             "missing" if new is None else new.state)]
    out = []
    if old.state != new.state:
        out.append(FabricChange(name, "link", old.state, new.state))
    if old.mtu != new.mtu:
        out.append(FabricChange(name, "mtu", str(old.mtu), str(new.mtu)))
    out += [FabricChange(name, "address", a, "") for a in old.ipv4 if a not in new.ipv4]
    out += [FabricChange(name, "address", "", a) for a in new.ipv4 if a not in old.ipv4]
    return out


def changes(old: FabricSnapshot, new: FabricSnapshot) -> list[FabricChange]:
    """What differs from `old` to `new`, netdev by netdev in `new`'s order (a netdev only one of
    them names was not watched in the other: not a change), then the GID."""
    out: list[FabricChange] = []
    for name, link in new.links.items():
        if name in old.links:
            out += _link_changes(name, old.links[name], link)
    if old.gid != new.gid:
        hca = (new.gid if new.gid != NONE else old.gid).split(" ")[0]
        out.append(FabricChange(hca, "gid_index", old.gid, new.gid))
    return out


def describe(found: Iterable[FabricChange]) -> str:
    return "; ".join(c.describe() for c in found)
