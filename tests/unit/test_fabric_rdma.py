"""RDMA devices from sysfs: a DGX Spark's layout (fixtures/sysfs_spark) and this machine's real
/sys (agent.fabric.sysfs, agent.fabric.checks, agent.fabric.checker)."""

import shutil
from pathlib import Path

import pytest

from agent.fabric.checker import FabricChecker
from agent.fabric.checks import mapped_ipv4, rdma_checks
from agent.fabric.spec import check_fabric
from agent.fabric.sysfs import RdmaSysfs
from agent.roce import find_roce_v2_gid

pytestmark = pytest.mark.unit
SPARK = Path(__file__).parent / "fixtures" / "sysfs_spark"
CABLED = ["rocep1s0f0", "rocep1s0f1"]


def request(hcas=CABLED, address="10.0.0.2"):
    return check_fabric(hcas=hcas, iface="", address=address, mtu=0, socket_ifaces=[], peers=[])


def checks_of(root, hcas=CABLED, address="10.0.0.2"):
    sysfs = RdmaSysfs(str(root))
    present = sysfs.devices()
    devices = {name: sysfs.device(name) for name in present or []}
    for h in hcas:
        devices.setdefault(h.split(":")[0], None)
    checks, netdevs, gid = rdma_checks(request(hcas, address), present, devices, sysfs.base)
    return {c.name: c for c in checks}, netdevs, gid


@pytest.fixture
def spark(tmp_path):
    root = tmp_path / "sys"
    shutil.copytree(SPARK, root)
    return root


def test_sysfs_reader_sees_the_spark_layout():
    sysfs = RdmaSysfs(str(SPARK))
    assert sysfs.devices() == ["roceP2p1s0f0", "roceP2p1s0f1", "rocep1s0f0", "rocep1s0f1"]
    dev = sysfs.device("rocep1s0f1")
    assert dev.netdevs == ("enp1s0f1np1",)
    (port,) = dev.ports
    assert (port.state, port.phys_state, port.link_layer) == ("4: ACTIVE", "5: LinkUp", "Ethernet")
    assert [g.index for g in port.gids] == [0, 1, 2, 3, 4, 5]  # the empty slots 6 and 7 are skipped
    assert [g.type for g in port.gids] == ["IB/RoCE v1", "RoCE v2"] * 3
    assert mapped_ipv4(port.gids[5].gid) == "10.0.0.2" and mapped_ipv4(port.gids[0].gid) is None
    assert sysfs.device("mlx5_0") is None


def test_spark_passes_and_finds_the_gid_index_nccl_needs():
    checks, netdevs, gid = checks_of(SPARK)
    assert all(c.ok for c in checks.values()), checks
    assert netdevs == {"rocep1s0f0": "enp1s0f0np0", "rocep1s0f1": "enp1s0f1np1"}
    assert (gid.hca, gid.port, gid.index, gid.ndev) == ("rocep1s0f1", 1, 5, "enp1s0f1np1")
    assert checks["RoCE v2 GID for 10.0.0.2"].detail == \
        "rocep1s0f1 port 1 index 5 (netdev enp1s0f1np1): NCCL_IB_GID_INDEX=5"
    assert checks["rocep1s0f1 port 1"].detail == "4: ACTIVE, 5: LinkUp, Ethernet, netdev enp1s0f1np1"
    # The same answer StartRank uses to fill NCCL_IB_GID_INDEX.
    match = find_roce_v2_gid(str(SPARK), CABLED, "10.0.0.2")
    assert (match.hca, match.port, match.index) == (gid.hca, gid.port, gid.index)
    # One index for every HCA: on rocep1s0f0 index 5 is empty, its IPv4 RoCE v2 GID is at 3.
    warn = checks["rocep1s0f0 port 1 GID index"]
    assert warn.ok and warn.warning
    assert "NCCL_IB_GID_INDEX=5 applies to every HCA; here index 5 is empty" in warn.detail
    assert "RoCE v2 IPv4 GID is index 3" in warn.detail


