"""Loads and validates cluster.env into a typed ClusterConfig.

Every problem in a file is reported at once, each naming file, line and key and saying what is
allowed: `cluster.env:57: TP_SIZE=4: must be a multiple of NNODES=3`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping, TypeVar

from dsv41 import envfile

from . import adapterkeys, schema
from . import groups as groups_mod
from . import values as v
from .sglang_cli import canonicalize

T = TypeVar("T")
_WORKER_KEY = re.compile(r"(WORKER(\d+)_(IP|HOST)|NFS_SERVER_IP_(\d+))")


@dataclass(frozen=True)
class ConfigError:
    file: str
    line: int | None
    key: str | None
    value: str | None
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        if self.key is None:
            return f"{where}: {self.message}"
        if self.value is None:
            return f"{where}: {self.key}: {self.message}"
        return f"{where}: {self.key}={self.value}: {self.message}"


class ConfigInvalid(Exception):
    def __init__(self, errors: list[ConfigError]):
        super().__init__("\n".join(str(e) for e in errors))
        self.errors = errors


@dataclass(frozen=True)
class Node:
    name: str
    rank: int
    address: str
    nfs_server: str | None  # the head's address this worker mounts from; None for the head
    # The cluster's head (HEAD_HOST): it exports the weights and runs the coordinator and the gateway.
    # With several GROUPS each group's head is rank 0 of its group; only one is the cluster's head.
    share_head: bool = False

    @property
    def is_head(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class ClusterConfig:
    path: str
    settings: Mapping[str, object]  # typed values of schema keys, defaults applied
    raw: Mapping[str, str]  # the text of every schema key as written (or its default)
    nodes: tuple[Node, ...]
    passthrough: Mapping[str, str]  # prefixed keys the schema does not know, passed to the rank
    unused: tuple[tuple[str, str], ...]  # (key, why it is no longer needed)
    warnings: tuple[str, ...] = field(default=())
    # Rank-side keys set in the file that no adapter reads (adapterkeys): valid, but doing nothing.
    no_effect: tuple[ConfigError, ...] = field(default=())

    # Typed reads: each checks the key's kind as the schema declares it (values.Kind), so a key read
    # as another type, or a name the schema does not know, fails at its first read.
    def integer(self, key: str) -> int:
        return self._required(key, v.Kind.INTEGER, int)

    def number(self, key: str) -> float:
        return self._required(key, v.Kind.NUMBER, float)

    def flag(self, key: str) -> bool:
        return self._required(key, v.Kind.FLAG, bool)

    def text(self, key: str) -> str:
        return self._required(key, v.Kind.TEXT, str)

    def words(self, key: str) -> tuple[str, ...]:
        return self._required(key, v.Kind.WORDS, tuple)

    def optional_integer(self, key: str) -> int | None:
        return self._optional(key, v.Kind.INTEGER, int)

    def optional_number(self, key: str) -> float | None:
        return self._optional(key, v.Kind.NUMBER, float)

    def optional_text(self, key: str) -> str | None:
        return self._optional(key, v.Kind.TEXT, str)

    def optional_words(self, key: str) -> tuple[str, ...] | None:
        return self._optional(key, v.Kind.WORDS, tuple)

    def listen(self, key: str) -> v.Listen:
        return self._required(key, v.Kind.LISTEN, v.Listen)

    def optional_listen(self, key: str) -> v.Listen | None:
        return self._optional(key, v.Kind.LISTEN, v.Listen)

    def _required(self, key: str, kind: v.Kind, of: type[T]) -> T:
        value = self._declared(key, kind, optional=False)
        if not isinstance(value, of):
            raise TypeError(f"{key} holds {value!r}, not the {kind.value} its schema declares")
        return value

    def _optional(self, key: str, kind: v.Kind, of: type[T]) -> T | None:
        value = self._declared(key, kind, optional=True)
        if value is not None and not isinstance(value, of):
            raise TypeError(f"{key} holds {value!r}, not the {kind.value} its schema declares")
        return value

    def _declared(self, key: str, kind: v.Kind, *, optional: bool) -> object:
        declared = schema.BY_NAME.get(key)
        if declared is None:
            raise KeyError(f"{key} is not a cluster.env key (coordinator/schema.py lists them)")
        parser = declared.parse
        if parser.kind is not kind or parser.optional != optional:
            raise TypeError(f"{key} is {_kind_of(parser.kind, parser.optional)}; it was read as "
                            f"{_kind_of(kind, optional)}")
        return self.settings[key]

    @property
    def head(self) -> Node:
        return self.nodes[0]

    def node(self, name: str) -> Node:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(f"no node {name!r} in {self.path}; nodes: {', '.join(n.name for n in self.nodes)}")


def _kind_of(kind: v.Kind, optional: bool) -> str:
    words = f"optional {kind.value}" if optional else kind.value
    return ("an " if words[0] in "aeiou" else "a ") + words


# Under systemd the coordinator runs as root: $HOME is not the home of the user whose paths the
# recipe's file names, so a file that relies on the environment's HOME must define it itself.
HOME_FIX = ("define HOME=/home/USER as the first line of the file (dsv41-coordinator runs as root under systemd, "
            "where HOME is not that user's)")


def load(path: str | os.PathLike, environ: Mapping[str, str] | None = None,
         file_problem: Callable[[str], str | None] | None = None) -> ClusterConfig:
    """Reads and validates a file; raises ConfigInvalid listing every error. `file_problem(path)`
    says what is wrong with INCIDENT_HOOK's file (default: coordinator.hook.file_problem)."""
    return read(path, environ, file_problem)[1]


