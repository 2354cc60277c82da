"""Command line of the pack job (installed as ``dsv41-pack``); see agent/pack/__init__.py."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dsv41 import engram_format as fmt
from agent.pack.checkpoint import CheckpointError
from agent.pack.packer import PackError, PackJob, Packer
from dsv41.sdnotify import SdNotify

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str) -> int:
    """Bytes from '67108864', '64M', '1G' or '16K' (binary units)."""
    raw = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = raw[-1] if raw and raw[-1] in "KMG" else ""
    try:
        value = int(raw[:-1] if unit else raw) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 64M, 1G or 4096") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def parse_layers(text: str) -> tuple[int, ...]:
    try:
        layers = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers takes numbers like 1,14, got {text!r}") \
            from None
    bad = [x for x in layers if x not in fmt.LAYERS]
    if bad or not layers:
        raise argparse.ArgumentTypeError(f"--layers must be taken from {fmt.LAYERS}, got {text!r}")
    return layers


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv41-pack",
                                description="Pack this rank's Engram rows into local shards.")
    p.add_argument("--model", required=True, type=Path, help="checkpoint directory (with "
                   "model.safetensors.index.json)")
    p.add_argument("--out", required=True, type=Path, help="output directory (DSV41_PACKED_DIR)")
    p.add_argument("--rank", required=True, type=int, help="this node's TP rank")
    p.add_argument("--tp", required=True, type=int, help="tensor-parallel size")
    p.add_argument("--layers", type=parse_layers, default=fmt.LAYERS, help="default: 1,14")
    p.add_argument("--block-size", type=parse_size, default=8 * 2**20,
                   help="bytes per read and write (default 8M)")
    p.add_argument("--checkpoint-size", type=parse_size, default=2**30,
                   help="bytes between fsync'ed resume points (default 1G)")
    p.add_argument("--verify-rows", type=int, default=64,
                   help="rows sampled against the checkpoint besides both ends (default 64)")
    p.add_argument("--max-mbps", type=float, default=None,
                   help="throttle to this many MB/s (default: unlimited)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        job = PackJob(model_dir=args.model, out_dir=args.out, rank=args.rank, tp=args.tp,
                      layers=args.layers, block_bytes=args.block_size,
                      checkpoint_bytes=args.checkpoint_size, verify_rows=args.verify_rows,
                      max_bytes_per_s=args.max_mbps * 1e6 if args.max_mbps else None)
    except ValueError as e:
        parser.error(str(e))
    notify = SdNotify.from_env()
    try:
        Packer(job, notify).run()
    except (PackError, CheckpointError) as e:
        print(f"dsv41-pack: error: {e}", file=sys.stderr, flush=True)
        notify.status(f"failed: {e}")
        return 1
    finally:
        notify.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
