"""What an agent's transport error says about its node (coordinator.transport), and how an
AgentUnavailable carries it."""

import grpc
import pytest

from coordinator import transport
from coordinator.agents import AgentUnavailable
from tests.rpcfailure import RpcFailure

pytestmark = pytest.mark.unit

# The details as gRPC's core writes them (grpcio 1.5x, 1.6x).
CONNECT = "failed to connect to all addresses; last error: UNKNOWN: ipv4:192.168.241.13:7441: "


@pytest.mark.parametrize("code, details, silent_s, expected", [
    ("DEADLINE_EXCEEDED", "Deadline Exceeded", 12.4, "not answering for 12 s (frozen, powered off or cut off?)"),
    ("DEADLINE_EXCEEDED", "Deadline Exceeded", 3.0, "not answering for 3.0 s (frozen, powered off or cut off?)"),
    ("DEADLINE_EXCEEDED", "Deadline Exceeded", None, "not answering (frozen, powered off or cut off?)"),
    ("UNAVAILABLE", CONNECT + "Failed to connect to remote host: Timeout occurred: FD Shutdown", 10.0,
     "not answering for 10 s (frozen, powered off or cut off?)"),
    ("UNAVAILABLE", CONNECT + "Failed to connect to remote host: connect: Connection refused (111)", None,
     "refusing connections: dsv41-agent not running (stopped, restarting or failed?)"),
    ("UNAVAILABLE", CONNECT + "Failed to connect to remote host: No route to host", None,
     "not reachable on the network: no route to host (powered off, cut off or a wrong address?)"),
    ("UNAVAILABLE", CONNECT + "connect: Network is unreachable (101)", None,
     "not reachable on the network: no route to host (powered off, cut off or a wrong address?)"),
    ("UNAVAILABLE", "DNS resolution failed for spark9:7441: C-ares status is not ARES_SUCCESS qtype=A name=spark9 "
     "is_balancer=0: Domain name not found", None,
     "has a name that does not resolve (DNS): check its address in the configuration"),
    ("UNAVAILABLE", "Socket closed", None, "dropped the connection (its agent restarting, or the network failing?)"),
    ("UNAVAILABLE", "Connection reset by peer", None,
     "dropped the connection (its agent restarting, or the network failing?)"),
    ("UNAVAILABLE", "failed to connect to all addresses", None, "unreachable: failed to connect to all addresses"),
    ("UNIMPLEMENTED", "Method not found!", None,
     "does not know this call: its agent is an older dsv41 (install one version on every node)"),
    ("FAILED_PRECONDITION", "a rank of another plan runs", None, "FAILED_PRECONDITION: a rank of another plan runs"),
])
def test_a_transport_error_says_what_it_means_for_the_node(code, details, silent_s, expected):
    assert transport.meaning(code, details, silent_s) == expected


def test_a_refused_handshake_or_certificate_keeps_the_transports_words():
    ssl = CONNECT + "Ssl handshake failed: SSL_ERROR_SSL: error:1000007d:SSL routines:CERTIFICATE_VERIFY_FAILED"
    said = transport.meaning("UNAVAILABLE", ssl)
    assert said.startswith("refused in the TLS handshake (a certificate of another cluster or node?): ")
    assert said.endswith("CERTIFICATE_VERIFY_FAILED")
    said = transport.meaning("UNAUTHENTICATED", "the caller is not the cluster's coordinator")
    assert said == ("refused our certificate (issued by another cluster's CA?): the caller is not the cluster's "
                    "coordinator")
    assert transport.meaning("PERMISSION_DENIED", "no") == "refused the request: no"


@pytest.mark.parametrize("code, reachable", [("UNAVAILABLE", False), ("DEADLINE_EXCEEDED", False),
                                             ("UNAUTHENTICATED", True), ("PERMISSION_DENIED", True),
                                             ("ConnectionError", True)])
def test_only_a_node_that_cannot_be_reached_is_worth_waiting_for(code, reachable):
    assert transport.unreachable(code) is not reachable


def test_an_agent_error_says_how_long_the_call_waited_unless_the_caller_knows_longer():
    exc = AgentUnavailable("spark3", "GetStatus", RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"),
                           waited_s=3.0)
    assert exc.unreachable and exc.code == "DEADLINE_EXCEEDED"
    assert exc.meaning() == "not answering for 3.0 s (frozen, powered off or cut off?)"
    assert exc.meaning(42.0) == "not answering for 42 s (frozen, powered off or cut off?)"
    assert str(exc) == "spark3: GetStatus: DEADLINE_EXCEEDED: Deadline Exceeded"  # the raw error, for logs


def test_a_diagnosed_cause_is_said_as_diagnosed_and_not_waited_for():
    exc = AgentUnavailable("spark3", "GetStatus", RpcFailure(grpc.StatusCode.UNAVAILABLE, "Peer name spark3 is not "
                           "in peer certificate"), "the agent at spark3:7441 presents a certificate for spark2")
    assert not exc.unreachable
    assert exc.meaning() == "the agent at spark3:7441 presents a certificate for spark2"