def read(path: str | os.PathLike, environ: Mapping[str, str] | None = None,
         file_problem: Callable[[str], str | None] | None = None) -> tuple[str, ClusterConfig]:
    """load()'s configuration with the text it was read from (what the coordinator keeps as applied)."""
    path = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigInvalid([ConfigError(path, None, None, None, f"cannot read: {exc}")]) from None
    if file_problem is None:
        from .hook import file_problem
    return text, parse(text, path, os.environ if environ is None else environ, file_problem)


def parse(text: str, path: str, environ: Mapping[str, str],
          file_problem: Callable[[str], str | None] | None = None,
          implemented: frozenset[str] | None = None) -> ClusterConfig:
    """`file_problem`: checks INCIDENT_HOOK's file (None: not checked, for pure parsing).
    `implemented`: the variables the adapters read (default: their declarations)."""
    label = os.path.basename(path)
    entries, syntax = envfile.parse(text, environ)
    errors = [ConfigError(label, e.line, e.key, None, e.message + ("; " + HOME_FIX if "$HOME " in e.message else ""))
              for e in syntax]
    lines = {e.key: e.line for e in entries}
    given = {e.key: e.value for e in entries}

    def err(key: str | None, message: str, value: str | None = None) -> None:
        errors.append(ConfigError(label, lines.get(key) if key else None, key, value, message))

    settings: dict[str, object] = {}
    raw: dict[str, str] = {}
    for key in schema.KEYS:
        text_value = given.get(key.name, key.default)
        if text_value is None:
            err(key.name, "is required: " + key.doc)
            continue
        try:
            settings[key.name] = key.parse(text_value)
            raw[key.name] = text_value
        except v.Invalid as exc:
            err(key.name, str(exc), text_value)

    passthrough: dict[str, str] = {}
    unused: list[tuple[str, str]] = []
    worker_given: dict[str, str] = {}
    for entry in entries:
        if entry.key in schema.BY_NAME:
            continue
        if entry.key in schema.UNUSED:
            unused.append((entry.key, schema.UNUSED[entry.key]))
        elif _WORKER_KEY.fullmatch(entry.key):
            worker_given[entry.key] = entry.value
        elif entry.key.startswith(schema.PASSTHROUGH_PREFIXES):
            try:
                passthrough[entry.key] = v.plain_text(entry.value)
            except v.Invalid as exc:
                err(entry.key, str(exc), entry.value)
        else:
            err(entry.key, "unknown key; known keys are listed by `dsv41ctl config keys`, and keys starting with "
                + ", ".join(schema.PASSTHROUGH_PREFIXES) + " pass through to the rank's environment")

    nodes = _nodes(settings, worker_given, err)
    _cross_checks(settings, raw, nodes, err)
    for key, message in _passthrough_conflicts(settings, passthrough):
        err(key, message, passthrough[key])
    hook = _parsed(settings, "INCIDENT_HOOK", str)
    if file_problem is not None and hook:
        problem = file_problem(hook)
        if problem:
            err("INCIDENT_HOOK", problem, raw["INCIDENT_HOOK"])
    if errors:
        raise ConfigInvalid(sorted(errors, key=lambda e: (e.line is None, e.line or 0)))
    readers = adapterkeys.implemented() if implemented is None else implemented
    idle = [ConfigError(label, lines[k], k, given[k], adapterkeys.NO_EFFECT)
            for k in adapterkeys.without_effect(schema.KEYS, readers) if k in given]
    cfg = ClusterConfig(path, settings, raw, tuple(nodes), passthrough, tuple(unused),
                        no_effect=tuple(sorted(idle, key=lambda e: e.line or 0)))
    return replace(cfg, warnings=(*_home_warnings(entries, environ), *_warnings(cfg)))


