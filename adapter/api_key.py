"""api_key: SGLang's API key comes from the file named by DSV41_API_KEY_FILE, never from argv.

`--api-key K` would put the key where every local user can read it (ps, /proc/PID/cmdline) and
into the unit's recorded command line. The coordinator instead puts the key on the head as a 0600
file and sets DSV41_API_KEY_FILE for rank 0 only, the one rank that serves HTTP. Hooks in SGLang
0.5.23:

- AROUND sglang.srt.server_args.prepare_server_args: the one place where both entry points
  (`python -m sglang.launch_server` and `sglang serve`) turn argv into a ServerArgs. The record it
  returns is still unresolved and writable; run_server's resolve_once() then seals it, and the
  HTTP server installs add_api_key_middleware from the resolved api_key. The scheduler and
  detokenizer processes receive that resolved record (pickled) and worker nodes serve no API, so
  nothing else needs the file.
- AFTER sglang.srt.entrypoints.engine._server_args_for_logging: SGLang logs every field in its
  start-up `server_args=...` line; api_key and admin_api_key come out as "<redacted>".
- AFTER sglang.srt.managers.tokenizer_manager.TokenizerManager._server_args_for_dump and
  ._dump_config_snapshot: a crash dump (--crash-dump-folder) pickles the whole ServerArgs and the
  resolved config, the key with them; both come out as dicts with the key "<redacted>".
- AFTER sglang.srt.sampling.watermarking.core.redact_watermark_secrets: SGLang's one function for
  server arguments on their way out. `/server_info` and `/get_server_info` answer with the
  resolved server args, and with every scheduler's (`internal_states`), through it; so do
  Engine.get_server_info and the gRPC server info. SGLang itself hides only the watermark keys
  there: api_key and admin_api_key come out "<redacted>" at any depth.

The adapter is fail_closed (adapter/patching.py): a bad key file, a key also given with
--api-key, a target it cannot patch or an error in a hook stop the rank. Leaving the adapter out
would serve without authentication, or print the key into the journal.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from adapter.keyfile import VARIABLE, KeyFileError, read_key_file
from adapter.patching import AFTER, AROUND, AdapterSpec, Patch, Refused
from adapter.redact import REDACTED, SECRET_FIELDS, redact_secrets
from dsv41 import rankadapters
from dsv41.adapterlog import AdapterLog

NAME = "api_key"
# The variables build() reads: dsv41ctl config check reports any other adapter key as no effect.
ENV_KEYS = rankadapters.BY_NAME[NAME].keys  # every variable build() reads, declared in dsv41
ARGS_MODULE = "sglang.srt.server_args"
LOGGING_MODULE = "sglang.srt.entrypoints.engine"
DUMP_MODULE = "sglang.srt.managers.tokenizer_manager"
REDACT_MODULE = "sglang.srt.sampling.watermarking.core"


def redacted(values: Any, source: str = f"{LOGGING_MODULE}._server_args_for_logging",
             what: str = "SGLang's server_args log line") -> dict[str, Any]:
    """A copy of SGLang's server-args dict with the keys replaced; anything but a dict is refused
    (a changed SGLang must not get its log line or dump through unredacted)."""
    if not isinstance(values, Mapping):
        raise Refused(f"{NAME}: {source} returned {type(values).__name__}, not a dict: cannot redact the "
                      f"API key from {what}")
    out = dict(values)
    for name in SECRET_FIELDS:
        if out.get(name) is not None:
            out[name] = REDACTED
    return out


class ApiKey:
    def __init__(self, path: str, log: AdapterLog) -> None:
        self.path = path
        self._log = log

    def around_prepare(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        server_args = original(*args, **kwargs)  # parse first: --help and bad flags behave as before
        if getattr(server_args, "api_key", None) is not None:
            raise Refused(f"{NAME}: --api-key is given (on the command line or in --config) while {VARIABLE} "
                          "names the key file; a key in argv is visible to every local user in ps and "
                          "/proc/PID/cmdline: remove --api-key")
        if getattr(server_args, "admin_api_key", None) is not None:
            raise Refused(f"{NAME}: --admin-api-key is given (on the command line or in --config); a key in "
                          "argv is visible to every local user in ps and /proc/PID/cmdline, and dsv41 runs "
                          "without an admin key: remove --admin-api-key")
        try:
            key = read_key_file(self.path)
        except KeyFileError as e:
            raise Refused(f"{NAME}: {e}") from None
        try:
            server_args.api_key = key  # before resolve_once(): afterwards the record is read-only
        except Exception as e:  # noqa: BLE001 - any failure here means serving without the key
            raise Refused(f"{NAME}: cannot set server_args.api_key: {type(e).__name__}: {e}") from None
        self._log.line(f"{NAME}: the HTTP API requires the key read from {VARIABLE}={self.path}")
        return server_args

    def after_logging(self, result: Any, *_args: Any, **_kwargs: Any) -> dict[str, Any]:
        return redacted(result)

    def after_dump_args(self, result: Any, *_args: Any, **_kwargs: Any) -> dict[str, Any]:
        # Without watermarking SGLang pickles the ServerArgs object itself; its dict form is what
        # SGLang dumps with watermarking on, so readers of a dump handle it already.
        values = result.resolved_dict() if hasattr(result, "resolved_dict") else result
        return redacted(values, f"{DUMP_MODULE}.TokenizerManager._server_args_for_dump", "a crash dump")

    def after_redact(self, result: Any, *_args: Any, **_kwargs: Any) -> Any:
        # Whatever SGLang is about to show (server info, its schedulers' states), without the keys.
        return redact_secrets(result)

    def after_dump_config(self, result: Any, *_args: Any, **_kwargs: Any) -> dict[str, Any] | None:
        if result is None:  # SGLang could not serialize the config and dumps none
            return None
        return redacted(result, f"{DUMP_MODULE}.TokenizerManager._dump_config_snapshot", "a crash dump")


def build(env: Mapping[str, str], log: AdapterLog) -> AdapterSpec | None:
    """On whenever DSV41_API_KEY_FILE is present, even empty: the file is checked when SGLang parses
    its argv (in the launching process only), where a refusal stops the rank."""
    if VARIABLE not in env:
        return None
    adapter = ApiKey(env[VARIABLE], log)
    return AdapterSpec(
        name=NAME,
        state=adapter,
        detail=f"key from {VARIABLE}={adapter.path}, redacted from the server_args log line, crash dumps and "
               "/server_info",
        fail_closed=True,
        patches=(
            Patch(ARGS_MODULE, "prepare_server_args", AROUND, adapter.around_prepare, params=("argv",)),
            Patch(LOGGING_MODULE, "_server_args_for_logging", AFTER, adapter.after_logging,
                  params=("server_args",)),
            Patch(DUMP_MODULE, "TokenizerManager._server_args_for_dump", AFTER, adapter.after_dump_args,
                  params=("self",)),
            Patch(DUMP_MODULE, "TokenizerManager._dump_config_snapshot", AFTER, adapter.after_dump_config,
                  params=("self",)),
            Patch(REDACT_MODULE, "redact_watermark_secrets", AFTER, adapter.after_redact, params=("value",)),
        ),
    )
