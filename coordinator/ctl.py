"""dsv41ctl: the operator's command line (`python3 -m coordinator.ctl` from a source checkout)."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence, TextIO

from .sockets import CONTROL_SOCKET

DEFAULT_CONFIG = "/etc/dsv41/cluster.env"
# The module that declares and runs each command (None: this one), in the order `dsv41ctl --help` lists
# them. A command imports only its own module: start-up is most of `dsv41ctl status`'s latency, and
# status needs neither the configuration's modules nor the certificate code.
COMMAND_MODULES = {
    "config": None, "status": "ctl_cluster", "start": "ctl_cluster", "stop": "ctl_cluster",
    "restart": "ctl_cluster", "events": "ctl_cluster", "pack": "ctl_cluster", "autotune": "ctl_cluster",
    "fabric": "ctl_cluster", "share": "ctl_cluster", "logs": "ctl_cluster", "pki": "ctl_pki", "bundle": "ctl_bundle",
}


def main(argv: Sequence[str] | None = None, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse_one_command(argv)
    if args is None:  # no command, or a usage error: the whole parser answers as it always did
        args = _parser().parse_args(argv)
    if not getattr(args, "handler", None):
        _parser().print_help(err)
        return 2
    try:
        return args.handler(args, out, err)
    except BrokenPipeError:
        return 0


class _Unparsed(Exception):
    """The parser of one command met something it does not answer for itself (a usage error)."""


class _OneCommandParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise _Unparsed(message)


def _parse_one_command(argv: list[str]) -> argparse.Namespace | None:
    """The namespace from a parser that declares only argv's command (the same namespace the whole
    parser gives); None when argv does not start with a command or does not parse, so that the whole
    parser prints the help or the error with every command in it."""
    if not argv or argv[0] not in COMMAND_MODULES:
        return None
    try:
        return _parser(argv[0]).parse_args(argv)
    except _Unparsed:
        return None


class _Discarded:
    """What declaring a command other than the one parsed gives: a parser that keeps nothing."""

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: self


class _OnlyCommand:
    """The subparsers a module declares its commands into when one command is parsed."""

    def __init__(self, sub, command: str):
        self._sub, self._command = sub, command

    def add_parser(self, name: str, **kwargs):
        return self._sub.add_parser(name, **kwargs) if name == self._command else _Discarded()


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with a command, one that declares only that command (and imports only its
    module), whose usage errors raise _Unparsed instead of printing a usage that lists it alone."""
    parser_class = argparse.ArgumentParser if command is None else _OneCommandParser
    parser = parser_class(prog="dsv41ctl", description="Control the dsv41 cluster.")
    sub = parser.add_subparsers(dest="command")
    declare = sub if command is None else _OnlyCommand(sub, command)
    modules = dict.fromkeys(COMMAND_MODULES.values() if command is None else [COMMAND_MODULES[command]])
    if None in modules:
        _add_config_commands(declare)
    for name in filter(None, modules):
        importlib.import_module(f".{name}", __package__).add_commands(declare, DEFAULT_CONFIG)
    return parser


def _add_config_commands(sub) -> None:
    cfg = sub.add_parser("config", help="check and show the cluster configuration")
    cfg_sub = cfg.add_subparsers(dest="config_command")
    check = cfg_sub.add_parser("check", help="validate a cluster.env; exit 1 with every error")
    check.add_argument("file", nargs="?", default=DEFAULT_CONFIG)
    check.set_defaults(handler=_config_check)
    show = cfg_sub.add_parser("show", help="print what one node must run")
    show.add_argument("file", nargs="?", default=DEFAULT_CONFIG)
    show.add_argument("--node", required=True, help="node name (HEAD_HOST or WORKERk_HOST)")
    show.add_argument("--json", action="store_true", help="one JSON object")
    show.add_argument("--with-dspark-tables", action="store_true",
                      help="render as if every rank holds identical DSpark tables (the coordinator decides this)")
    show.set_defaults(handler=_config_show)
    keys = cfg_sub.add_parser("keys", help="list every key cluster.env may hold")
    keys.set_defaults(handler=_config_keys)
    for name, help_text in (
            ("diff", "compare cluster.env with the configuration the coordinator runs: each changed key and "
                     "whether applying it restarts the ranks"),
            ("apply", "validate cluster.env and apply it without an outage (what `systemctl reload "
                      "dsv41-coordinator` runs); an invalid file changes nothing"),
            ("rollback", "bring back the configuration that ran before the current one")):
        remote = cfg_sub.add_parser(name, help=help_text)
        remote.add_argument("--socket", default=CONTROL_SOCKET, help="the coordinator's control socket")
        remote.set_defaults(handler=_config_remote, config_action=name)


