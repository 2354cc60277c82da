"""Random and hostile requests thrown at a running agent: it keeps serving and starts nothing."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv41.v1 import agent_pb2 as pb
from testbed.nspawn import Node
from tests.integration.agentnode import channel, free_port, install_agent

pytestmark = pytest.mark.integration

HOSTILE = ["/", "/etc", "/etc/shadow", "/proc/1/root", "../../etc", "/dev/sda", "/run/docker.sock", "",
           "\x00", "a" * 5000, "/var/lib/../../etc", "$(reboot)", "`id`", ";rm -rf /"]
text = st.one_of(st.sampled_from(HOSTILE), st.text(max_size=40))
env_names = st.one_of(st.sampled_from(["LD_PRELOAD", "PATH", "PYTHONHOME", "BASH_ENV", "LD_AUDIT", "OK_NAME",
                                       "PYTHONPATH", "LD_LIBRARY_PATH", "1BAD", "A B"]), st.text(max_size=12))
# The node allows exactly one executable, and it does not exist: nothing can really start.
executables = st.one_of(st.sampled_from(["/usr/local/bin/missing-rank", "/bin/sh", "/usr/bin/python3", "sh",
                                         "/usr/bin/docker"]), text)
specs = st.builds(
    pb.RankSpec,
    runtime=st.one_of(st.sampled_from(["host", "container", "", "HOST", "chroot"]), text),
    argv=st.lists(text, max_size=6).flatmap(lambda rest: executables.map(lambda exe: [exe, *rest])),
    env=st.dictionaries(env_names, text, max_size=4),
    agent_fills=st.dictionaries(env_names, st.sampled_from(["roce_gid_index", "secret", ""]), max_size=2),
    binds=st.lists(st.builds(pb.Bind, source=text, target=text, read_only=st.booleans()), max_size=3),
    exec_start_pre=st.lists(st.builds(pb.Command, argv=st.lists(text, max_size=3)), max_size=2),
    stop_timeout_s=st.integers(0, 2**32 - 1),
    memory_max_bytes=st.integers(0, 2**64 - 1),
    fingerprint=st.one_of(st.from_regex(r"[0-9a-f]{1,64}", fullmatch=True), text),
    rank=st.integers(-2**31, 2**31 - 1),
    cluster_generation=text,
    fabric_address=st.one_of(st.sampled_from(["10.0.0.2", "999.1.1.1", ""]), text),
    hcas=st.lists(text, max_size=3),
)


@pytest.fixture(scope="module")
def fuzz_agent(rootfs):
    node = Node("fuzz1", rootfs)
    node.boot()
    port = free_port()
    try:
        install_agent(node, port, extra="")
        # narrow what this node allows: one executable that does not exist
        node.run(["sed", "-i", "s|^ALLOWED_EXECUTABLES=.*|ALLOWED_EXECUTABLES=/usr/local/bin/missing-rank|",
                  "/etc/dsv41/agent.env"])
        node.run(["systemctl", "restart", "dsv41-agent.service"], timeout=60)
        yield node, channel(port)
    finally:
        node.stop()


ALLOWED_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED,
                 grpc.StatusCode.FAILED_PRECONDITION}


def test_hostile_start_requests_start_nothing_and_the_agent_keeps_serving(fuzz_agent):
    node, stub = fuzz_agent
    seen_codes = set()

    @settings(max_examples=150, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(spec=specs, replace=st.booleans(), timeout=st.integers(0, 2**32 - 1))
    def throw(spec, replace, timeout):
        try:
            stub.StartRank(pb.StartRankRequest(spec=spec, replace=replace, start_timeout_s=timeout), timeout=30)
        except grpc.RpcError as exc:
            assert exc.code() in ALLOWED_CODES, (exc.code(), exc.details())
            assert exc.details(), "every refusal says why"
            seen_codes.add(exc.code())
        else:
            raise AssertionError(f"a fuzzed request was accepted: {spec}")

    throw()
    assert grpc.StatusCode.INVALID_ARGUMENT in seen_codes and grpc.StatusCode.PERMISSION_DENIED in seen_codes
    for interval in (1, 19, 10_001, 2**32 - 1):
        with pytest.raises(grpc.RpcError) as info:
            next(stub.WatchMemory(pb.WatchMemoryRequest(interval_ms=interval), timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for deadline in (2**32 - 1, 3601):
        with pytest.raises(grpc.RpcError) as info:
            stub.StopRank(pb.StopRankRequest(deadline_s=deadline), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # still serving, nothing started, nothing left failed
    status = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
    assert status.node == "fuzz1"
    assert status.rank.active_state in ("absent", "inactive")
    assert node.show("dsv41-rank.service", "ActiveState")["ActiveState"] == "inactive"
    assert node.journal(matches=["DSV41_EVENT=rank_started"]) == []
    assert node.show("dsv41-agent.service", "NRestarts")["NRestarts"] == "0"
