"""The generated stubs load under /usr/bin/python3 with Debian's protobuf 3.21 and grpcio 1.51."""

import subprocess
from concurrent import futures

import pytest

from tests.configtext import REPO


pytestmark = pytest.mark.unit

CHECK = r"""
import sys
sys.path.insert(0, sys.argv[1])
import google.protobuf, grpc
from dsv41.v1 import agent_pb2, agent_pb2_grpc, control_pb2, control_pb2_grpc
print(google.protobuf.__version__, grpc.__version__)
"""


def test_stubs_load_with_the_distribution_packages():
    proc = subprocess.run(["/usr/bin/python3", "-I", "-c", CHECK, str(REPO)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    protobuf, grpc_version = proc.stdout.split()
    # protobuf's Python package 4.21.x is the 3.21 runtime; grpcio 1.51 is Debian 12's
    assert protobuf.startswith(("3.21.", "4.21.")), protobuf
    assert grpc_version.startswith("1.51."), grpc_version


def test_committed_stubs_match_the_protos():
    proc = subprocess.run([str(REPO / "tools" / "gen-protos.sh"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr + proc.stdout


def test_agent_service_round_trip_over_a_real_channel():
    import grpc
    from dsv41.v1 import agent_pb2, agent_pb2_grpc

    class Servicer(agent_pb2_grpc.AgentServicer):
        def StartRank(self, request, context):
            assert request.spec.env["NCCL_IB_GID_INDEX"] == "@ROCE_GID_INDEX@"
            return agent_pb2.StartRankResponse(
                outcome=agent_pb2.StartRankResponse.STARTED,
                rank=agent_pb2.RankState(unit="dsv41-rank.service", main_pid=42,
                                         fingerprint=request.spec.fingerprint))

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    agent_pb2_grpc.add_AgentServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = agent_pb2_grpc.AgentStub(channel)
            spec = agent_pb2.RankSpec(argv=["/bin/true"], env={"NCCL_IB_GID_INDEX": "@ROCE_GID_INDEX@"},
                                      fingerprint="abc")
            reply = stub.StartRank(agent_pb2.StartRankRequest(spec=spec), timeout=5)
            assert reply.outcome == agent_pb2.StartRankResponse.STARTED
            assert reply.rank.main_pid == 42 and reply.rank.fingerprint == "abc"
            with pytest.raises(grpc.RpcError) as info:
                stub.StopRank(agent_pb2.StopRankRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop(0)