def _home_warnings(entries: list[envfile.Entry], environ: Mapping[str, str]) -> list[str]:
    lines = [e.line for e in entries if "HOME" in e.from_environ]
    if not lines:
        return []
    where = ", ".join(str(n) for n in lines[:5]) + (" ..." if len(lines) > 5 else "")
    return [f"$HOME on line(s) {where} comes from the environment of the process reading the file "
            f"(here {environ.get('HOME', '')!r}), not from the file: {HOME_FIX}"]


def _nodes(settings: Mapping[str, object], given: Mapping[str, str], err) -> list[Node]:
    nnodes = settings.get("NNODES")
    if not isinstance(nnodes, int):
        return []
    share = settings.get("NFS_SHARE", True)
    nodes = [Node(_parsed(settings, "HEAD_HOST", str) or "spark1", 0, _parsed(settings, "HEAD_IP", str) or "", None,
                  share_head=True)]
    for k in range(1, nnodes):
        parsed: dict[str, str | None] = {}
        for pattern, (parser, doc) in schema.WORKER_KEYS.items():
            key = pattern.format(k=k)
            if key not in given:
                if key.startswith("NFS_SERVER_IP_") and not share:
                    parsed[key] = None
                    continue
                doc = doc.replace("worker k", f"worker {k}")
                err(None, f"{key}: is required with NNODES={nnodes}: {doc} (one WORKERk_IP/WORKERk_HOST pair "
                          f"and NFS_SERVER_IP_k per worker, k = 1..{nnodes - 1})")
                continue
            try:
                parsed[key] = str(parser(given[key]))
            except v.Invalid as exc:
                err(key, str(exc), given[key])
        ip, host = parsed.get(f"WORKER{k}_IP"), parsed.get(f"WORKER{k}_HOST")
        if ip and host:
            nodes.append(Node(host, k, ip, parsed.get(f"NFS_SERVER_IP_{k}")))
    for key in given:
        match = _WORKER_KEY.fullmatch(key)
        index = int(match.group(2) or match.group(4))
        if not 1 <= index < nnodes:
            err(key, f"names worker {index}, but NNODES={nnodes} has workers 1..{nnodes - 1}")
    return nodes