def _config_remote(args, out: TextIO, err: TextIO) -> int:
    from .ctl_cluster import config_call
    return config_call(args, out, err)


def _load(path: str, err: TextIO):
    from . import config as config_mod
    try:
        return config_mod.load(path)
    except config_mod.ConfigInvalid as exc:
        for error in exc.errors:
            print(error, file=err)
        print(f"{path}: {len(exc.errors)} error(s); nothing was changed", file=err)
        return None


def _config_check(args, out: TextIO, err: TextIO) -> int:
    cfg = _load(args.file, err)
    if cfg is None:
        return 1
    nodes = ", ".join(f"{n.name} (rank {n.rank}, {n.address})" for n in cfg.nodes)
    print(f"{args.file}: valid: {len(cfg.nodes)} nodes: {nodes}", file=out)
    for key, reason in cfg.unused:
        print(f"  unused: {key}: {reason}", file=out)
    for key in sorted(cfg.passthrough):
        print(f"  passed to the rank as is: {key}", file=out)
    for warning in cfg.warnings:
        print(f"  warning: {warning}", file=out)
    for idle in cfg.no_effect:
        print(f"  no effect: {idle}", file=out)
    return 0


def _config_show(args, out: TextIO, err: TextIO) -> int:
    cfg = _load(args.file, err)
    if cfg is None:
        return 1
    from . import plan as plan_mod
    try:
        node_plan = plan_mod.render_node(cfg, args.node, dspark_tables=args.with_dspark_tables)
    except KeyError as exc:
        print(exc.args[0], file=err)
        return 1
    body = node_plan.to_json()
    if args.json:
        import json
        json.dump(body, out, indent=2, sort_keys=False)
        out.write("\n")
        return 0
    _print_plan(body, out)
    return 0


def _print_plan(body: dict, out: TextIO) -> None:
    import json
    import shlex
    import textwrap
    print(f"node {body['node']}  rank {body['rank']}  address {body['address']}  "
          f"runtime {body['runtime']}  fingerprint {body['fingerprint']}", file=out)
    print("argv:", file=out)
    for line in textwrap.wrap(shlex.join(body["argv"]), width=76, break_long_words=False,
                              break_on_hyphens=False):
        print(f"  {line}", file=out)
    print("env:", file=out)
    for key, value in body["env"].items():
        print(f"  {key}={value}", file=out)
    for key, fact in body["agent_fills"].items():
        print(f"  ({key} is filled in on the node from its {fact})", file=out)
    for section in ("export", "mount", "fabric", "pack"):
        if body[section]:
            print(f"{section}: {json.dumps(body[section], sort_keys=True)}", file=out)


def _config_keys(args, out: TextIO, err: TextIO) -> int:
    from . import adapterkeys, schema
    idle = set(adapterkeys.without_effect(schema.KEYS, adapterkeys.implemented()))
    for key in schema.KEYS:
        default = "(required)" if key.default is None else f"default {key.default!r}"
        print(f"{key.name}  {default}\n    {key.doc}", file=out)
        if key.name in idle:
            print(f"    {adapterkeys.NO_EFFECT}", file=out)
    for pattern, (_, doc) in schema.WORKER_KEYS.items():
        print(f"{pattern.format(k='k')}  (one per worker, k = 1..NNODES-1)\n    {doc}", file=out)
    for key, reason in schema.UNUSED.items():
        print(f"{key}  (accepted, unused)\n    {reason}", file=out)
    print("Keys starting with " + ", ".join(schema.PASSTHROUGH_PREFIXES) + " pass through to the rank.", file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
