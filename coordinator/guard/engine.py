"""Rank 0's HTTP API as the guard uses it: the in-flight list and /abort_request (stdlib only); and
the drain before a planned restart (coordinator/drain.py).

One persistent HTTP/1.1 connection, re-opened when it breaks: an abort is two round trips on an
open socket, not two TCP handshakes.
"""

from __future__ import annotations

import http.client
import json
import threading
import urllib.parse

from dsv41 import drain as drain_contract
from dsv41 import inflight as contract
from dsv41.inflight import InflightList

INFLIGHT_PATH = contract.PATH
ABORT_PATH = "/abort_request"


class EngineError(Exception):
    """Rank 0 did not take the request; the message says what happened."""


class EngineUnreachable(EngineError):
    """Rank 0's HTTP server did not answer at all (not running, refusing connections, timed out)."""


class EngineApi:
    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 1.0):
        url = urllib.parse.urlsplit(base_url)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"{base_url!r}: the guard talks plain http://host:port to rank 0")
        self.base_url = base_url.rstrip("/")
        self._host, self._port = url.hostname, url.port or 80
        self._timeout = timeout_s
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def _request(self, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
        data = json.dumps(body).encode() if body is not None else None
        with self._lock:
            for attempt in (1, 2):  # a kept-alive socket the server closed fails once; retry on a new one
                if self._conn is None:
                    self._conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
                try:
                    self._conn.request(method, path, body=data, headers=self._headers)
                    response = self._conn.getresponse()
                    return response.status, response.read()
                except (OSError, http.client.HTTPException) as exc:
                    self._conn.close()
                    self._conn = None
                    if attempt == 2 or isinstance(exc, TimeoutError):
                        raise EngineUnreachable(f"{method} {self.base_url}{path}: {exc or type(exc).__name__}") from None
        raise AssertionError("unreachable")

    def inflight(self) -> InflightList:
        """Rank 0's requests in flight; `unavailable` says why there is no list (404: an image
        without the adapter's route)."""
        try:
            status, body = self._request("GET", INFLIGHT_PATH)
        except EngineError as exc:
            return InflightList(unavailable=str(exc))
        if status == 404:
            return InflightList(unavailable=f"GET {INFLIGHT_PATH}: 404, rank 0 has no in-flight route "
                                            "(an image without the dsv41 adapter)")
        if status != 200:
            return InflightList(unavailable=f"GET {INFLIGHT_PATH}: HTTP {status}")
        try:
            return parse_inflight(json.loads(body))
        except (ValueError, TypeError, KeyError) as exc:
            return InflightList(unavailable=f"GET {INFLIGHT_PATH}: unexpected answer: {exc}")

    def abort(self, rid: str | None) -> None:
        """Aborts one request (SGLang matches the rid as a prefix) or, with rid None, all of them."""
        body = {"rid": rid or "", "abort_all": rid is None}
        status, text = self._request("POST", ABORT_PATH, body)
        if status != 200:
            raise EngineError(f"POST {ABORT_PATH} {body}: HTTP {status}: {text[:200].decode(errors='replace')}")

    def drain(self, reason: str) -> None:
        """Rank 0 refuses new requests from now on, naming `reason`; EngineError when it did not
        take it (404: a rank without the adapter's drain route)."""
        self._drain_call("POST", {"reason": reason})

    def undrain(self) -> None:
        """Rank 0 admits new requests again."""
        self._drain_call("DELETE", None)

    def drain_state(self) -> dict:
        """GET /dsv41/drain: {"draining": bool, "reason": ..., "since_s": ...}; {} from a rank 0
        without the route. EngineError when it does not answer."""
        status, text = self._request("GET", drain_contract.PATH)
        if status == 404:
            return {}
        if status != 200:
            raise EngineError(f"GET {drain_contract.PATH}: HTTP {status}: {text[:200].decode(errors='replace')}")
        try:
            body = json.loads(text)
        except ValueError as exc:
            raise EngineError(f"GET {drain_contract.PATH}: unexpected answer: {exc}") from None
        return body if isinstance(body, dict) else {}

    def _drain_call(self, method: str, body: dict | None) -> None:
        status, text = self._request(method, drain_contract.PATH, body)
        if status != 200:
            raise EngineError(f"{method} {drain_contract.PATH}: HTTP {status}: {text[:200].decode(errors='replace')}")


def parse_inflight(body: object) -> InflightList:
    """The route's JSON (dsv41/inflight.py) as an InflightList; ValueError when it is not one."""
    return contract.parse(body)
