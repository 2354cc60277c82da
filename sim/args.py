"""Parses the rank argv (what would follow `python -m sglang.launch_server`) into SimArgs.

Errors exit with status 2 and a usage line, like argparse in SGLang. Beyond SGLang's own parse
(types and choices), it applies coordinator.argcheck's cross-field rules (which SGLang 0.5.23 does
not check and which end in a rendezvous that never completes) and rejects values SGLang would
only fail on later at start-up (a port out of range, a fraction outside (0, 1]).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from adapter.keyfile import VARIABLE, read_key_file
from coordinator.argcheck import check_sglang_args
from coordinator.sglang_cli import canonicalize

from .flags import DEFAULTS, FLAGS, SPECULATIVE_ALGORITHMS

PROG = "dsv41-sim-rank"
DESCRIPTION = f"""\
{PROG}: a STAND-IN for one SGLang rank, for tests and the local demo of dsv41.
It loads no model and uses no GPU. It accepts the argv of `python -m sglang.launch_server`
(the SGLang 0.5.23 flags listed below, abbreviated as far as SGLang's own parser allows:
--node-ra 2 is --node-rank 2) and rejects what SGLang would reject.

Ranks form a group like a TP group: rank 0 listens on --dist-init-addr, ranks 1..nnodes-1 connect
to it; if any rank is lost the others exit with status 1. Rank 0 serves, on --host/--port, /health,
/v1/models, /v1/chat/completions (streaming too), /v1/loads, /abort_request, /server_info,
/model_info, /metrics (with --enable-metrics) and /dsv41/inflight. It answers 19+23 with 42 and
other prompts with a short fixed-form text.

Prompt tokens are ceil(UTF-8 bytes / 4) of the messages' text. One request at a time is
chunk-prefilled in chunks of --chunked-prefill-size, as SGLang schedules. Memory is real (mmap,
every page touched). Each chunk's tokens take KV slots in a pool of --max-total-tokens slots,
held until the request ends; the pool's memory is taken the first time a slot is used and never
given back, and a request waits while its prompt does not fit in the free slots (a prompt the
pool can never hold is refused). For the chunk's duration the indexer's [chunk, prefix] buffer
goes through a model of PyTorch's caching allocator, which keeps what is freed and gives it back
to the OS only after a chunk of a prompt of at least DSV41_PREFILL_EMPTY_CACHE_TOKENS (the
prefill_empty_cache hook). Environment (defaults in brackets):
  DSV41_SIM_PREFILL_TOKENS_PER_S  prefill rate [20000]
  DSV41_SIM_BYTES_PER_TOKEN       KV memory per prefilled token [16384]
  DSV41_SIM_TRANSIENT_BYTES       indexer buffer bytes per (chunk token, prefix token) [4]
  DSV41_SIM_KV_POOL               1: the KV in a pool as SGLang keeps it (above); 0: in the
                                  caching allocator with the indexer's buffers, where it serves
                                  any buffer once freed and the hook gives it back (kinder than
                                  SGLang) [1]
  DSV41_PREFILL_EMPTY_CACHE_TOKENS  the hook's threshold; 0: the cache is never emptied [8192]
  DSV41_SIM_DECODE_TOKENS_PER_S   output rate per request [200]
  DSV41_SIM_LOAD_S                "model load" after the group forms; /health is 503 meanwhile [0]
  DSV41_SIM_LOAD_BYTES            memory every rank takes evenly over the load (the weights) and
                                  keeps [0]
  DSV41_SIM_DRAIN_TIMEOUT_S       rank 0 SIGTERM drain budget; then in-flight requests abort [60]
  DSV41_SIM_RENDEZVOUS_TIMEOUT_S  how long ranks wait for the group to form [--dist-timeout or 600]
  DSV41_SIM_PEER_TIMEOUT_S        a silent peer counts as lost after this, for tests that want
                                  a quick exit; unset, a silent peer is waited for as NCCL does,
                                  until --watchdog-timeout ends a step that hangs (a closed
                                  connection counts at once) [unset]
  DSV41_PROGRESS_DIR              where the forward-step counter is shared with the agent
                                  [/dev/shm]
  DSV41_API_KEY_FILE              a file (mode 0600, one line) holding the API key that every
                                  route but /health, /ready and /metrics then requires, like
                                  --api-key without the key in argv; a bad file stops the rank
