"""The gateway's HTTP worker API as sglang-router 0.3.2 serves it (stdlib HTTP only).

0.3.2 keys workers by a UUID it makes on each add: POST /workers {"url", "api_key"} answers 202
{"worker_id"} and registers in the background; GET /workers lists the registered ones; DELETE
/workers/<id> answers 202 and removes in the background. /add_worker, /remove_worker and
/list_workers do not exist there (404). /readiness and /health need no key; /workers does, when
the gateway runs with --api-key.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass

# One answer from the gateway on the same host; a slow one is a gateway in trouble, not one to wait on.
API_TIMEOUT_S = 3.0
# A group's rank 0 answers /health at once when it serves; longer is a group not ready to be routed.
WORKER_HEALTH_TIMEOUT_S = 2.0


class GatewayError(Exception):
    """A request to the gateway failed: `status` is its HTTP status, or None when it did not answer."""

    def __init__(self, what: str, status: int | None, detail: str):
        answered = f"answered {status}" if status is not None else "no answer"
        super().__init__(f"gateway: {what}: {answered}: {detail}")
        self.what = what
        self.status = status
        self.detail = detail

    @property
    def unreachable(self) -> bool:
        return self.status is None


@dataclass(frozen=True)
class GatewayWorker:
    id: str
    url: str
    healthy: bool


def _headers(api_key: str | None, body: bool) -> dict[str, str]:
    headers = {"Content-Type": "application/json"} if body else {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def _exchange(method: str, url: str, body: dict | None, api_key: str | None, timeout_s: float) -> tuple[int, str]:
    """(status, text) of one request; an HTTP error status is an answer too. OSError when none came."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=_headers(api_key, body is not None), method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def worker_healthy(url: str, api_key: str | None = None, timeout_s: float = WORKER_HEALTH_TIMEOUT_S) -> bool:
    """Whether a worker (a group's rank 0) answers GET /health with 200 now."""
    try:
        status, _ = _exchange("GET", f"{url}/health", None, api_key, timeout_s)
    except OSError:
        return False
    return status == 200


class GatewayApi:
    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = API_TIMEOUT_S):
        self.base_url = base_url.rstrip("/")
        self._api_key = api_key
        self._timeout_s = timeout_s

    def _call(self, method: str, path: str, what: str, body: dict | None = None,
              expect: tuple[int, ...] = (200,)) -> tuple[int, object]:
        try:
            status, text = _exchange(method, f"{self.base_url}{path}", body, self._api_key, self._timeout_s)
        except OSError as exc:
            raise GatewayError(f"{what} ({method} {self.base_url}{path})", None,
                               str(getattr(exc, "reason", exc))) from None
        if status not in expect:
            detail = text.strip()[:200] or "(empty body)"
            if status == 401:
                detail += ": the gateway refused the API key (is it the cluster's?)"
            raise GatewayError(f"{what} ({method} {self.base_url}{path})", status, detail)
        try:
            return status, json.loads(text) if text.strip() else {}
        except ValueError:
            return status, text

    def readiness(self) -> tuple[bool, int, int]:
        """(ready, healthy workers, workers): ready when at least one worker is healthy. 0.3.2 answers
        503 without counts when none is."""
        status, body = self._call("GET", "/readiness", "readiness", expect=(200, 503))
        counts = body if isinstance(body, dict) else {}
        return status == 200, int(counts.get("healthy_workers", 0)), int(counts.get("total_workers", 0))

    def workers(self) -> list[GatewayWorker]:
        """The registered workers; a worker whose add is still pending is not among them."""
        _, body = self._call("GET", "/workers", "list workers")
        try:
            return [GatewayWorker(str(w["id"]), str(w["url"]), bool(w.get("is_healthy")))
                    for w in body["workers"]]  # type: ignore[index]
        except (KeyError, TypeError) as exc:
            raise GatewayError("list workers (GET /workers)", 200,
                               f"unexpected answer ({exc!r} missing): {str(body)[:200]}") from None

    def add(self, url: str, api_key: str | None) -> str:
        """Queues the worker's registration; its id. `api_key`: what the gateway sends the worker as
        Bearer (without it the gateway passes each client's own Authorization through)."""
        body = {"url": url} if api_key is None else {"url": url, "api_key": api_key}
        _, answer = self._call("POST", "/workers", f"add worker {url}", body, expect=(200, 201, 202))
        worker_id = answer.get("worker_id") if isinstance(answer, dict) else None
        if not worker_id:
            raise GatewayError(f"add worker {url} (POST /workers)", 202, f"no worker_id in {str(answer)[:200]}")
        return str(worker_id)

    def remove(self, worker_id: str) -> None:
        """Queues the worker's removal; 404 (already gone) counts as done."""
        self._call("DELETE", f"/workers/{worker_id}", f"remove worker {worker_id}", expect=(200, 202, 204, 404))
