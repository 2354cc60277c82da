"""One change of a node's fabric under a running group, as the agent reports it (agent/fabric/drift.py
finds it, RankEvent.fabric_changes carries it) and the coordinator describes it in its incident
(coordinator/fabricdrift.py). Standard library only."""

from __future__ import annotations

from dataclasses import dataclass

LINK, MTU, ADDRESS, GID_INDEX = "link", "mtu", "address", "gid_index"


@dataclass(frozen=True)
class FabricChange:
    netdev: str    # the netdev, or for GID_INDEX the HCA
    what: str      # LINK, MTU, ADDRESS, GID_INDEX
    before: str    # "" for an address added
    after: str     # "" for an address removed

    def describe(self) -> str:
        if self.what == ADDRESS:
            return (f"{self.netdev} address {self.after} added" if not self.before
                    else f"{self.netdev} address {self.before} removed" if not self.after
                    else f"{self.netdev} address {self.before} -> {self.after}")
        if self.what == GID_INDEX:
            return f"RoCE v2 GID index of the fabric address {self.before} -> {self.after}"
        return f"{self.netdev} {self.what} {self.before} -> {self.after}"
