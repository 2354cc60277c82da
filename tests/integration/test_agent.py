"""The node agent against a real systemd (booted in systemd-nspawn), driven over gRPC."""

from __future__ import annotations

import statistics
import time

import grpc
import pytest

from dsv41.v1 import agent_pb2 as pb
from testbed.nspawn import Node
from tests.integration.agentnode import SRC, channel, free_port, install_agent, spec, wait
from tests.integration.test_guard_memory import HeadMemory

pytestmark = pytest.mark.integration
RANK = "dsv41-rank.service"


@pytest.fixture(scope="module")
def booted(rootfs):
    node = Node("agent1", rootfs, memory_writable=True)
    node.boot()
    port = free_port()
    try:
        install_agent(node, port)
        yield node, channel(port)
    finally:
        node.stop()


@pytest.fixture
def agent(booted):
    node, stub = booted
    yield node, stub
    stub.StopRank(pb.StopRankRequest(deadline_s=5), timeout=30)


def unit_state(node):
    return node.show(RANK, "ActiveState", "MainPID", "LoadState")


def test_start_status_stop_of_a_rank(agent):
    node, stub = agent
    reply = stub.StartRank(pb.StartRankRequest(spec=spec()), timeout=30)
    assert reply.outcome == pb.StartRankResponse.STARTED
    assert reply.rank.active_state == "active" and reply.rank.main_pid > 0
    state = unit_state(node)
    assert state["ActiveState"] == "active" and int(state["MainPID"]) == reply.rank.main_pid
    props = node.show(RANK, "KillMode", "LimitMEMLOCK", "SyslogIdentifier", "TimeoutStopUSec")
    assert props["KillMode"] == "mixed" and props["LimitMEMLOCK"] == "infinity"
    assert props["SyslogIdentifier"] == "dsv41-rank" and props["TimeoutStopUSec"] == "10s"
    status = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
    assert status.node == "agent1" and status.rank.fingerprint == "a1"
    assert status.rank.main_pid == reply.rank.main_pid and status.agent_version
    assert len(status.adapter_digest) == 64
    # the rank's output is in the journal with the node's fields
    lines = wait(lambda: node.journal(matches=["DSV41_NODE=agent1", "DSV41_RANK=1", "SYSLOG_IDENTIFIER=dsv41-rank"]))
    assert any("stand-in rank up" in e["MESSAGE"] for e in lines)
    stopped = stub.StopRank(pb.StopRankRequest(deadline_s=10), timeout=30)
    assert stopped.outcome == pb.StopRankResponse.CLEAN and stopped.leftover_processes == 0
    assert unit_state(node)["ActiveState"] == "inactive"
    again = stub.StopRank(pb.StopRankRequest(deadline_s=10), timeout=30)
    assert again.outcome == pb.StopRankResponse.WAS_NOT_RUNNING


def test_same_spec_is_a_no_op_and_another_spec_needs_replace(agent):
    _, stub = agent
    first = stub.StartRank(pb.StartRankRequest(spec=spec(fingerprint="b1")), timeout=30)
    same = stub.StartRank(pb.StartRankRequest(spec=spec(fingerprint="b1")), timeout=30)
    assert same.outcome == pb.StartRankResponse.ALREADY_RUNNING and same.rank.main_pid == first.rank.main_pid
    with pytest.raises(grpc.RpcError) as info:
        stub.StartRank(pb.StartRankRequest(spec=spec(fingerprint="b2")), timeout=30)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "running plan b1" in info.value.details()
    replaced = stub.StartRank(pb.StartRankRequest(spec=spec(fingerprint="b2"), replace=True), timeout=30)
    assert replaced.outcome == pb.StartRankResponse.REPLACED
    assert replaced.rank.fingerprint == "b2" and replaced.rank.main_pid != first.rank.main_pid


def test_agent_restart_keeps_the_rank_and_readopts_it(agent):
    node, stub = agent
    started = stub.StartRank(pb.StartRankRequest(spec=spec(fingerprint="c1")), timeout=30)
    pid = started.rank.main_pid
    node.run(["systemctl", "restart", "dsv41-agent.service"], timeout=60)
    status = wait(lambda: _status_or_none(stub))
    assert status is not None
    assert status.rank.main_pid == pid and status.rank.fingerprint == "c1"
    assert int(unit_state(node)["MainPID"]) == pid
    again = stub.StartRank(pb.StartRankRequest(spec=spec(fingerprint="c1")), timeout=30)
    assert again.outcome == pb.StartRankResponse.ALREADY_RUNNING and again.rank.main_pid == pid
    adopted = node.journal(matches=["DSV41_EVENT=rank_adopted"])
    assert adopted, "the agent logs that it re-adopted the rank"
    # stopping the agent leaves the rank running too
    node.run(["systemctl", "stop", "dsv41-agent.service"], timeout=60)
    assert int(unit_state(node)["MainPID"]) == pid
    node.run(["systemctl", "start", "dsv41-agent.service"], timeout=60)
    assert wait(lambda: _status_or_none(stub)).rank.main_pid == pid


