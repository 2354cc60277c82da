"""dsv41ctl pki: the cluster CA and the certificates of the agents and the coordinator.

    dsv41ctl pki init   [--dir /etc/dsv41/pki] [--config cluster.env] [--days N] [--force]
    dsv41ctl pki rotate [--node NAME] [--days N]      new keys and certificates under the same CA
    dsv41ctl pki bundle NODE > NODE.tar               what NODE's agent needs; on NODE, as root:
                                                      tar -xpf NODE.tar -C /   (then /etc/dsv41/tls/agent.env
                                                      holds the lines for /etc/dsv41/agent.env)
    dsv41ctl pki list                                 every certificate, its names and expiry

This module is imported for every dsv41ctl command: it imports the certificate code only when a pki
command runs.
"""

from __future__ import annotations

import argparse
import os
import stat
import time
from typing import TextIO

DEFAULT_DIR = "/etc/dsv41/pki"
DEFAULT_DAYS = 180  # pki.DEFAULT_LEAF_DAYS, repeated so that building the parser imports no certificate code
# `dsv41ctl status` warns this long before a certificate expires: time to rotate and copy bundles.
EXPIRY_WARNING_S = 42 * 86400


def expiry_warning(name: str, not_after_unix_s: float, now_unix_s: float,
                   warn_s: float = EXPIRY_WARNING_S) -> str | None:
    """A line for `dsv41ctl status` when a certificate expires within warn_s (or has); None otherwise,
    also when the expiry is unknown (0)."""
    if not not_after_unix_s:
        return None
    left = not_after_unix_s - now_unix_s
    if left > warn_s:
        return None
    when = time.strftime("%Y-%m-%d", time.gmtime(not_after_unix_s))
    fix = f"run `dsv41ctl pki rotate --node {name}` and install the new bundle"
    if left <= 0:
        return f"{name}: certificate EXPIRED on {when}: {fix}"
    return f"{name}: certificate expires in {int(left // 86400)} days ({when}): {fix}"


