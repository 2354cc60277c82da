"""What a failed call to a node's agent means for the node, in an operator's words.

gRPC reports a frozen node as DEADLINE_EXCEEDED and a stopped agent, an unplugged cable, a wrong
address and a refused certificate all as UNAVAILABLE, each with the transport's own words in its
details. Status, the bring-up's waiting lines and incidents say instead what happened to the node
and what to suspect, from this one function.
"""

from __future__ import annotations

# Words of gRPC's and the kernel's in an UNAVAILABLE status's details, lower-cased, by what they
# mean for the node; the first group that matches wins.
_REFUSED = ("connection refused",)
_NO_ROUTE = ("no route to host", "network is unreachable", "host is unreachable", "network unreachable")
_NO_NAME = ("dns resolution failed", "name or service not known", "domain name not found",
            "could not resolve", "temporary failure in name resolution", "no address associated")
_TLS = ("handshake", "ssl", "certificate", "peer name", "tsi_")
_TIMED_OUT = ("timed out", "timeout occurred", "deadline exceeded", "connect timeout")
_DROPPED = ("connection reset", "socket closed", "broken pipe", "goaway", "end of tcp stream",
            "connection aborted", "stream removed", "connection closed")

_SILENT_HINT = "(frozen, powered off or cut off?)"


def _seconds(value: float) -> str:
    return f"{value:.1f} s" if value < 10 else f"{value:.0f} s"


def _any(words: tuple[str, ...], text: str) -> bool:
    return any(word in text for word in words)


def _not_answering(silent_s: float | None) -> str:
    return f"not answering for {_seconds(silent_s)} {_SILENT_HINT}" if silent_s else f"not answering {_SILENT_HINT}"


def meaning(code: str, details: str, silent_s: float | None = None) -> str:
    """What `code` (a grpc.StatusCode's name, or an exception's type name) with `details` says
    about the node, as a phrase that follows the node or its agent ("spark3: ...", "agent at
    10.0.0.3:7441 ..."). `silent_s`: how long the node has not answered, when known (the time
    since it was last heard from, or at least the call's own timeout)."""
    text = (details or "").lower()
    if code == "DEADLINE_EXCEEDED":
        return _not_answering(silent_s)
    if code == "UNAVAILABLE":
        if _any(_REFUSED, text):
            return "refusing connections: dsv41-agent not running (stopped, restarting or failed?)"
        if _any(_NO_ROUTE, text):
            return "not reachable on the network: no route to host (powered off, cut off or a wrong address?)"
        if _any(_NO_NAME, text):
            return "has a name that does not resolve (DNS): check its address in the configuration"
        if _any(_TLS, text):
            return (f"refused in the TLS handshake (a certificate of another cluster or node?): {details}")
        if _any(_TIMED_OUT, text):
            return _not_answering(silent_s)
        if _any(_DROPPED, text):
            return "dropped the connection (its agent restarting, or the network failing?)"
        return f"unreachable: {details}" if details else "unreachable"
    if code == "UNAUTHENTICATED":
        return f"refused our certificate (issued by another cluster's CA?): {details}"
    if code == "PERMISSION_DENIED":
        return f"refused the request: {details}"
    if code == "UNIMPLEMENTED":
        return "does not know this call: its agent is an older dsv41 (install one version on every node)"
    if code == "CANCELLED":
        return "call cancelled before it answered"
    return f"{code}: {details}"


def unreachable(code: str) -> bool:
    """Whether the node could not be reached at all (it may come back: worth waiting for), as
    opposed to an answer, a refusal among them."""
    return code in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
