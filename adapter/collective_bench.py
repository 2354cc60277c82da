"""The collective bandwidth gate's job: a short all-reduce among the nodes, in the rank's runtime.

Run by the agent as the transient unit dsv41-collective-test.service with the rank's Python (or
container), environment and GID, in place of SGLang:
    python -m adapter.collective_bench --master-addr HEAD --master-port P --rank R --nodes a,b,c ...
Every node must run it at once. It measures all-reduce bus bandwidth for each pair of nodes and for
the whole group (nccl-tests' busbw, warm-up excluded), agrees on the figures (each the slowest
node's time), and prints one line, dsv41/collective.py's RESULT_PREFIX and JSON. With NCCL it
reads NCCL's own INFO lines (a debug file of its own) for the transport NCCL chose.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import os
import sys
import time
from datetime import timedelta

from dsv41.collective import BACKENDS, GROUP, Figure, Result, bus_bandwidth_gbps, inter_node_transport, pair_name


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m adapter.collective_bench")
    p.add_argument("--master-addr", required=True, help="the head's fabric address (rank 0 listens there)")
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--nodes", required=True, help="node names in rank order, comma-separated")
    p.add_argument("--backend", choices=BACKENDS, required=True)
    p.add_argument("--bytes", type=int, default=64 << 20, help="message size of each all-reduce")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout-s", type=int, default=120)
    return p


def _scratch_dir() -> str:
    """A directory the unit may write (the rank's sandbox leaves only its cache writable)."""
    for candidate in (os.environ.get("XDG_CACHE_HOME"), os.path.join(os.environ.get("HOME", "/"), ".cache"),
                      os.environ.get("HOME"), "/tmp"):
        if candidate and os.path.isdir(candidate) and os.access(candidate, os.W_OK):
            return candidate
    return "/tmp"


def _nccl_debug_to_file() -> str:
    """Before NCCL initialises: its INFO lines go to a file of this job's, which is read afterwards."""
    prefix = os.path.join(_scratch_dir(), f"dsv41-collective-nccl.{os.getpid()}")
    os.environ["NCCL_DEBUG"] = "INFO"
    os.environ["NCCL_DEBUG_SUBSYS"] = "INIT,NET"
    os.environ["NCCL_DEBUG_FILE"] = prefix + ".%p.log"
    return prefix


def _read_and_remove(prefix: str) -> list[str]:
    lines: list[str] = []
    for path in glob.glob(prefix + ".*.log"):
        try:
            with open(path, errors="replace") as f:
                lines += f.read().splitlines()
            os.unlink(path)
        except OSError:
            pass
    return lines


def _time_all_reduce(torch, dist, tensor, group, iters: int, warmup: int, cuda: bool) -> float:
    """Mean seconds of one all-reduce in `group`, warm-up excluded."""
    for _ in range(warmup):
        dist.all_reduce(tensor, group=group)
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor, group=group)
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def measure(args: argparse.Namespace) -> Result:
    nodes = args.nodes.split(",")
    prefix = _nccl_debug_to_file() if args.backend == "nccl" else ""
    import torch
    import torch.distributed as dist

    cuda = args.backend == "nccl"
    if cuda:
        torch.cuda.set_device(0)  # one GPU per node
    dist.init_process_group(args.backend, init_method=f"tcp://{args.master_addr}:{args.master_port}",
                            rank=args.rank, world_size=len(nodes), timeout=timedelta(seconds=args.timeout_s))
    try:
        device = "cuda" if cuda else "cpu"
        tensor = torch.ones(max(1, args.bytes // 4), dtype=torch.float32, device=device)
        nbytes = tensor.numel() * 4
        # Every rank creates every subgroup, in the same order (torch.distributed requires it).
        members = [list(p) for p in itertools.combinations(range(len(nodes)), 2)]
        if len(nodes) > 2:
            members.append(list(range(len(nodes))))
        groups = [dist.new_group(m) for m in members]
        if len(nodes) == 2:
            groups[0] = None  # the pair is the whole group
        times = torch.zeros(len(members), dtype=torch.float64, device=device)
        for i, (ranks, group) in enumerate(zip(members, groups)):
            dist.barrier()  # one measurement at a time: each has the links to itself
            if args.rank in ranks:
                times[i] = _time_all_reduce(torch, dist, tensor, group, args.iters, args.warmup, cuda)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # every node reports the same, slowest, figures
        seconds = times.cpu().tolist()
    finally:
        dist.destroy_process_group()
    figures = []
    for ranks, s in zip(members, seconds):
        names = tuple(nodes[r] for r in ranks)
        group = pair_name(*names) if len(ranks) == 2 else GROUP
        figures.append(Figure(group, names, nbytes, s, bus_bandwidth_gbps(nbytes, s, len(ranks))))
    if len(nodes) == 2:
        figures.append(Figure(GROUP, tuple(nodes), nbytes, seconds[0], figures[0].busbw_gbps))
    transport = inter_node_transport(_read_and_remove(prefix)) if prefix else ""
    return Result(args.backend, transport, tuple(figures))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 2 <= len(args.nodes.split(",")) <= 64 or not 0 <= args.rank < len(args.nodes.split(",")):
        print(f"collective_bench: --nodes needs 2..64 names and --rank one of their indices", file=sys.stderr)
        return 2
    result = measure(args)
    print(result.to_line(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