def test_the_unit_keeps_the_adapter_version_it_started_with_across_an_upgrade_and_agent_restart(agent):
    """The version is recorded on the transient unit (LogExtraFields), so an agent restarted after
    the adapter was replaced reads what the running rank loaded, and the installed one beside it."""
    node, stub = agent
    version_py = f"{SRC}/adapter/dsv41/version.py"
    node.write_file(version_py, 'VERSION = "0.9.0"\n')
    try:
        started = stub.StartRank(pb.StartRankRequest(spec=spec(fingerprint="e1")), timeout=30)
        assert started.rank.adapter_version == "0.9.0"
        lines = wait(lambda: node.journal(matches=["DSV41_ADAPTER_VERSION=0.9.0", "SYSLOG_IDENTIFIER=dsv41-rank"]))
        assert any("stand-in rank up" in e["MESSAGE"] for e in lines)  # the rank's own lines carry it
        node.write_file(version_py, 'VERSION = "0.9.0+1"\n')  # the upgrade; then dpkg restarts the agent
        node.run(["systemctl", "restart", "dsv41-agent.service"], timeout=60)
        status = wait(lambda: _status_or_none(stub))
        assert status.rank.main_pid == started.rank.main_pid and status.rank.fingerprint == "e1"
        assert status.rank.adapter_version == "0.9.0" and status.adapter_version == "0.9.0+1"
        stale = wait(lambda: node.journal(fields=("MESSAGE", "DSV41_ADAPTER_INSTALLED"),
                                          matches=["DSV41_EVENT=rank_adapter_stale"]))
        assert stale[-1]["DSV41_ADAPTER_INSTALLED"] == "0.9.0+1"
        again = stub.StartRank(pb.StartRankRequest(spec=spec(fingerprint="e1")), timeout=30)
        assert again.outcome == pb.StartRankResponse.ALREADY_RUNNING  # the version is not part of the plan
        replaced = stub.StartRank(pb.StartRankRequest(spec=spec(fingerprint="e2"), replace=True), timeout=30)
        assert replaced.rank.adapter_version == "0.9.0+1"  # the next start loads the installed one
    finally:
        node.run(["rm", "-rf", f"{SRC}/adapter/dsv41"])


def _status_or_none(stub):
    try:
        return stub.GetStatus(pb.GetStatusRequest(), timeout=2)
    except grpc.RpcError:
        return None


def test_rank_exit_status_3_is_reported_then_reset(agent):
    node, stub = agent
    events = stub.WatchRank(pb.WatchRankRequest(), timeout=30)
    first = next(events)
    assert first.rank.active_state in ("inactive", "absent")
    started = stub.StartRank(pb.StartRankRequest(spec=spec("--exit-after", "0.5", "--code", "3", fingerprint="d1")),
                             timeout=30)
    exit_event = None
    for event in events:
        if event.rank.last_exit.invocation_id == started.rank.invocation_id:
            exit_event = event
            break
    events.cancel()
    assert exit_event.rank.last_exit.status == 3 and exit_event.rank.last_exit.code == "exited"
    assert exit_event.rank.last_exit.result == "exit-code"
    # recorded, then reset: the unit does not stay failed
    assert wait(lambda: unit_state(node)["ActiveState"] == "inactive")
    status = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
    assert status.rank.last_exit.status == 3
    logged = wait(lambda: node.journal(matches=["DSV41_EVENT=rank_exit"], fields=None))
    assert logged[-1]["DSV41_EXIT_STATUS"] == "3" and logged[-1]["PRIORITY"] == "3"


def test_rank_exit_0_is_still_an_exit(agent):
    _, stub = agent
    stub.StartRank(pb.StartRankRequest(spec=spec("--exit-after", "0.3", fingerprint="e1")), timeout=30)
    status = wait(lambda: (s := stub.GetStatus(pb.GetStatusRequest(), timeout=10)).rank.active_state
                  in ("inactive", "absent") and s)
    assert status and status.rank.last_exit.result == "success" and status.rank.last_exit.status == 0


