"""admission_gate.torch_group_min on a real gloo group of three processes: every rank gets the smallest
headroom, and whether a lone request's wait is over on any rank, so that every rank makes the same
decision."""

import os
import socket
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit  # noqa: E402

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from adapter.admission_gate import torch_group_min  # noqa: E402

RANKS = 3


def worker(rank, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    group = dist.new_group(list(range(RANKS)), backend="gloo")
    scheduler = type("Scheduler", (), {"tp_size": RANKS, "tp_cpu_group": group})()
    out.put((rank, torch_group_min(scheduler, ([7_000_000_000, 150_000_001, 1 << 61][rank], [1, 0, 1][rank]))))
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, out)) for r in range(RANKS)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in range(RANKS))
    for p in procs:
        p.join(30)
    single = torch_group_min(type("Scheduler", (), {"tp_size": 1})(), (42, 1))  # one rank: no collective
    emit({"minimum": [got[r] for r in range(RANKS)], "single": single, "pid": os.getpid()})
