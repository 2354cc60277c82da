"""GET /dsv41/inflight on the real HTTP server app, over real ReqState objects."""

import asyncio
import json
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import asgi_get, emit, installer, marked  # noqa: E402

from sglang.srt.entrypoints import http_server  # noqa: E402
from sglang.srt.managers.io_struct import GenerateReqInput  # noqa: E402
from sglang.srt.managers.tokenizer_manager import ReqState, TokenizerManager  # noqa: E402
from sglang.srt.observability.req_time_stats import APIServerReqTimeStats  # noqa: E402


def state(obj, created_ago, first_token=False):
    stats = APIServerReqTimeStats()
    stats.set_created_time(time.perf_counter() - created_ago)
    st = ReqState([], False, asyncio.Event(), obj, stats)
    if first_token:
        st.out_list.append({"text": "x", "meta_info": {}})
    return st


async def main():
    result = {
        "marked_send_one": marked(TokenizerManager._send_one_request),
        "routes": [r.path for r in http_server.app.routes if getattr(r, "path", "") == "/dsv41/inflight"],
    }
    result["before_start"] = await asgi_get(http_server.app, "/dsv41/inflight")
    manager = SimpleNamespace(rid_to_state={})
    http_server.set_global_state(SimpleNamespace(tokenizer_manager=manager, template_manager=None, scheduler_info={}))
    long_prompt = GenerateReqInput(text="a very long document", rid="long-1")
    manager.rid_to_state["long-1"] = state(long_prompt, 30.0)
    manager.rid_to_state["chat-2"] = state(GenerateReqInput(input_ids=list(range(900)), rid="chat-2"), 2.0, first_token=True)
    done = state(GenerateReqInput(input_ids=[1, 2], rid="done-3"), 1.0)
    done.finished = True
    manager.rid_to_state["done-3"] = done
    # SGLang's own dispatch path records the tokenized prompt length (the hook runs before the body).
    tokenized = SimpleNamespace(rid="long-1", input_ids=list(range(150_000)))
    coro = TokenizerManager._send_one_request(manager, tokenized)
    if asyncio.iscoroutine(coro):
        coro.close()
    status, body = await asgi_get(http_server.app, "/dsv41/inflight")
    result["status"], result["body"] = status, json.loads(body) if status == 200 else body
    return result


inst = installer()
out = asyncio.run(main())
out["mode"] = inst.mode() if inst else None
emit(out)
