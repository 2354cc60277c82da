"""RoCE v2 GID lookup in sysfs: the index NCCL_IB_GID_INDEX must name for this node's address.

The GID of an IPv4 address is the IPv4-mapped IPv6 address ::ffff:a.b.c.d; NCCL needs a RoCE v2
entry (UDP-encapsulated) for it. The index can differ per node and move between boots, so the
agent reads it on the node right before a start.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class GidMatch:
    hca: str
    port: int
    index: int


def mapped_gid(address: str) -> str:
    """The GID text sysfs shows for an IPv4 address: 0000:0000:0000:0000:0000:ffff:0a00:0002."""
    packed = ipaddress.IPv4Address(address).packed
    return "0000:0000:0000:0000:0000:ffff:" + f"{packed[0]:02x}{packed[1]:02x}:{packed[2]:02x}{packed[3]:02x}"


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:  # empty GID slots answer EINVAL
        return None


def find_roce_v2_gid(sysfs_root: str, hcas: list[str] | tuple[str, ...], address: str) -> GidMatch | None:
    """The first RoCE v2 GID mapping `address` on the listed HCAs (in their order), or None."""
    want = mapped_gid(address)
    for spec in hcas:
        hca, _, port_only = spec.partition(":")
        ports_dir = os.path.join(sysfs_root, "class", "infiniband", hca, "ports")
        try:
            ports = sorted((p for p in os.listdir(ports_dir) if p.isdigit()), key=int)
        except OSError:
            continue
        for port in ports:
            if port_only and port != port_only:
                continue
            gids_dir = os.path.join(ports_dir, port, "gids")
            try:
                indices = sorted((i for i in os.listdir(gids_dir) if i.isdigit()), key=int)
            except OSError:
                continue
            for index in indices:
                if _read(os.path.join(gids_dir, index)) != want:
                    continue
                if _read(os.path.join(ports_dir, port, "gid_attrs", "types", index)) == "RoCE v2":
                    return GidMatch(hca, int(port), int(index))
    return None
