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


def test_parse_meminfo_finds_the_fields_wherever_they_are_and_reads_a_missing_total_as_zero():
    assert memory.parse_meminfo(b"MemFree: 3 kB\nMemAvailable: 5 kB") == (0, 5120)
    assert memory.parse_meminfo(b"MemAvailable: 5 kB\nMemTotal:  10 kB\n") == (10240, 5120)
    # a field whose name ends another field's name is not taken for it
    assert memory.parse_meminfo(b"XMemTotal: 7 kB\nMemTotal: 9 kB\nMemAvailable: 1 kB\n") == (9216, 1024)


@pytest.mark.parametrize("text", [b"", b"MemTotal:  10 kB\n", b"MemTotal: 10 kB\nXMemAvailable: 5 kB\n"])
def test_meminfo_without_memavailable_is_refused_not_read_as_a_node_out_of_memory(text):
    with pytest.raises(memory.MeminfoInvalid, match="no MemAvailable line"):
        memory.parse_meminfo(text)


def test_a_meminfo_read_without_memavailable_is_read_again_before_it_counts(tmp_path):
    write(tmp_path, "proc/meminfo", "MemTotal: 100 kB\nMemAvailable: 40 kB\n")
    sampler = memory.MemorySampler(proc_root=str(tmp_path / "proc"), cgroup_root=str(tmp_path / "cg"))
    reads = iter([b"", b"MemTotal: 100 kB\n", b"MemTotal: 100 kB\nMemAvailable: 40 kB\n"])
    sampler._meminfo.read = lambda: next(reads)  # two torn reads, then a whole one
    assert sampler.sample().mem_available == 40 * 1024
    sampler._meminfo.read = lambda: b""
    with pytest.raises(memory.MeminfoInvalid):
        sampler.sample()


def test_the_cgroup_limit_is_reread_once_a_second_and_usage_only_while_there_is_a_limit(tmp_path):
    write(tmp_path, "proc/meminfo", "MemTotal: 16000000 kB\nMemAvailable: 8000000 kB\n")
    write(tmp_path, "cg/cgroup.controllers", "memory\n")
    write(tmp_path, "cg/memory.max", "max\n")
    write(tmp_path, "cg/memory.current", f"{100 << 20}\n")
    now = [10.0]
    sampler = memory.MemorySampler(str(tmp_path / "proc"), str(tmp_path / "cg"), clock=lambda: now[0])
    first = sampler.sample()
    assert first.cgroup_limit == 0 and first.cgroup_usage == 0 and first.available == 8000000 * 1024
    write(tmp_path, "cg/memory.max", f"{1 << 30}\n")  # an operator sets a limit
    now[0] = 10.5
    assert sampler.sample().cgroup_limit == 0  # not re-read within the second
    now[0] = 11.0
    limited = sampler.sample()
    assert limited.cgroup_limit == 1 << 30 and limited.cgroup_usage == 100 << 20
    assert limited.available == (1 << 30) - (100 << 20)


def test_the_rank_memory_reader_follows_the_control_group_and_reopens_after_a_failed_read(tmp_path):
    write(tmp_path, "system.slice/dsv41-rank.service/memory.current", "4096\n")
    group = ["/system.slice/dsv41-rank.service"]
    reader = memory.RankMemoryReader(lambda: group[0], str(tmp_path))
    assert reader() == 4096
    write(tmp_path, "system.slice/dsv41-rank.service/memory.current", "8192\n")
    assert reader() == 8192  # the open file is re-read, not cached
    group[0] = ""
    assert reader() == 0  # no rank: unknown
    group[0] = "/system.slice/other.service"
    assert reader() == 0  # a group without the file
    write(tmp_path, "system.slice/other.service/memory.current", "12\n")
    assert reader() == 12  # found once it exists: a failed read is retried
    write(tmp_path, "memory/system.slice/v1.service/memory.usage_in_bytes", "77\n")
    group[0] = "/system.slice/v1.service"
    assert reader() == 77  # cgroup v1's memory controller
    reader.close()


def sample(at, available, rank=0, psi=False):
    return memory.Sample(at, 0, available, 0, 0, available, memory.NO_PRESSURE, memory.NO_PRESSURE, rank, psi)


def sent_times(gate, samples):
    return [[round(s.at_monotonic_s, 3) for s in gate.offer(x)] for x in samples]