def _cross_checks(s: Mapping[str, object], raw: Mapping[str, str], nodes: list[Node], err) -> None:
    """Rules between keys; each runs when the keys it needs parsed, so every error shows at once."""
    def have(*keys: str) -> bool:
        return all(k in s for k in keys)

    if have("TP_SIZE", "NNODES", "GROUPS") and not s["GROUPS"] and s["TP_SIZE"] % s["NNODES"]:
        err("TP_SIZE", f"must be a multiple of NNODES={s['NNODES']}", raw["TP_SIZE"])
    if have("GROUPS") and s["GROUPS"]:
        groups_mod.check(s, raw, nodes, err)
    if have("TP_SIZE", "EP_SIZE") and s["TP_SIZE"] % s["EP_SIZE"]:
        err("EP_SIZE", f"must divide TP_SIZE={s['TP_SIZE']}", raw["EP_SIZE"])
    if have("MAX_TOTAL_TOKENS", "CONTEXT_LENGTH") and s["MAX_TOTAL_TOKENS"] < s["CONTEXT_LENGTH"]:
        err("MAX_TOTAL_TOKENS", f"must be at least CONTEXT_LENGTH={s['CONTEXT_LENGTH']}: one request must fit the "
            "KV pool", raw["MAX_TOTAL_TOKENS"])
    if have("DIST_PORT", "PORT") and s["DIST_PORT"] == s["PORT"]:
        err("DIST_PORT", f"must differ from PORT={s['PORT']}", raw["DIST_PORT"])
    if have("AGENT_PORT", "PORT", "DIST_PORT") and s["AGENT_PORT"] in (s["PORT"], s["DIST_PORT"]):
        err("AGENT_PORT", "must differ from PORT and DIST_PORT", raw["AGENT_PORT"])
    if have("DSV41_MAX_NEW_TOKENS", "CONTEXT_LENGTH") and s["DSV41_MAX_NEW_TOKENS"] > s["CONTEXT_LENGTH"]:
        err("DSV41_MAX_NEW_TOKENS", f"must not exceed CONTEXT_LENGTH={s['CONTEXT_LENGTH']}",
            raw["DSV41_MAX_NEW_TOKENS"])
    names = [n.name for n in nodes]
    for name in sorted({n for n in names if names.count(n) > 1}):
        err(None, f"node name {name} is used twice (HEAD_HOST and WORKERk_HOST must be distinct)")
    addresses = [n.address for n in nodes]
    for address in sorted({a for a in addresses if addresses.count(a) > 1}):
        err(None, f"address {address} is used by two nodes (HEAD_IP and WORKERk_IP must be distinct)")
    if have("NFS_SHARE", "NFS_CLIENTS") and s["NFS_SHARE"] and not s["NFS_CLIENTS"]:
        err("NFS_CLIENTS", "is required with NFS_SHARE=1: the workers' addresses or networks allowed to mount")
    if have("NFS_SHARE", "MODEL_DIR") and s["NFS_SHARE"] and s["MODEL_DIR"] == "/":
        err("MODEL_DIR", "must not be / when it is exported", raw["MODEL_DIR"])
    if have("RANK_ENGINE", "RANK_RUNTIME") and s["RANK_ENGINE"] == "sim" and s["RANK_RUNTIME"] != "host":
        err("RANK_ENGINE", "sim runs only with RANK_RUNTIME=host (the stand-in is not in the image)", "sim")
    if have("RANK_DEVICE") and s["RANK_DEVICE"] == "cpu":
        _check_cpu_rehearsal(s, raw, err)
    if have("METRICS_LISTEN") and s["METRICS_LISTEN"]:
        taken = {k: s[k] for k in ("PORT", "DIST_PORT", "AGENT_PORT") if k in s}
        clash = [k for k, port in taken.items() if port == s["METRICS_LISTEN"].port]
        if clash:
            err("METRICS_LISTEN", f"port {s['METRICS_LISTEN'].port} is already {' and '.join(clash)} on the head; "
                "choose another (default 9441)", raw["METRICS_LISTEN"])
    if have("MEMORY_FLOOR_GB") and 0 < s["MEMORY_FLOOR_GB"] * 1e9 < 64 << 20:
        err("MEMORY_FLOOR_GB", "must be 0 (off) or at least 0.068 (64 MiB, what the agents accept)",
            raw["MEMORY_FLOOR_GB"])
    if have("MEMORY_FLOOR_GB", "MEMORY_GUARD_GB", "MEMORY_GUARD") and s["MEMORY_FLOOR_GB"] and \
            s["MEMORY_GUARD"] != "off" and s["MEMORY_FLOOR_GB"] >= s["MEMORY_GUARD_GB"]:
        err("MEMORY_FLOOR_GB", f"must be below MEMORY_GUARD_GB={s['MEMORY_GUARD_GB']:g}: the node's last line acts "
            "only where the coordinator's guard did not (0 turns the floor off)", raw["MEMORY_FLOOR_GB"])
    if have("EXTRA_SGLANG_ARGS"):
        # SGLang expands abbreviations (--node-ra is --node-rank): check, and render, what it will read.
        written = tuple(s["EXTRA_SGLANG_ARGS"])
        words, problems = canonicalize(written)
        for problem in problems:
            err("EXTRA_SGLANG_ARGS", problem)  # no value: it could hold a key
        s["EXTRA_SGLANG_ARGS"] = tuple(words)  # type: ignore[index]
        _check_extra_args(s["EXTRA_SGLANG_ARGS"], raw["EXTRA_SGLANG_ARGS"], s, err, written)


