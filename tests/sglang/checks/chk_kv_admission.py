"""SGLang 0.5.23's own PrefillAdder over its own TokenToKVPoolAllocator (10000 slots, CPU) and a
RadixCache: which waiting requests it admits, against the free slots, as the stand-in's scheduler
(sim/engine.plan_chunk) and the guard's projection model it. No adapter is involved."""

import sys
from array import array

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit  # noqa: E402

import torch  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402
from sglang.srt.runtime_context import publish  # noqa: E402

args = prepare_server_args(["--model-path", "dummy", "--schedule-policy", "fcfs"])
args.resolve_once()
publish(args, role="scheduler")

from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.managers.schedule_policy import PrefillAdder  # noqa: E402
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

POOL, CHUNK, MAX_NEW = 10_000, 768, 1


class Running:
    """An empty running batch."""
    reqs: list = []

    def is_empty(self):
        return True

    def batch_size(self):
        return 0


tree = RadixCache.create_simulated()
pool = TokenToKVPoolAllocator(POOL, torch.float16, "cpu", None, False)


def offer(tokens: int) -> dict:
    """One waiting request of `tokens` (nothing cached) offered to a fresh PrefillAdder."""
    req = Req(f"r{tokens}", "", array("q", range(tokens)), SamplingParams(max_new_tokens=MAX_NEW))
    req.refresh_fill_ids()
    req.prefix_len = 0
    req.last_node = tree.root_node
    adder = PrefillAdder(1, tree, pool, Running(), 0.7, 16_384, CHUNK)
    result = adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    return {"result": result.name, "admitted": [r.rid for r in adder.can_run_list],
            "piece": (req.extend_end - req.prefix_len) if adder.can_run_list else 0}


empty = {n: offer(n) for n in (9_000, 9_997, 9_998, 12_000)}
held = pool.alloc(6_000)  # a request holds 6000 slots: 4000 free
busy = {n: offer(n) for n in (3_000, 3_997, 3_998, 4_000)}
emit({"empty": {str(k): v for k, v in empty.items()}, "held_6000": {str(k): v for k, v in busy.items()},
      "free": pool.available_size()})