def test_missing_binary_fails_the_start_with_a_clear_message(agent):
    node, stub = agent
    bad = spec(fingerprint="f1")
    bad.argv[:] = ["/usr/local/bin/missing-rank", "--port", "1"]
    with pytest.raises(grpc.RpcError) as info:
        stub.StartRank(pb.StartRankRequest(spec=bad), timeout=30)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "/usr/local/bin/missing-rank could not be run" in info.value.details()
    assert "203" in info.value.details()
    assert unit_state(node)["ActiveState"] in ("inactive", "")


def test_a_rank_ignoring_sigterm_is_killed_at_the_deadline(agent):
    node, stub = agent
    stub.StartRank(pb.StartRankRequest(spec=spec("--ignore-term", "--children", "2", fingerprint="a7",
                                                  stop_timeout_s=60)), timeout=30)
    assert wait(lambda: len(_rank_processes(node)) == 3)
    t0 = time.monotonic()
    reply = stub.StopRank(pb.StopRankRequest(deadline_s=2), timeout=60)
    elapsed = time.monotonic() - t0
    assert reply.outcome == pb.StopRankResponse.KILLED_AFTER_DEADLINE
    assert elapsed < 30  # the unit's own 60 s TimeoutStopSec did not apply
    assert reply.leftover_processes == 0
    assert _rank_processes(node) == []


def _rank_processes(node):
    out = node.run(["pgrep", "-f", "standin_rank.py"], check=False).stdout
    return [int(p) for p in out.split()]


def test_stop_leaves_no_children_even_without_sigterm_handlers(agent):
    node, stub = agent
    stub.StartRank(pb.StartRankRequest(spec=spec("--children", "3", fingerprint="b8")), timeout=30)
    assert wait(lambda: len(_rank_processes(node)) == 4)
    reply = stub.StopRank(pb.StopRankRequest(deadline_s=10), timeout=60)
    assert reply.outcome == pb.StopRankResponse.CLEAN
    assert _rank_processes(node) == []


@pytest.mark.parametrize("interval_ms", [20, 50])
def test_memory_stream_delivers_samples_at_the_asked_rate(agent, interval_ms):
    _, stub = agent
    stream = stub.WatchMemory(pb.WatchMemoryRequest(interval_ms=interval_ms), timeout=30)
    samples = []
    for sample in stream:
        samples.append(sample)
        if len(samples) == 60:
            break
    stream.cancel()
    gaps = [(b.at_monotonic_s - a.at_monotonic_s) * 1000 for a, b in zip(samples, samples[1:])]
    assert statistics.median(gaps) == pytest.approx(interval_ms, rel=0.25)
    last = samples[-1]
    assert last.mem_total_bytes > 0 and last.mem_available_bytes > 0
    assert 0 < last.available_bytes <= last.mem_available_bytes


def test_memory_stream_sends_a_quiet_node_at_the_heartbeat_and_every_sample_around_a_change(agent):
    node, stub = agent
    interval_s, around, threshold = 0.02, 4, 128 << 20
    # The node's cgroup gets a limit, so "available" is the node's own headroom, not the host's
    # MemAvailable, which other work on this machine moves by as much as the test's rank does.
    memory = HeadMemory(node)
    memory.limit_to(1 << 30)
    try:
        time.sleep(1.2)  # the agent re-reads the limit once a second
        # quiet: about one sample per 300 ms heartbeat, not one per 20 ms (75 in 1.5 s)
        stream = stub.WatchMemory(pb.WatchMemoryRequest(interval_ms=20, min_change_bytes=threshold,
                                                        heartbeat_ms=300), timeout=60)
        quiet = []
        for sample in stream:
            quiet.append(sample)
            if sample.at_monotonic_s - quiet[0].at_monotonic_s >= 1.5:
                break
        stream.cancel()
        # a change, with no heartbeat in the way: after the first sample nothing is sent until
        # available memory moves 128 MiB; that sample comes with the `around` samples held back
        # before it and the `around` after it, consecutive samples taken (seq), about one sampling
        # interval apart
        stream = stub.WatchMemory(pb.WatchMemoryRequest(interval_ms=20, min_change_bytes=threshold,
                                                        heartbeat_ms=60_000, replay_samples=around,
                                                        follow_samples=around), timeout=30)
        samples = []
        for sample in stream:
            samples.append(sample)
            if len(samples) == 1:
                time.sleep(0.3)  # more than `around` ticks pass before the rank starts
                stub.StartRank(pb.StartRankRequest(spec=spec("--allocate-mb", "200", fingerprint="a1")), timeout=30)
            if len(samples) >= 2 + 2 * around:
                break
        stream.cancel()
        stub.StopRank(pb.StopRankRequest(deadline_s=10), timeout=60)
    finally:
        (memory.dir / "memory.limit_in_bytes").write_text("-1")
    assert quiet[0].cgroup_limit_bytes > 0 and samples[0].cgroup_limit_bytes > 0
    assert 4 <= len(quiet) <= 12, [round(q.at_monotonic_s - quiet[0].at_monotonic_s, 3) for q in quiet]
    assert all(b.seq - a.seq > 1 for a, b in zip(quiet, quiet[1:]))  # the unchanged ones were not sent
    first, burst = samples[0], samples[1:2 + 2 * around]
    report = [(x.seq, (first.available_bytes - x.available_bytes) >> 20, x.rank_memory_bytes >> 20) for x in samples]
    assert first.seq == 1 and burst[0].seq > 1 + around, report
    assert [x.seq for x in burst] == list(range(burst[0].seq, burst[0].seq + 2 * around + 1)), report
    moved = [abs(x.available_bytes - first.available_bytes) >= threshold for x in burst]
    assert moved.index(True) == around, report  # the held-back ones had not moved 128 MiB; this one had
    assert burst[around].rank_memory_bytes > 64 << 20, report  # the rank's allocation is what moved it
    gaps = [b.at_monotonic_s - a.at_monotonic_s for a, b in zip(burst, burst[1:])]
    assert 0.5 * interval_s < statistics.median(gaps) < 2 * interval_s, gaps


