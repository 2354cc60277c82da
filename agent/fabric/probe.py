"""The netlink and TCP half of the fabric check, run as a child: `python3 -m agent.fabric.probe`.

Reads {"ifaces": [...], "peers": [{"address", "port"}], "connect_timeout_s": s} on stdin and
prints one JSON object: per interface its operstate, flags, carrier, MTU and IPv4 addresses
(or null when it does not exist), per peer the route the kernel would use (interface, gateway,
source) and the result of a TCP connect. It imports pyroute2, which the agent itself must not.
"""

from __future__ import annotations

import errno
import json
import socket
import sys
import threading
import time

IFF_UP = 0x1
_ERRORS = {errno.ECONNREFUSED: "refused", errno.EHOSTUNREACH: "host unreachable",
           errno.ENETUNREACH: "network unreachable", errno.ETIMEDOUT: "timeout"}


def links(ipr, names: list[str]) -> dict:
    out: dict = {}
    for name in names:
        found = ipr.link_lookup(ifname=name)
        if not found:
            out[name] = None
            continue
        index = found[0]
        (link,) = ipr.get_links(index)
        addrs = [f"{a.get_attr('IFA_LOCAL') or a.get_attr('IFA_ADDRESS')}/{a['prefixlen']}"
                 for a in ipr.get_addr(index=index, family=socket.AF_INET)]
        out[name] = {"index": index, "operstate": link.get_attr("IFLA_OPERSTATE") or "UNKNOWN",
                     "admin_up": bool(link["flags"] & IFF_UP), "carrier": link.get_attr("IFLA_CARRIER"),
                     "mtu": link.get_attr("IFLA_MTU"), "ipv4": addrs}
    return out


def route(ipr, address: str) -> dict:
    try:
        (answer, *_) = ipr.route("get", dst=address)
    except Exception as exc:  # NetlinkError(101, 'Network is unreachable') and friends
        code = getattr(exc, "code", None)
        return {"error": errno.errorcode.get(code, str(exc)) if isinstance(code, int) else str(exc)}
    oif = answer.get_attr("RTA_OIF")
    name = None
    if oif:
        (link,) = ipr.get_links(oif)
        name = link.get_attr("IFLA_IFNAME")
    return {"oif": name, "gateway": answer.get_attr("RTA_GATEWAY"), "src": answer.get_attr("RTA_PREFSRC")}


def connect(address: str, port: int, timeout_s: float) -> dict:
    started = time.monotonic()
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.connect((address, port))
        except socket.timeout:
            return {"ok": False, "error": "timeout"}
        except OSError as exc:
            return {"ok": False, "error": _ERRORS.get(exc.errno, exc.strerror or str(exc))}
    return {"ok": True, "ms": round((time.monotonic() - started) * 1000, 2)}


def main() -> int:
    request = json.loads(sys.stdin.read() or "{}")
    timeout = float(request.get("connect_timeout_s", 1.5))
    peers = request.get("peers", [])
    results: list = [None] * len(peers)

    def one(i: int, peer: dict) -> None:
        results[i] = connect(peer["address"], int(peer["port"]), timeout)

    threads = [threading.Thread(target=one, args=(i, p), daemon=True) for i, p in enumerate(peers)]
    for t in threads:
        t.start()
    try:
        from pyroute2 import IPRoute
    except ImportError as exc:
        sys.stderr.write(f"pyroute2 is not installed ({exc}): apt-get install python3-pyroute2\n")
        return 3
    with IPRoute() as ipr:
        out = {"links": links(ipr, request.get("ifaces", [])),
               "routes": [route(ipr, p["address"]) for p in peers]}
    for t in threads:
        t.join()
    out["connects"] = results
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
