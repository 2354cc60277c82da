"""The node's PSI for every resource (/proc/pressure/{cpu,memory,io}), for GetStatus and the metrics."""

from __future__ import annotations

from .memory import Pressure, parse_pressure

RESOURCES = ("cpu", "memory", "io")


class NodePressure:
    def __init__(self, proc_root: str = "/proc"):
        self._root = proc_root

    def read(self) -> dict[str, tuple[Pressure, Pressure]]:
        """resource -> (some, full); a resource the kernel does not report (no PSI) is left out."""
        out = {}
        for resource in RESOURCES:
            try:
                with open(f"{self._root}/pressure/{resource}", "rb") as f:
                    some, full = parse_pressure(f.read())
            except (OSError, ValueError, KeyError):
                continue
            out[resource] = (some, full)
        return out
