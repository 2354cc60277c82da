"""/server_info and /get_server_info through SGLang's own HTTP app (sglang.srt.entrypoints.http_server),
with the server args resolved and published as run_server does and a tokenizer manager whose
get_internal_state answers as the schedulers' do (each its own resolved server args, through
get_context().resolved_server_args_dict(), as InternalState.get_internal_state builds them).
Prints booleans and field values other than the key, never the key.

argv: [extra SGLang flags...]
"""

import asyncio
import json
import os
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import asgi_get, emit, installer, marked  # noqa: E402

from sglang.srt.server_args import prepare_server_args  # noqa: E402

server_args = prepare_server_args(["--model-path", "dummy", *sys.argv[1:]])
path = os.environ.get("DSV41_API_KEY_FILE")
key = open(path).read().strip() if path else server_args.api_key

from sglang.srt.runtime_context import get_context, publish  # noqa: E402

server_args.resolve_once()
publish(server_args, role="tokenizer")

from sglang.srt.entrypoints import http_server  # noqa: E402


class Manager:
    """What /server_info reads from the tokenizer manager."""

    def __init__(self, args):
        self.server_args = args
        self.startup_time = 0.0

    async def get_internal_state(self):
        return [get_context().resolved_server_args_dict()]  # one scheduler (DP 1)


http_server.set_global_state(http_server._GlobalState(tokenizer_manager=Manager(server_args), template_manager=None,
                                                      scheduler_info={}))
result = {"key_set": key is not None}
for route in ("/server_info", "/get_server_info"):
    status, body = asyncio.run(asgi_get(http_server.app, route))
    info = json.loads(body) if status == 200 else {}
    name = route.strip("/")
    result[f"{name}_status"] = status
    result[f"{name}_has_key"] = key is not None and key in body
    result[f"{name}_api_key"] = info.get("api_key") if info.get("api_key") in (None, "<redacted>") else "the key"
    states = info.get("internal_states") or [{}]
    result[f"{name}_scheduler_api_key"] = states[0].get("api_key") if states[0].get("api_key") in (None, "<redacted>") \
        else "the key"
    result[f"{name}_tp_size"] = info.get("tp_size")
from sglang.srt.sampling.watermarking import core  # noqa: E402

result["marked_redact"] = marked(core.redact_watermark_secrets)
result["marked_in_http_server"] = marked(http_server.redact_watermark_secrets)
inst = installer()
result["on"] = inst is not None and inst.is_on("api_key")
emit(result)