def test_memory_sample_sees_the_node_cgroup_limit_and_the_rank(booted, agent):
    node, stub = agent
    started = stub.StartRank(pb.StartRankRequest(spec=spec("--allocate-mb", "96", fingerprint="c9")), timeout=30)
    # The stand-in says it is up once every page is touched: until then its memory still grows, and
    # GetStatus reads MemoryCurrent before the sample.
    this_run = [f"_SYSTEMD_INVOCATION_ID={started.rank.invocation_id}"]
    assert wait(lambda: any("stand-in rank up" in e.get("MESSAGE", "") for e in node.journal(matches=this_run)),
                timeout=20), "the stand-in did not finish allocating"
    status = wait(lambda: (s := stub.GetStatus(pb.GetStatusRequest(), timeout=10)).memory.rank_memory_bytes
                  > 90 << 20 and s)
    assert status, "the rank's cgroup memory shows up in the samples"
    assert status.rank.memory_current_bytes > 90 << 20


@pytest.mark.parametrize("request_fields, fragment", [
    ({"interval_ms": 5}, "20..10000"),
    ({"interval_ms": 50, "heartbeat_ms": 500}, "only with min_change_bytes"),
    ({"interval_ms": 50, "min_change_bytes": 1 << 41}, "min_change_bytes 2199023255552: must be 0.."),
    ({"interval_ms": 50, "min_change_bytes": 1 << 20, "heartbeat_ms": 20}, "heartbeat_ms 20: must be interval_ms"),
    ({"interval_ms": 50, "min_change_bytes": 1 << 20, "follow_samples": 1000}, "follow_samples 1000: must be 0..256"),
])
def test_memory_stream_rejects_bad_requests(agent, request_fields, fragment):
    _, stub = agent
    with pytest.raises(grpc.RpcError) as info:
        next(stub.WatchMemory(pb.WatchMemoryRequest(**request_fields), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and fragment in info.value.details()


@pytest.mark.parametrize("mutate, code, fragment", [
    (lambda s: s.env.update({"LD_PRELOAD": "/x.so"}), "PERMISSION_DENIED", "LD_PRELOAD"),
    (lambda s: s.argv.__setitem__(0, "/bin/sh"), "PERMISSION_DENIED", "executable /bin/sh: not allowed"),
    (lambda s: setattr(s, "runtime", "container"), "PERMISSION_DENIED", "runtime container: not allowed"),
    (lambda s: s.binds.add(source="/", target="/mnt"), "PERMISSION_DENIED", "read-write binds are refused"),
    (lambda s: s.binds.add(source="/", target="/mnt", read_only=True), "PERMISSION_DENIED",
     "bind source /: not under this node's ALLOWED_PATHS"),
    (lambda s: setattr(s, "fingerprint", "NOT HEX"), "INVALID_ARGUMENT", "fingerprint"),
    (lambda s: setattr(s, "stop_timeout_s", 0), "INVALID_ARGUMENT", "stop_timeout_s"),
    (lambda s: s.env.update({"BAD NAME": "1"}), "INVALID_ARGUMENT", "env 'BAD NAME'"),
    (lambda s: s.argv.append("a\0b"), "INVALID_ARGUMENT", "without NUL"),
])
def test_bad_requests_are_refused_and_start_nothing(agent, mutate, code, fragment):
    node, stub = agent
    request = spec(fingerprint="bad1")
    mutate(request)
    with pytest.raises(grpc.RpcError) as info:
        stub.StartRank(pb.StartRankRequest(spec=request), timeout=30)
    assert info.value.code() == getattr(grpc.StatusCode, code)
    assert fragment in info.value.details()
    assert unit_state(node)["ActiveState"] in ("inactive", "")


CID_PROBE = """
import sys
sys.path.insert(0, {src!r})
from agent import rankspec
from agent.systemd import Systemd
# The container runtime's unit as the agent sends it, but with a shell for the docker client: it
# writes the id where `docker run --cidfile` would, from inside the sandbox.
launch = rankspec.RankLaunch("container", ("/bin/sh", "-c", "echo {cid} > {cidfile} && exec sleep 60"), {{}}, {{}},
                             (), (), (), 10, 0, 0, "ab", 1, "g1", "", cache_dir="/var/cache/dsv41/container")
props = rankspec.unit_properties(launch, {{}}, "agent1", "/var/cache/dsv41/container")
print(Systemd().start_transient("dsv41-cid-probe.service", props, 10))
"""


def test_the_container_runtimes_unit_lets_its_client_write_the_cidfile_and_removes_it_at_stop(booted):
    from agent.container import CIDFILE
    from tests.integration.agentnode import SRC
    node, _ = booted
    cid = "7e" * 32
    node.run(["mkdir", "-p", "/var/cache/dsv41/container"])
    node.run(["python3", "-c", CID_PROBE.format(src=SRC, cid=cid, cidfile=CIDFILE)], timeout=30)
    try:
        assert wait(lambda: node.run(["cat", CIDFILE], check=False).stdout.strip() == cid), \
            node.journal(unit="dsv41-cid-probe.service")
        props = node.show("dsv41-cid-probe.service", "RuntimeDirectory", "ProtectSystem", "ActiveState")
        assert props == {"RuntimeDirectory": "dsv41-rank", "ProtectSystem": "strict", "ActiveState": "active"}
    finally:
        node.run(["systemctl", "stop", "dsv41-cid-probe.service"], check=False)
    # removed with the unit: the next `docker run --cidfile` finds no file (docker refuses one that exists)
    assert node.run(["test", "-e", "/run/dsv41-rank"], check=False).returncode != 0


GATEWAY = "dsv41-gateway.service"


def test_the_gateway_unit_is_restarted_on_failure_kept_replaced_and_stopped(agent):
    """No sglang_router in the node: its gateway exits at once, and systemd restarts it every 2 s
    (what a crashing router gets); the fingerprint is read back from the unit's environment."""
    node, stub = agent

    def gateway(run=True, *args):
        request = pb.GatewaySpec(rank=spec(), python="/usr/bin/python3", args=["--port", "30999", *args], run=run,
                                 stop_timeout_s=10)
        return stub.SetGateway(request, timeout=60)
    try:
        first = gateway()
        assert first.message == "started" and len(first.fingerprint) == 16
        props = node.show(GATEWAY, "Restart", "RestartUSec", "RuntimeMaxUSec", "TimeoutStopUSec", "SyslogIdentifier")
        assert props == {"Restart": "on-failure", "RestartUSec": "2s", "RuntimeMaxUSec": "infinity",
                         "TimeoutStopUSec": "10s", "SyslogIdentifier": "dsv41-gateway"}
        assert wait(lambda: int(node.show(GATEWAY, "NRestarts")["NRestarts"]) >= 1, timeout=15)
        lines = wait(lambda: node.journal(matches=["SYSLOG_IDENTIFIER=dsv41-gateway", "DSV41_UNIT=dsv41-gateway"]))
        assert any("No module named" in e["MESSAGE"] for e in lines)
        kept = gateway()
        assert kept.message == "kept" and kept.fingerprint == first.fingerprint
        changed = gateway(True, "--policy", "round_robin")
        assert changed.message == "restarted" and changed.fingerprint != first.fingerprint
    finally:
        stopped = gateway(False)
    assert stopped.message == "stopped" and stopped.active_state == "inactive"
    assert node.show(GATEWAY, "ActiveState")["ActiveState"] == "inactive"
