import pytest

from agent import memory, roce

pytestmark = pytest.mark.unit


def write(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_parse_meminfo_and_pressure():
    assert memory.parse_meminfo(b"MemTotal:       1000 kB\nMemFree: 1 kB\nMemAvailable:    600 kB\n") == (1024000, 614400)
    some, full = memory.parse_pressure(b"some avg10=1.50 avg60=0.20 avg300=0.00 total=1234\n"
                                       b"full avg10=0.50 avg60=0.10 avg300=0.00 total=99\n")
    assert some == memory.Pressure(1.5, 0.2, 0.0, 1234) and full.total_us == 99


def test_available_is_the_tighter_of_memavailable_and_the_cgroup_v1_limit(tmp_path):
    write(tmp_path, "proc/meminfo", "MemTotal: 16000000 kB\nMemAvailable: 8000000 kB\n")
    write(tmp_path, "proc/pressure/memory", "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    write(tmp_path, "cg/memory/memory.limit_in_bytes", f"{1 << 30}\n")
    write(tmp_path, "cg/memory/memory.usage_in_bytes", f"{768 << 20}\n")
    s = memory.MemorySampler(str(tmp_path / "proc"), str(tmp_path / "cg"), clock=lambda: 5.0).sample()
    assert s.mem_available == 8000000 * 1024 and s.cgroup_limit == 1 << 30
    assert s.available == 256 << 20 and s.at_monotonic_s == 5.0


def test_unlimited_cgroup_v2_means_memavailable_binds(tmp_path):
    write(tmp_path, "proc/meminfo", "MemTotal: 16000000 kB\nMemAvailable: 8000000 kB\n")
    write(tmp_path, "cg/cgroup.controllers", "memory\n")
    write(tmp_path, "cg/memory.max", "max\n")
    write(tmp_path, "cg/memory.current", "123\n")
    s = memory.MemorySampler(str(tmp_path / "proc"), str(tmp_path / "cg")).sample()
    assert s.cgroup_limit == 0 and s.available == s.mem_available
    assert s.some == memory.NO_PRESSURE  # no /proc/pressure: zeros, not an error


def test_gid_lookup_picks_the_roce_v2_entry_for_the_ipv4_mapped_address(tmp_path):
    port = tmp_path / "class/infiniband/rocep1s0f1/ports/1"
    entries = {0: ("fe80:0000:0000:0000:0000:0000:0000:0001", "IB/RoCE v1"),
               1: ("fe80:0000:0000:0000:0000:0000:0000:0001", "RoCE v2"),
               2: (roce.mapped_gid("10.0.0.2"), "IB/RoCE v1"),
               3: (roce.mapped_gid("10.0.0.2"), "RoCE v2")}
    for index, (gid, kind) in entries.items():
        write(port, f"gids/{index}", gid + "\n")
        write(port, f"gid_attrs/types/{index}", kind + "\n")
    write(port, "gids/4", "0000:0000:0000:0000:0000:0000:0000:0000\n")  # empty slot, no type file
    assert roce.mapped_gid("10.0.0.2") == "0000:0000:0000:0000:0000:ffff:0a00:0002"
    match = roce.find_roce_v2_gid(str(tmp_path), ["rocep1s0f0", "rocep1s0f1"], "10.0.0.2")
    assert match == roce.GidMatch("rocep1s0f1", 1, 3)
    assert roce.find_roce_v2_gid(str(tmp_path), ["rocep1s0f1"], "10.0.0.3") is None
    assert roce.find_roce_v2_gid("/sys", ["rocep1s0f0"], "10.0.0.2") is None  # this machine has no RDMA