def test_the_other_qsfp_port_is_down():
    checks, _, gid = checks_of(SPARK, hcas=["roceP2p1s0f0", "roceP2p1s0f1"])
    down = checks["roceP2p1s0f1 port 1"]
    assert not down.ok
    assert down.detail.startswith("state 1: DOWN, phys_state 3: Disabled: no physical link")
    assert "ip link show enP2p1s0f1np1" in down.detail
    assert gid is None
    assert not checks["RoCE v2 GID for 10.0.0.2"].ok


def test_missing_gid_says_what_is_there():
    checks, _, gid = checks_of(SPARK, address="10.0.0.9")
    c = checks["RoCE v2 GID for 10.0.0.9"]
    assert gid is None and not c.ok
    assert c.detail.startswith("no RoCE v2 GID for 10.0.0.9 on rocep1s0f0, rocep1s0f1: ")
    assert "10.0.22.2 (rocep1s0f0 index 3), 10.0.0.2 (rocep1s0f1 index 5)" in c.detail


def test_address_on_an_hca_that_ib_hca_does_not_list():
    checks, _, gid = checks_of(SPARK, hcas=["rocep1s0f0"])
    assert gid is None
    assert "10.0.0.2 is on rocep1s0f1 port 1 index 5, which IB_HCA does not list" in \
        checks["RoCE v2 GID for 10.0.0.2"].detail


def test_roce_v1_only(spark):
    (spark / "class/infiniband/rocep1s0f1/ports/1/gid_attrs/types/5").write_text("IB/RoCE v1\n")
    checks, _, gid = checks_of(spark)
    assert gid is None
    assert "only RoCE v1 entries: rocep1s0f1 port 1 index 4 (IB/RoCE v1); rocep1s0f1 port 1 index 5" in \
        checks["RoCE v2 GID for 10.0.0.2"].detail


def test_unreadable_type_is_not_taken_for_v2(spark):
    (spark / "class/infiniband/rocep1s0f1/ports/1/gid_attrs/types/5").unlink()  # EINVAL
    _, _, gid = checks_of(spark)
    assert gid is None


def test_port_and_device_problems(spark):
    checks, _, _ = checks_of(spark, hcas=["rocep1s0f1:2", "mlx5_0"])
    assert checks["rocep1s0f1 port 2"].detail == "no such port (ports: 1)"
    assert checks["mlx5_0"].detail == ("no such RDMA device; this node has roceP2p1s0f0, roceP2p1s0f1, rocep1s0f0, "
                                       "rocep1s0f1: fix IB_HCA")
    (spark / "class/infiniband/rocep1s0f0/ports/1/link_layer").write_text("InfiniBand\n")
    checks, _, _ = checks_of(spark)
    assert not checks["rocep1s0f0 port 1"].ok
    assert checks["rocep1s0f0 port 1"].detail.startswith("link layer InfiniBand: RoCE needs Ethernet")
    shutil.rmtree(spark / "class/infiniband/rocep1s0f1/device/net")
    checks, _, _ = checks_of(spark)
    assert checks["rocep1s0f1 netdev"].ok and checks["rocep1s0f1 netdev"].detail == "enp1s0f1np1"  # from the GIDs


def test_no_rdma_devices(tmp_path):
    checks, _, gid = checks_of(tmp_path)
    assert gid is None and list(checks) == ["rdma devices"]
    assert checks["rdma devices"].detail.startswith(f"no RDMA devices on this node ({tmp_path}/class/infiniband is "
                                                    "missing)")
    (tmp_path / "class/infiniband").mkdir(parents=True)
    checks, _, _ = checks_of(tmp_path)
    assert "class/infiniband is empty" in checks["rdma devices"].detail


def test_this_machines_real_sys():
    """The check runs against the real /sys: here (no RDMA hardware) it must say so cleanly."""
    present = RdmaSysfs("/sys").devices()
    result = FabricChecker("/sys").check(request(hcas=["rocep1s0f0"]))
    assert not result.ok and result.gid_index == -1
    if not present:
        assert [c.name for c in result.checks] == ["rdma devices"]
        assert result.checks[0].detail.startswith("no RDMA devices on this node (/sys/class/infiniband is")
    else:  # a machine with RDMA devices: every listed one is looked at
        assert any(c.name.startswith("rocep1s0f0") for c in result.checks)