def add_commands(sub, default_config: str) -> None:
    pki = sub.add_parser("pki", help="cluster CA and certificates (mutual TLS between coordinator and agents)",
                         description=__doc__.split("\n\n")[1],
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    pki_sub = pki.add_subparsers(dest="pki_command")

    def common(p, config: bool = True) -> None:
        p.add_argument("--dir", help=f"the PKI directory (default: PKI_DIR of the config, else {DEFAULT_DIR})")
        p.add_argument("--config", default=default_config, help="cluster.env (node names and addresses)"
                       if config else "cluster.env (only for PKI_DIR)")

    init = pki_sub.add_parser("init", help="create the cluster CA and every certificate")
    common(init)
    init.add_argument("--days", type=int, default=DEFAULT_DAYS,
                      help="validity of the leaf certificates (default %(default)s)")
    init.add_argument("--force", action="store_true",
                      help="replace an existing CA (every installed bundle stops working)")
    init.set_defaults(handler=_init)
    rotate = pki_sub.add_parser("rotate", help="re-issue certificates under the existing CA")
    common(rotate)
    rotate.add_argument("--node", help="only this node (or dsv41-coordinator); default: every certificate")
    rotate.add_argument("--days", type=int, default=DEFAULT_DAYS, help="validity (default %(default)s)")
    rotate.set_defaults(handler=_rotate)
    bundle = pki_sub.add_parser("bundle", help="one node's CA, certificate, key and agent.env lines, as a tar")
    common(bundle, config=False)
    bundle.add_argument("node")
    bundle.add_argument("--output", "-o", help="write to this file (created 0600) instead of standard output")
    bundle.set_defaults(handler=_bundle)
    show = pki_sub.add_parser("list", help="every certificate with its names and expiry")
    common(show, config=False)
    show.set_defaults(handler=_list)


def _pki_dir(args, cfg) -> str:
    if args.dir:
        return args.dir
    return cfg.text("PKI_DIR") if cfg is not None else DEFAULT_DIR


_INVALID = object()  # the config exists but does not load: exit 3, as other commands do


def _config(args, err: TextIO, required: bool):
    """The cluster config; None when it is optional and absent; _INVALID after printing its errors."""
    from . import config as config_mod
    try:
        return config_mod.load(args.config)
    except config_mod.ConfigInvalid as exc:
        if not required and not os.path.exists(args.config):
            return None
        print(f"{args.config} is invalid:\n{exc}", file=err)
        return _INVALID


def _store(directory: str):
    from .pki import PkiStore
    return PkiStore(directory)


def _print_written(paths: list[str], out: TextIO) -> None:
    for path in paths:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        print(f"  {mode:04o}  {path}", file=out)


def _init(args, out: TextIO, err: TextIO) -> int:
    from .pki import PkiError
    cfg = _config(args, err, required=True)
    if cfg is _INVALID:
        return 3
    directory = _pki_dir(args, cfg)
    nodes = [(n.name, n.address) for n in cfg.nodes]
    try:
        written = _store(directory).init(nodes, days=args.days, force=args.force)
    except PkiError as exc:
        print(f"dsv41ctl pki init: {exc}", file=err)
        return 1
    print(f"{directory}: a new cluster CA and certificates for {', '.join(n for n, _ in nodes)} and the coordinator:",
          file=out)
    _print_written(written, out)
    print("Install each node's bundle (the head's too), then restart its agent once:", file=out)
    for name, _ in nodes:
        print(f"  dsv41ctl pki bundle {name} -o {name}.tar; copy it to {name}; there as root: "
              f"tar -xpf {name}.tar -C / && cat /etc/dsv41/tls/agent.env  (lines for /etc/dsv41/agent.env)",
              file=out)
    return 0


def _rotate(args, out: TextIO, err: TextIO) -> int:
    from .pki import PkiError
    cfg = _config(args, err, required=True)
    if cfg is _INVALID:
        return 3
    directory = _pki_dir(args, cfg)
    try:
        written = _store(directory).rotate([(n.name, n.address) for n in cfg.nodes], only=args.node, days=args.days)
    except PkiError as exc:
        print(f"dsv41ctl pki rotate: {exc}", file=err)
        return 1
    print(f"{directory}: re-issued under the same CA:", file=out)
    _print_written(written, out)
    coordinator = args.node in (None, "dsv41-coordinator")
    print("Install the new bundles (`dsv41ctl pki bundle NODE` on every node); agents use them from the next "
          "connection on.", file=out)
    if coordinator:
        print("The bundles pin the new coordinator certificate: an agent with a new bundle refuses the old one. "
              "Restart the coordinator (`systemctl restart dsv41-coordinator`; ranks keep running) and install "
              "every node's new bundle right after; until both are done, the coordinator cannot reach those "
              "agents.", file=out)
    return 0


def _bundle(args, out: TextIO, err: TextIO) -> int:
    from .pki import PkiError
    cfg = _config(args, err, required=False) if not args.dir else None
    if cfg is _INVALID:
        return 3
    try:
        data = _store(_pki_dir(args, cfg)).bundle_tar(args.node)
    except PkiError as exc:
        print(f"dsv41ctl pki bundle: {exc}", file=err)
        return 1
    if args.output:
        try:
            write_private(args.output, data)
        except OSError as exc:
            print(f"dsv41ctl pki bundle: {args.output}: {exc.strerror or exc}", file=err)
            return 1
        print(f"{args.output}: {args.node}'s bundle (holds its private key: delete it once installed)", file=err)
        return 0
    stream = getattr(out, "buffer", None)
    if stream is None or (hasattr(out, "isatty") and out.isatty()):
        print("dsv41ctl pki bundle: refusing to write a tar with a private key to a terminal; redirect it "
              f"(> {args.node}.tar) or use --output", file=err)
        return 1
    out.flush()
    try:
        if stat.S_ISREG(os.fstat(stream.fileno()).st_mode):
            os.fchmod(stream.fileno(), 0o600)  # `> NODE.tar` was created with the umask: the key must not be
    except (OSError, ValueError, AttributeError):
        pass
    stream.write(data)
    stream.flush()
    return 0


def write_private(path: str, data: bytes) -> None:
    """`data` as a new file at `path`, mode 0600, owned by the caller: written to a temporary name
    made with O_EXCL|O_NOFOLLOW beside it, then renamed over `path`. A symbolic link planted at
    `path` is replaced, never followed, and an existing file's owner and mode are not kept."""
    from dsv41.atomicfile import replace_file
    replace_file(os.path.abspath(path), data, 0o600, owner=(os.geteuid(), os.getegid()))


def _list(args, out: TextIO, err: TextIO) -> int:
    from .pki import PkiError
    cfg = _config(args, err, required=False) if not args.dir else None
    if cfg is _INVALID:
        return 3
    directory = _pki_dir(args, cfg)
    try:
        infos = _store(directory).certificates()
    except (PkiError, ValueError, OSError) as exc:
        print(f"dsv41ctl pki list: {directory}: {exc}", file=err)
        return 1
    if not infos:
        print(f"{directory}: no certificates (run `dsv41ctl pki init`)", file=err)
        return 1
    now = time.time()
    print(f"{'NAME':<20}{'EXPIRES':<12}{'DAYS':>6}  NAMES", file=out)
    warnings = []
    for info in infos:
        days = int((info.not_after_unix_s - now) // 86400)
        when = time.strftime("%Y-%m-%d", time.gmtime(info.not_after_unix_s))
        print(f"{info.name:<20}{when:<12}{days:>6}  {', '.join(info.names)}", file=out)
        if info.name == "ca":
            if info.not_after_unix_s - now <= EXPIRY_WARNING_S:
                warnings.append(f"ca: the cluster CA expires on {when}: `dsv41ctl pki init --force`, then install "
                                "every bundle and restart the coordinator")
        elif warning := expiry_warning(info.name, info.not_after_unix_s, now):
            warnings.append(warning)
    for warning in warnings:
        print(f"warning: {warning}", file=out)
    return 1 if warnings else 0

