"""Validates a fabric check request. Pure."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Iterable

MAX_HCAS = 16
MAX_IFACES = 16
MAX_PEERS = 32
_HCA = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}(:[0-9]{1,3})?")
_IFNAME = re.compile(r"[A-Za-z0-9_.:@-]{1,15}")
_PEER_NAME = re.compile(r"[\x20-\x7e]{1,64}")


class Invalid(ValueError):
    """INVALID_ARGUMENT: the message says which field and what is allowed."""


@dataclass(frozen=True)
class PeerSpec:
    name: str
    address: str
    port: int


@dataclass(frozen=True)
class FabricRequest:
    hcas: tuple[str, ...]          # "rocep1s0f0" or "rocep1s0f0:1"
    iface: str                     # FABRIC_IFACE; "" when not checked
    address: str                   # the node's fabric IPv4; "" when not checked
    mtu: int                       # expected MTU; 0 when none
    socket_ifaces: tuple[str, ...]
    peers: tuple[PeerSpec, ...]


def check_ifname(name: str, what: str) -> str:
    if not _IFNAME.fullmatch(name) or name in (".", ".."):
        raise Invalid(f"{what} {name!r}: must be a network interface name (1-15 of letters, digits and _.:@-)")
    return name


def check_fabric(*, hcas: Iterable[str], iface: str, address: str, mtu: int, socket_ifaces: Iterable[str],
                 peers: Iterable[tuple[str, str, int]]) -> FabricRequest:
    hcas, socket_ifaces, peers = list(hcas), list(socket_ifaces), list(peers)
    if len(hcas) > MAX_HCAS:
        raise Invalid(f"hcas: at most {MAX_HCAS}")
    for hca in hcas:
        if not _HCA.fullmatch(hca) or hca.split(":")[0] in (".", ".."):
            raise Invalid(f"hcas {hca!r}: must be an RDMA device name, optionally with :PORT (e.g. rocep1s0f0 or "
                          "mlx5_0:1)")
        if ":" in hca and not 1 <= int(hca.split(":")[1]) <= 255:
            raise Invalid(f"hcas {hca!r}: port must be 1..255")
    if len(set(hcas)) != len(hcas):
        raise Invalid("hcas: a device is listed twice")
    if iface:
        check_ifname(iface, "iface")
    if address:
        try:
            ipaddress.IPv4Address(address)
        except ValueError:
            raise Invalid(f"address {address!r}: must be the node's fabric IPv4 address") from None
    if hcas and not address:
        raise Invalid("address: required with hcas (the RoCE v2 GID is looked up for it)")
    if mtu and not 68 <= mtu <= 65536:
        raise Invalid(f"mtu {mtu}: must be 68..65536, or 0 for no expectation")
    if len(socket_ifaces) > MAX_IFACES:
        raise Invalid(f"socket_ifaces: at most {MAX_IFACES}")
    for name in socket_ifaces:
        check_ifname(name, "socket_ifaces")
    if len(peers) > MAX_PEERS:
        raise Invalid(f"peers: at most {MAX_PEERS}")
    checked = []
    for name, peer_address, port in peers:
        if not _PEER_NAME.fullmatch(name):
            raise Invalid(f"peers name {name!r}: 1-64 printable characters")
        try:
            ipaddress.ip_address(peer_address)
        except ValueError:
            raise Invalid(f"peers {name}: address {peer_address!r} is not an IP address") from None
        if not 1 <= port <= 65535:
            raise Invalid(f"peers {name}: port {port} must be 1..65535")
        checked.append(PeerSpec(name, peer_address, port))
    return FabricRequest(tuple(hcas), iface, address, mtu, tuple(dict.fromkeys(socket_ifaces)), tuple(checked))
