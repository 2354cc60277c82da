"""RDMA devices as sysfs shows them under <root>/class/infiniband.

Layout per device: ports/<n>/{state,phys_state,link_layer}, ports/<n>/gids/<i> (eight hex
groups), ports/<n>/gid_attrs/{types,ndevs}/<i> ("RoCE v2" or "IB/RoCE v1", and the netdev;
empty slots answer EINVAL), device/net/<netdev>.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

EMPTY_GID = "0000:0000:0000:0000:0000:0000:0000:0000"


@dataclass(frozen=True)
class Gid:
    index: int
    gid: str
    type: str | None   # "RoCE v2", "IB/RoCE v1", or None when unreadable
    ndev: str | None


@dataclass(frozen=True)
class Port:
    number: int
    state: str | None        # "4: ACTIVE"
    phys_state: str | None   # "5: LinkUp"
    link_layer: str | None   # "Ethernet"
    gids: tuple[Gid, ...]    # populated slots only


@dataclass(frozen=True)
class Device:
    name: str
    netdevs: tuple[str, ...]
    ports: tuple[Port, ...]


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:  # empty GID slots answer EINVAL; a missing file is the same to us
        return None


def _numbered(directory: str) -> list[int]:
    try:
        return sorted(int(n) for n in os.listdir(directory) if n.isdigit())
    except OSError:
        return []


class RdmaSysfs:
    def __init__(self, root: str = "/sys"):
        self._base = os.path.join(root, "class", "infiniband")

    @property
    def base(self) -> str:
        return self._base

    def devices(self) -> list[str] | None:
        """Device names, or None when the class directory itself is missing (no RDMA core loaded)."""
        try:
            return sorted(os.listdir(self._base))
        except FileNotFoundError:
            return None
        except OSError:
            return []

    def device(self, name: str) -> Device | None:
        top = os.path.join(self._base, name)
        if not os.path.isdir(top):
            return None
        try:
            netdevs = tuple(sorted(os.listdir(os.path.join(top, "device", "net"))))
        except OSError:
            netdevs = ()
        ports = tuple(self._port(os.path.join(top, "ports", str(n)), n) for n in _numbered(os.path.join(top, "ports")))
        return Device(name, netdevs, ports)

    def _port(self, directory: str, number: int) -> Port:
        gids = []
        for index in _numbered(os.path.join(directory, "gids")):
            gid = _read(os.path.join(directory, "gids", str(index)))
            if not gid or gid == EMPTY_GID:
                continue
            gids.append(Gid(index, gid, _read(os.path.join(directory, "gid_attrs", "types", str(index))),
                            _read(os.path.join(directory, "gid_attrs", "ndevs", str(index)))))
        return Port(number, _read(os.path.join(directory, "state")), _read(os.path.join(directory, "phys_state")),
                    _read(os.path.join(directory, "link_layer")), tuple(gids))
