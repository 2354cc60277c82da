"""The drain before a restart that can wait, inside rank 0's SGLang HTTP server.

POST /dsv41/drain {"reason": ...} makes rank 0 refuse new requests (503 with the reason and a
Retry-After, dsv41/drain.py) while what is in flight goes on; DELETE /dsv41/drain admits them
again; GET says which. The coordinator posts it before a planned restart and watches GET
/dsv41/inflight until nothing is left.

Installed with the in-flight route (adapter/inflight.py, switched by DSV41_INFLIGHT_ROUTE) when
SGLang imports `sglang.srt.entrypoints.http_server`: the routes with `app.add_route`, the refusal
as a plain ASGI middleware (a streaming answer passes through it untouched). Both are in place
before SGLang's launch adds its API-key middleware, which therefore wraps them: a caller without
the key gets SGLang's 401, not the drain's answer. The state is this HTTP process's (SGLang's
single-tokenizer mode, which dsv41 runs; each of several tokenizer workers would hold its own).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

from dsv41.drain import PATH, DrainState, answer, refusal, refuses


class DrainGate:
    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> None:
        self._clock = clock
        self._say = say
        self.state = DrainState()  # the event loop's thread only reads and writes it

    def handle(self, method: str, body: object) -> tuple[int, dict[str, Any]]:
        """One request to /dsv41/drain: its status and body; the state changes as it says."""
        before = self.state
        status, self.state, out = answer(before, method, body, self._clock())
        if self.state.reason != before.reason:
            self._say(f"dsv41-adapter: drain: refusing new requests: {self.state.reason}" if self.state.draining
                      else "dsv41-adapter: drain: lifted, admitting new requests")
        return status, out

    def refused(self, method: str, path: str) -> tuple[int, list[tuple[bytes, bytes]], bytes] | None:
        """The raw 503 answer for a request the drain turns away; None: let it through."""
        state = self.state
        if not refuses(state, method, path):
            return None
        status, headers, body = refusal(state.reason)
        data = json.dumps(body).encode()
        raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        raw += [(name.lower().encode(), value.encode()) for name, value in headers.items()]
        return status, raw, data

    def middleware(self) -> type:
        gate = self

        class DrainRefusal:
            """Answers a new request itself while draining; passes everything else on."""

            def __init__(self, app: Any) -> None:
                self.app = app

            async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
                found = gate.refused(scope.get("method", ""), scope.get("path", "")) \
                    if scope.get("type") == "http" else None
                if found is None:
                    await self.app(scope, receive, send)
                    return
                status, headers, data = found
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": data})

        return DrainRefusal

    def install(self, app: Any) -> None:
        from starlette.requests import Request
        from starlette.responses import JSONResponse

        async def dsv41_drain(request: Request) -> JSONResponse:
            body: object = None
            if request.method == "POST":
                try:
                    body = json.loads(await request.body() or b"null")
                except ValueError:
                    body = None
            status, out = self.handle(request.method, body)
            return JSONResponse(out, status_code=status)

        if any(getattr(r, "path", None) == PATH for r in getattr(app, "routes", ())):
            return
        app.add_route(PATH, dsv41_drain, methods=["GET", "POST", "DELETE"], include_in_schema=False)
        app.add_middleware(self.middleware())