# What RANK_DEVICE=cpu needs: SGLang's CPU engine runs neither DeepSeek-V4's kernels (so no DSpark
# draft and no Engram offload) nor in the GPU image.
_CPU_REHEARSAL_NEEDS = {"SPEC_ALGO": "NONE", "OFFLOAD_MODE": "host", "RANK_RUNTIME": "host"}


def _check_cpu_rehearsal(s: Mapping[str, object], raw: Mapping[str, str], err) -> None:
    for key, needed in _CPU_REHEARSAL_NEEDS.items():
        if key in s and s[key] != needed:
            err(key, f"must be {needed} with RANK_DEVICE=cpu (SGLang's CPU engine runs no DeepSeek-V4 kernels and "
                "no GPU image)", raw.get(key))


# Flags the plan renders from keys: setting them again in EXTRA_SGLANG_ARGS would make ranks disagree
# with the config or override what the coordinator checks.
_OWNED_FLAGS = {
    "--model-path": "COMMON_MODEL", "--served-model-name": "SERVED_MODEL_NAME", "--tp-size": "TP_SIZE",
    "--tp": "TP_SIZE", "--ep-size": "EP_SIZE", "--ep": "EP_SIZE", "--nnodes": "NNODES",
    "--node-rank": "the node's rank", "--dist-init-addr": "HEAD_IP and DIST_PORT", "--host": "the plan (0.0.0.0)",
    "--port": "PORT", "--mem-fraction-static": "MEM_FRACTION_STATIC", "--context-length": "CONTEXT_LENGTH",
    "--chunked-prefill-size": "CHUNKED_PREFILL_SIZE", "--max-running-requests": "MAX_RUNNING_REQUESTS",
    "--max-total-tokens": "MAX_TOTAL_TOKENS", "--speculative-algorithm": "SPEC_ALGO",
    "--speculative-dspark-block-size": "DSPARK_BLOCK_SIZE",
    "--speculative-dspark-sps-table-path": "DSPARK_SPS_TABLE",
    "--speculative-dspark-confidence-sts-path": "DSPARK_STS_TABLE",
}
# Flags that put a secret in argv, where every local user reads it in ps and /proc/PID/cmdline.
_SECRET_FLAGS = {
    "--api-key": "set API_KEY_FILE instead (the key then reaches rank 0 as a 0600 file)",
    "--admin-api-key": "dsv41 runs SGLang without an admin key",
}
# Flags that make SGLang read more flags from elsewhere, past every check here.
_INDIRECT_FLAGS = {
    "--config": "it reads more flags from a file, which no check here sees; put the flags in EXTRA_SGLANG_ARGS",
}


