"""Runs a fabric check: reads sysfs here, spawns the netlink probe, and judges both."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Sequence

from .checks import Check, FabricResult, assemble, interface_checks, peer_checks, rdma_checks, split_hca
from .spec import FabricRequest
from .sysfs import RdmaSysfs

PROBE_ARGV = (sys.executable, "-m", "agent.fabric.probe")
# The directory holding the `agent` package, so the child finds it whatever its cwd.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def probe_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p)
    return env


class FabricChecker:
    def __init__(self, sysfs_root: str = "/sys", probe_argv: Sequence[str] = PROBE_ARGV,
                 connect_timeout_s: float = 1.5, probe_timeout_s: float = 15.0):
        self._sysfs = RdmaSysfs(sysfs_root)
        self._probe_argv = tuple(probe_argv)
        self.connect_timeout_s = connect_timeout_s
        self._probe_timeout = probe_timeout_s

    def check(self, req: FabricRequest) -> FabricResult:
        present = self._sysfs.devices() if req.hcas else []
        devices = {}
        if present:
            # Every present device, not only the listed ones: a fabric address on an unlisted HCA is a hint.
            devices = {name: self._sysfs.device(name) for name in present}
            for spec in req.hcas:
                devices.setdefault(split_hca(spec)[0], None)
        checks, netdevs, gid = rdma_checks(req, present, devices, self._sysfs.base)
        ifaces = list(dict.fromkeys([*([req.iface] if req.iface else []), *req.socket_ifaces, *netdevs.values()]))
        if ifaces or req.peers:
            probe, error = self._probe(ifaces, req)
            if probe is None:
                checks.append(Check("netlink probe", False, error))
            else:
                checks += interface_checks(req, netdevs, probe.get("links", {}))
                fabric = {n for n in [req.iface, *netdevs.values()] if n}
                checks += peer_checks(req, probe.get("routes", []), probe.get("connects", []), fabric,
                                      self.connect_timeout_s)
        return assemble(checks, gid)

    def _probe(self, ifaces: list[str], req: FabricRequest) -> tuple[dict | None, str]:
        peers = [{"address": p.address, "port": p.port} for p in req.peers]
        return run_probe(self._probe_argv, ifaces, peers, self.connect_timeout_s, self._probe_timeout)


def run_probe(argv: Sequence[str], ifaces: list[str], peers: list[dict], connect_timeout_s: float,
              timeout_s: float) -> tuple[dict | None, str]:
    """The netlink probe's answer (agent.fabric.probe), or None and why it gave none."""
    request = {"ifaces": ifaces, "peers": peers, "connect_timeout_s": connect_timeout_s}
    try:
        r = subprocess.run(list(argv), input=json.dumps(request), capture_output=True, text=True,
                           timeout=timeout_s, cwd="/", env=probe_env())
    except subprocess.TimeoutExpired:
        return None, f"the netlink probe did not answer within {timeout_s:g} s"
    except OSError as exc:
        return None, f"cannot start the netlink probe: {exc}"
    if r.returncode != 0:
        return None, f"the netlink probe failed (exit {r.returncode}): {r.stderr.strip()[-500:]}"
    try:
        return json.loads(r.stdout), ""
    except ValueError:
        return None, f"the netlink probe printed no JSON: {r.stdout.strip()[-200:]}"
