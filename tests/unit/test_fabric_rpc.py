"""CheckFabric end to end through its RPC handler, on the Spark sysfs fixture and this machine's
loopback: the netlink probe does the interface work and the agent's process never imports
pyroute2 (about 22 MB the head cannot spare)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
SPARK = Path(__file__).parent / "fixtures" / "sysfs_spark"

SCRIPT = """
import json, sys
import agent.service  # everything the daemon imports
from agent.rpc_nodechecks import NodeCheckRpcs, build_node_checks
from dsv41.v1 import agent_pb2 as pb

class Settings:
    state_dir = sys.argv[2]
    sysfs_root = sys.argv[1]

class Events:
    def info(self, *a, **k): pass
    def warning(self, *a, **k): pass

settings, events = Settings(), Events()
service = NodeCheckRpcs(settings, events, None, lambda: build_node_checks(settings, None, events))

spec = pb.FabricSpec(hcas=["rocep1s0f0", "rocep1s0f1"], iface="lo", address="10.0.0.2", mtu=65536,
                     socket_ifaces=["lo"], peers=[pb.Peer(name="self", address="127.0.0.1", port=1)])
report = service.CheckFabric(spec, None)
print(json.dumps({"pyroute2": sorted(m for m in sys.modules if m.startswith("pyroute2")),
                  "gid": report.roce_gid_index,
                  "checks": {c.name: [c.ok, c.warning, c.detail] for c in report.checks}}))
"""


def test_check_fabric_through_the_rpc_without_pyroute2_in_the_agent(tmp_path):
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(SPARK), str(tmp_path)], capture_output=True, text=True,
                       cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["pyroute2"] == []
    checks = out["checks"]
    assert out["gid"] == 5 and checks["RoCE v2 GID for 10.0.0.2"][0]
    assert checks["lo link"][0] and checks["lo mtu"] == [True, False, "MTU 65536"]
    # the fixture's netdevs do not exist on this machine: reported, not crashed on
    assert checks["enp1s0f1np1"][0] is False and "no such interface on this node (it is the netdev of rocep1s0f1)" \
        in checks["enp1s0f1np1"][2]
    assert checks["peer self 127.0.0.1:1"][0] is False and "refused via lo" in checks["peer self 127.0.0.1:1"][2]
