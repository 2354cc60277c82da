"""The API key from DSV41_API_KEY_FILE on real SGLang: argv parsed by prepare_server_args, the record
resolved and published as run_server and the HTTP server do, the key checked by SGLang's own
middleware, the start-up `server_args=` log line and a crash dump's pickle. Prints booleans, never
the key.

argv: [extra SGLang flags...]; a refusal exits 1 from inside prepare_server_args (no JSON then).
"""

import asyncio
import inspect
import io
import logging
import os
import re
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import asgi_get, emit, installer, marked  # noqa: E402

from sglang.srt.server_args import prepare_server_args  # noqa: E402

server_args = prepare_server_args(["--model-path", "dummy", *sys.argv[1:]])
path = os.environ.get("DSV41_API_KEY_FILE")
# Read here: a refused file never gets this far. Without the file, the key (if any) is --api-key's.
key = open(path).read().strip() if path else server_args.api_key
result = {"parsed_is_key": key is not None and server_args.api_key == key, "parsed_is_none": server_args.api_key is None}

from sglang.srt.arg_groups.overrides import resolving_view  # noqa: E402
from sglang.srt.entrypoints import engine  # noqa: E402
from sglang.srt.runtime_context import get_serving, publish  # noqa: E402

server_args.resolve_once()  # what run_server does before launching
publish(server_args, role="tokenizer")  # what the HTTP server's process does; it reads get_serving()
serving_key = get_serving().api_key
result["resolved_is_key"] = key is not None and resolving_view(server_args).api_key == key
result["serving_is_key"] = key is not None and serving_key == key
result["serving_is_none"] = serving_key is None

# The start-up line, through SGLang's own logger and formatter, as Engine/_launch_subprocesses write it.
stream = io.StringIO()
handler = logging.StreamHandler(stream)
engine.logger.addHandler(handler)
engine.logger.setLevel(logging.INFO)
engine.logger.info(f"server_args={engine._server_args_for_logging(server_args)}")
engine.logger.removeHandler(handler)
line = stream.getvalue()
result["logged"] = bool(line.startswith("server_args={"))
result["logged_key"] = key is not None and key in line
field = re.search(r"'api_key': ('[^']*'|None)", line).group(1)
result["logged_api_key_field"] = field if field in ("'<redacted>'", "None") else "the key"
result["marked_prepare"] = marked(sys.modules["sglang.srt.server_args"].prepare_server_args)
result["marked_logging"] = marked(engine._server_args_for_logging)
# Every `server_args=` log line of this SGLang goes through the function the adapter redacts.
source = inspect.getsource(engine)
lines = [ln.strip() for ln in source.splitlines() if "server_args=" in ln and "logger." in ln]
result["log_lines"] = len(lines)
result["log_lines_redacted"] = all("_server_args_for_logging(" in ln for ln in lines)

# A crash dump (--crash-dump-folder), as TokenizerManager.dump_requests_before_crash pickles it: the
# real methods on a stand-in manager that holds what they read.
import pickle  # noqa: E402
import types  # noqa: E402

from sglang.srt.managers.tokenizer_manager import TokenizerManager  # noqa: E402

manager = types.SimpleNamespace(server_args=server_args, model_path=server_args.model_path,
                                served_model_name=server_args.served_model_name)
manager.resolved_config_dict = types.MethodType(TokenizerManager.resolved_config_dict, manager)
dump = {"server_args": TokenizerManager._server_args_for_dump(manager),
        "resolved_config": TokenizerManager._dump_config_snapshot(manager)}
blob = pickle.dumps(dump)
result["dump_has_key"] = key is not None and key.encode() in blob
result["dump_config_written"] = dump["resolved_config"] is not None
result["marked_dump"] = [marked(TokenizerManager._server_args_for_dump),
                         marked(TokenizerManager._dump_config_snapshot)]


async def status(app, auth):
    """The status of GET /v1/models with this Authorization header (none when auth is None)."""
    code, _ = await asgi_get(app, "/v1/models", [(b"authorization", auth.encode())] if auth else [])
    return code


# SGLang's own middleware, installed from get_serving() exactly as http_server.launch_server does.
from fastapi import FastAPI  # noqa: E402

from sglang.srt.utils.auth import add_api_key_middleware  # noqa: E402

app = FastAPI()
app.add_api_route("/v1/models", lambda: {"data": []}, methods=["GET"])
if get_serving().api_key or get_serving().admin_api_key:
    add_api_key_middleware(app, api_key=get_serving().api_key, admin_api_key=get_serving().admin_api_key)
result["http_without_key"] = asyncio.run(status(app, None))
result["http_wrong_key"] = asyncio.run(status(app, "Bearer not-the-key-123"))
result["http_with_key"] = asyncio.run(status(app, f"Bearer {key}" if key else None))
inst = installer()
result["on"] = inst is not None and inst.is_on("api_key")
emit(result)