def _check_extra_args(words: tuple[str, ...], raw: str, s: Mapping[str, object], err,
                      written: tuple[str, ...] | None = None) -> None:
    """`words` as SGLang reads them (canonical flags); `written` as the file spells them."""
    written = written or words
    if any(w.partition("=")[0] in _SECRET_FLAGS for w in words):
        raw = None  # no error may quote the value: it holds a key
    for i, word in enumerate(words):
        flag, _, inline = word.partition("=")
        given = written[i].partition("=")[0] if i < len(written) else flag
        named = flag if given == flag else f"{given} (SGLang reads it as {flag})"
        if flag in _OWNED_FLAGS:
            err("EXTRA_SGLANG_ARGS", f"{named} is set from {_OWNED_FLAGS[flag]}; remove it here", raw)
        if flag in _INDIRECT_FLAGS:
            err("EXTRA_SGLANG_ARGS", f"{named} is refused: {_INDIRECT_FLAGS[flag]}", raw)
        if flag in _SECRET_FLAGS:
            # No value in this error: it would copy the key into the journal.
            err("EXTRA_SGLANG_ARGS", f"{named} would put a key in argv, visible to every local user in ps; "
                f"remove it: {_SECRET_FLAGS[flag]}")
        if flag == "--speculative-num-draft-tokens" and s.get("SPEC_ALGO") == "DSPARK":
            given = inline or (words[i + 1] if i + 1 < len(words) else "")
            want = (_parsed(s, "DSPARK_BLOCK_SIZE", int) or 0) + 1
            if given != str(want):
                err("EXTRA_SGLANG_ARGS", f"--speculative-num-draft-tokens must be DSPARK_BLOCK_SIZE + 1 = {want} "
                    "(DSpark verifies the block plus one token); better leave it out", raw)
    if words and not words[0].startswith("--"):
        err("EXTRA_SGLANG_ARGS", f"must start with a --flag, not {words[0]!r}", raw)


def _passthrough_conflicts(s: Mapping[str, object], passthrough: Mapping[str, str]) -> list[tuple[str, str]]:
    """Passed-through variables the ranks cannot run with (every rank would refuse), or that the
    coordinator derives itself."""
    out = []
    for key in sorted(k for k in passthrough if k.startswith("DSV41_ADMISSION_")):
        out.append((key, "the coordinator sets the admission gate's variables from MEMORY_GUARD_ADMISSION, "
                         "MEMORY_GUARD_GB and the guard's cost model (MEMORY_GUARD_TOKEN_BYTES, "
                         "MEMORY_GUARD_TRANSIENT_BYTES); remove this line and set those"))
    mode = passthrough.get("SGLANG_RAGGED_VERIFY_MODE", "static").strip()
    if s.get("DSV41_VERIFY_CAP") and mode not in ("", "static"):
        out.append(("SGLANG_RAGGED_VERIFY_MODE", f"SGLang then schedules verify lengths itself, and the verify cap "
                    f"(DSV41_VERIFY_CAP) caps its static verify: every rank would refuse to start; remove "
                    f"SGLANG_RAGGED_VERIFY_MODE or set DSV41_VERIFY_CAP=0"))
    return out


def _parsed(s: Mapping[str, object], key: str, of: type[T]) -> T | None:
    """A key's value while the file is checked: None where it did not parse (its error is listed)."""
    value = s.get(key)
    return value if isinstance(value, of) else None


def _warnings(cfg: ClusterConfig) -> list[str]:
    out = []
    image = cfg.optional_text("IMAGE")
    if cfg.text("RANK_RUNTIME") == "container" and image and not v.is_pinned_image(image):
        out.append(f"IMAGE={image} is a tag: agents run images by digest only (a tag can be moved to other "
                   "content); set IMAGE to the build's ID, `docker image inspect --format '{{.Id}}' "
                   f"{image}`, and list that ID in every node's ALLOWED_IMAGES")
    if cfg.number("DSV41_VERIFY_CAP") and not cfg.flag("DSV41_BLOCK_VERIFY"):
        out.append("DSV41_VERIFY_CAP is set but DSV41_BLOCK_VERIFY=0: sampled rows are then verified token by token "
                   "(the recipe measured the cap with block verification)")
    if cfg.text("SPEC_ALGO") != "DSPARK" and (cfg.optional_text("DSPARK_SPS_TABLE")
                                              or cfg.optional_text("DSPARK_STS_TABLE")):
        out.append("DSPARK_*_TABLE is set but SPEC_ALGO is not DSPARK: the tables are not used")
    return out
