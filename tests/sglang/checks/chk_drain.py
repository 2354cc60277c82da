"""/dsv41/drain and the refusal of new requests on the real HTTP server app, behind SGLang's own
API-key middleware added afterwards as its launch does."""

import asyncio
import json
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit  # noqa: E402

from sglang.srt.entrypoints import http_server  # noqa: E402
from sglang.srt.utils.auth import add_api_key_middleware  # noqa: E402

KEY = "drain-check-key"


async def call(method, path, body=None, key=True):
    data = json.dumps(body).encode() if body is not None else b""
    headers = [(b"host", b"localhost"), (b"content-type", b"application/json"),
               (b"content-length", str(len(data)).encode())]
    if key:
        headers.append((b"authorization", f"Bearer {KEY}".encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8888)}
    sent, given = [], [False]

    async def receive():
        if given[0]:
            await asyncio.sleep(3600)  # no disconnect while the route runs
        given[0] = True
        return {"type": "http.request", "body": data, "more_body": False}

    async def send(message):
        sent.append(message)

    try:
        await asyncio.wait_for(http_server.app(scope, receive, send), 5)
    except Exception as exc:  # a real route without SGLang's state fails: what matters is it was reached
        return {"status": None, "error": type(exc).__name__}
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    return {"status": start["status"], "body": body, "retry_after": headers.get("retry-after")}


async def main():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    out = {"routes": [r.path for r in http_server.app.routes if getattr(r, "path", "") == "/dsv41/drain"]}
    out["post_without_key"] = await call("POST", "/dsv41/drain", {"reason": "x"}, key=False)
    out["post"] = await call("POST", "/dsv41/drain", {"reason": "dsv41ctl restart --drain"})
    out["bad_post"] = await call("POST", "/dsv41/drain", {"reason": ""})
    out["chat"] = await call("POST", "/v1/chat/completions", chat)
    out["generate"] = await call("POST", "/generate", {"text": "abc"})
    out["chat_without_key"] = await call("POST", "/v1/chat/completions", chat, key=False)
    out["get"] = await call("GET", "/dsv41/drain")
    out["delete"] = await call("DELETE", "/dsv41/drain")
    out["chat_after"] = await call("POST", "/v1/chat/completions", chat)
    return out


add_api_key_middleware(http_server.app, api_key=KEY, admin_api_key=None)
emit(asyncio.run(main()))