def test_without_a_threshold_every_sample_is_sent():
    gate = memory.ChangeFilter(memory.SendPolicy())
    assert sent_times(gate, [sample(0.05 * i, 1000) for i in range(5)]) == [[0.0], [0.05], [0.1], [0.15], [0.2]]


def test_a_quiet_node_sends_one_sample_per_heartbeat():
    gate = memory.ChangeFilter(memory.SendPolicy(min_change_bytes=1000, heartbeat_s=1.0, replay=4))
    sent = [t for batch in sent_times(gate, [sample(0.05 * i, 10_000 + (i % 3) * 300) for i in range(61)])
            for t in batch]
    assert sent == [0.0, 1.0, 2.0, 3.0]


def test_a_change_is_sent_after_the_samples_held_back_so_a_trend_sees_all_of_it():
    gate = memory.ChangeFilter(memory.SendPolicy(min_change_bytes=1000, heartbeat_s=1.0, replay=3))
    levels = [10_000, 10_100, 10_200, 10_300, 10_400, 10_500, 11_100, 9_000, 8_990, 8_980]
    batches = sent_times(gate, [sample(0.05 * i, level) for i, level in enumerate(levels)])
    # 0.0 first; 0.05..0.25 held (within 1000 of 10_000); 0.3 moved 1100: the last 3 held, then it
    assert batches[:7] == [[0.0], [], [], [], [], [], [0.15, 0.2, 0.25, 0.3]]
    assert batches[7] == [0.35]  # moved 2100 from the last one sent: sent at once, nothing held
    assert batches[8:] == [[], []]


def test_a_psi_trigger_sends_and_the_ranks_memory_alone_does_not():
    # available is what the guard acts on; the rank's memory moves with it or is page cache
    gate = memory.ChangeFilter(memory.SendPolicy(min_change_bytes=1000, heartbeat_s=1.0, replay=8))
    assert sent_times(gate, [sample(0.0, 10_000, rank=0), sample(0.05, 10_000, rank=500),
                             sample(0.1, 10_000, rank=1500)]) == [[0.0], [], []]
    assert sent_times(gate, [sample(0.15, 10_000, rank=1500, psi=True)]) == [[0.05, 0.1, 0.15]]


def test_a_sample_without_details_reads_psi_and_the_rank_only_when_completed(tmp_path):
    write(tmp_path, "proc/meminfo", "MemTotal: 16000000 kB\nMemAvailable: 8000000 kB\n")
    write(tmp_path, "proc/pressure/memory", "some avg10=2.50 avg60=0.00 avg300=0.00 total=77\n")
    reads = []
    sampler = memory.MemorySampler(str(tmp_path / "proc"), str(tmp_path / "cg"),
                                   rank_memory=lambda: reads.append(1) or 4096, clock=lambda: 3.0)
    quick = sampler.sample(details=False)
    assert quick.available == 8000000 * 1024 and quick.some == memory.NO_PRESSURE and quick.rank_memory == 0
    assert reads == []
    full = sampler.with_details(quick)
    assert full.some.avg10 == 2.5 and full.some.total_us == 77 and full.rank_memory == 4096
    assert full.at_monotonic_s == 3.0 and full.available == quick.available and reads == [1]
    assert sampler.sample() == full


def test_the_samples_after_a_change_follow_it_whatever_they_are():
    gate = memory.ChangeFilter(memory.SendPolicy(min_change_bytes=1000, heartbeat_s=1.0, replay=0, follow=2))
    levels = [10_000, 12_000, 12_000, 12_000, 12_000]
    assert sent_times(gate, [sample(0.05 * i, level) for i, level in enumerate(levels)]) == \
        [[0.0], [0.05], [0.1], [0.15], []]


def test_a_wakeup_waits_out_its_timeout_unless_set_and_is_cleared_by_the_wait():
    import threading
    import time
    wakeup = memory.Wakeup()
    t0 = time.monotonic()
    assert wakeup.wait(0.03) is False and time.monotonic() - t0 >= 0.029
    wakeup.set()
    wakeup.set()
    assert wakeup.wait(5.0) is True  # at once
    assert wakeup.wait(0.0) is False  # both sets were consumed by that one wait
    threading.Timer(0.05, wakeup.set).start()
    t0 = time.monotonic()
    assert wakeup.wait(5.0) is True and time.monotonic() - t0 < 2.0
    wakeup.close()
    wakeup.set()  # after close: nothing, no error
