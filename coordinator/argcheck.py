"""Cross-field checks of a rank argv that SGLang's own parser does not make.

SGLang 0.5.23 accepts `--node-rank 3 --nnodes 3` and a TP size that does not divide over the nodes;
both end in a rendezvous that never completes. Used on rendered plans and by the stand-in engine.
"""

from __future__ import annotations

from typing import Sequence

from .sglang_cli import canonicalize


def _value(args: Sequence[str], name: str) -> str | None:
    """The flag's value; like argparse, the last occurrence wins."""
    found = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(name + "="):
            found = arg.split("=", 1)[1]
    return found


def _int(args: Sequence[str], name: str, default: int) -> int | str:
    raw = _value(args, name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        return f"{name} {raw!r} is not an integer"


def check_sglang_args(args: Sequence[str]) -> list[str]:
    """Errors in the rank's SGLang arguments (without the program name); empty when consistent.
    Flags are read as SGLang reads them (`--node-ra 3` is `--node-rank 3`)."""
    args, errors = canonicalize(args)
    nnodes, rank, tp = _int(args, "--nnodes", 1), _int(args, "--node-rank", 0), _int(args, "--tp-size", 1)
    ep = _int(args, "--ep-size", 1)
    for value in (nnodes, rank, tp, ep):
        if isinstance(value, str):
            errors.append(value)
    if errors:
        return errors
    if nnodes < 1:
        errors.append(f"--nnodes {nnodes} must be at least 1")
    elif not 0 <= rank < nnodes:
        errors.append(f"--node-rank {rank} must be in 0..{nnodes - 1} for --nnodes {nnodes}")
    if nnodes >= 1 and tp % nnodes:
        errors.append(f"--tp-size {tp} must be a multiple of --nnodes {nnodes}")
    if ep < 1 or tp % ep:
        errors.append(f"--ep-size {ep} must divide --tp-size {tp}")
    if nnodes > 1 and _value(args, "--dist-init-addr") is None:
        errors.append("--dist-init-addr HOST:PORT is required with more than one node")
    algo = _value(args, "--speculative-algorithm")
    block = _int(args, "--speculative-dspark-block-size", 0)
    drafts = _value(args, "--speculative-num-draft-tokens")
    if algo == "DSPARK" and isinstance(block, int) and block and drafts is not None and drafts != str(block + 1):
        errors.append(f"--speculative-num-draft-tokens {drafts} must be --speculative-dspark-block-size + 1 "
                      f"= {block + 1}")
    if algo != "DSPARK" and _value(args, "--speculative-dspark-block-size") is not None:
        errors.append("--speculative-dspark-block-size needs --speculative-algorithm DSPARK")
    return errors