"""

# Flags that may differ between ranks of one group: the plan gives the head its own fraction, and
# only rank 0 serves HTTP, so only it has the API key (which must not travel to the workers over
# the group's connection, nor appear in a "ranks disagree" message).
RANK_LOCAL = frozenset({"node_rank", "mem_fraction_static", "api_key"})


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse's own wording and status 2, plus a hint for the stand-in's narrower flag set.
        if message.startswith("unrecognized arguments"):
            message += f" ({PROG} knows a subset of SGLang 0.5.23's flags; see --help for the list)"
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, usage=f"{PROG} [--help] --model-path PATH [SGLANG FLAGS...]",
                     description=DESCRIPTION, allow_abbrev=False,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag in FLAGS:
        if flag.kind is None:
            parser.add_argument(*flag.names, dest=flag.dest, action="store_true")
        else:
            parser.add_argument(*flag.names, dest=flag.dest, type=flag.kind, choices=flag.choices,
                                default=DEFAULTS.get(flag.dest), metavar=flag.dest.upper())
    return parser


@dataclass(frozen=True)
class SimArgs:
    values: dict[str, Any] = field(default_factory=dict)  # every flag by its dest name
    # The key came from DSV41_API_KEY_FILE, as the adapter inside SGLang loads it: then (and only
    # then) the adapter's redaction applies where SGLang would show the key.
    key_from_file: bool = False

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def rank(self) -> int:
        return int(self.values["node_rank"])

    @property
    def dist_host(self) -> str:
        return dist_addr(self.values["dist_init_addr"])[0]

    @property
    def dist_port(self) -> int:
        return dist_addr(self.values["dist_init_addr"])[1]

    @property
    def model_name(self) -> str:
        return self.values["served_model_name"] or self.values["model_path"] or "default"

    def group_settings(self) -> dict[str, Any]:
        """What every rank of a group must agree on."""
        return {k: v for k, v in sorted(self.values.items()) if k not in RANK_LOCAL}


def dist_addr(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"--dist-init-addr {value!r} must be HOST:PORT with a port in 1..65535")
    return host.strip("[]"), int(port)


def semantic_errors(values: dict[str, Any]) -> list[str]:
    """Values SGLang accepts at parse time but cannot start with."""
    errors = []
    if not values["model_path"]:
        errors.append("--model-path is required")
    if not 1 <= values["port"] <= 65535:
        errors.append(f"--port {values['port']} must be in 1..65535")
    fraction = values["mem_fraction_static"]
    if fraction is not None and not 0 < fraction <= 1:
        errors.append(f"--mem-fraction-static {fraction:g} must be in (0, 1]")
    chunk = values["chunked_prefill_size"]
    if chunk is not None and chunk != -1 and chunk < 1:
        errors.append(f"--chunked-prefill-size {chunk} must be positive, or -1 to disable chunking")
    for name in ("context_length", "max_total_tokens", "max_running_requests", "max_prefill_tokens"):
        if values[name] is not None and values[name] < 1:
            errors.append(f"--{name.replace('_', '-')} {values[name]} must be at least 1")
    algo = values["speculative_algorithm"]
    if algo is not None and algo.upper() not in SPECULATIVE_ALGORITHMS:
        errors.append(f"--speculative-algorithm {algo!r}: DeepSeek-V4 supports only "
                      f"{' or '.join(SPECULATIVE_ALGORITHMS)}")
    if values["dist_init_addr"] is not None:
        try:
            dist_addr(values["dist_init_addr"])
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def canonical_argv(argv: Sequence[str]) -> list[str]:
    """argv with SGLang's alias names (--model, --nccl-init-addr, ...) replaced by the canonical ones,
    so that argcheck, which reads canonical names, sees every value."""
    aliases = {alias: flag.names[0] for flag in FLAGS for alias in flag.names[1:]}
    out = []
    for arg in argv:
        name, sep, value = arg.partition("=")
        out.append(aliases[name] + sep + value if name in aliases else arg)
    return out


def with_key_file(args: SimArgs, env: Mapping[str, str]) -> SimArgs:
    """args with the API key read from the file named by DSV41_API_KEY_FILE, when it is set; the
    same rules as the adapter inside SGLang (adapter/api_key.py). ValueError says why not."""
    if VARIABLE not in env:
        return args
    if args.api_key is not None:
        raise ValueError(f"--api-key is given while {VARIABLE} names the key file; a key in argv is visible "
                         "to every local user in ps and /proc/PID/cmdline: remove --api-key")
    return SimArgs({**args.values, "api_key": read_key_file(env[VARIABLE])},  # KeyFileError is a ValueError
                   key_from_file=True)


def parse(argv: Sequence[str]) -> SimArgs:
    """SimArgs for argv (without the program name); exits with status 2 on an argv SGLang rejects.
    Flags are read as SGLang's parser reads them: abbreviations expand (`--node-ra 2`), an
    ambiguous one is an error."""
    parser = build_parser()
    words, problems = canonicalize(list(argv))
    if problems:
        parser.error("; ".join(problems))
    values = vars(parser.parse_args(words))
    errors = check_sglang_args(canonical_argv(words)) + semantic_errors(values)
    if errors:
        parser.error("; ".join(dict.fromkeys(errors)))
    return SimArgs(values)
