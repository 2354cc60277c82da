"""The inflight adapter's scheduler hook on the real Scheduler.get_next_batch_to_run: SGLang's own
body runs (the chunked request's stash, the running batch filter, the prefill plan, the
schedule-time stamps on real Req objects), then the hook publishes the snapshot that rank 0's
route reads; read back through the route's own reader. The real Scheduler.run_batch then returns
(through its prebuilt path), and the hook after it marks the snapshot's step launched. The
waiting requests are matched against a real RadixCache (SGLang's simulated one: its tree without
memory pools) holding a 12000-token prefix: one shares all of it, one 5000 tokens of it (the
match ends inside the stored node, which SGLang's match splits), one none."""

import os
import sys
import tempfile
from types import SimpleNamespace

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit, installer, marked  # noqa: E402

from adapter import reqstate  # noqa: E402
from array import array  # noqa: E402

from sglang.srt.managers.schedule_batch import NextBatchPlan, Req  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import InsertParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402
from sglang.srt.managers.scheduler import Scheduler  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402


class Anything:
    """A scheduler stand-in: unnamed attributes are no-op callables; named ones are as given."""

    def __init__(self, **fixed):
        self.__dict__.update(fixed)

    def __getattr__(self, name):
        return Anything()

    def __call__(self, *args, **kwargs):
        return Anything()

    def __bool__(self):
        return False


class Passes:
    """Adapters that hand the batch through unchanged (DP attention off, no n-gram embedding)."""

    def maybe_prepare_mlp_sync_batch(self, batch, need_sync=False):
        return batch

    def maybe_convert_decode_to_extend(self, batch):
        return batch

    def prepare_for_forward(self, batch, chunked_req=None):
        return batch


def req(rid, prompt_tokens, prefix_len=0, extend_end=None, ids=None):
    params = SamplingParams(max_new_tokens=16)
    params.normalize(None)
    r = Req(rid, "", list(range(prompt_tokens)) if ids is None else ids, params)
    r.prefix_len, r.extend_end = prefix_len, extend_end
    return r


class Running:
    reqs = ()

    def batch_size(self):
        return len(self.reqs)

    def filter_batch(self, **_kwargs):
        pass

    def is_empty(self):
        return not self.reqs


directory = os.environ.get("DSV41_PROGRESS_DIR") or tempfile.mkdtemp()
growing = req("job-1", 30_000, prefix_len=6144, extend_end=6912)
queued = req("job-10", 20_000)
partial = req("job-11", 6000, ids=list(range(5000)) + [10**6 + i for i in range(1000)])
cold = req("job-12", 3000, ids=[2 * 10**6 + i for i in range(3000)])
tree = RadixCache.create_simulated()
tree.insert(InsertParams(key=RadixKey(token_ids=array("q", range(12_000)))))
batch = SimpleNamespace(forward_mode=ForwardMode.EXTEND, reqs=[growing])
scheduler = Anything(tp_rank=0, chunked_req=growing, waiting_queue=[queued, partial, cold], tree_cache=tree,
                     dllm_config=None, enable_hisparse=False,
                     require_mlp_sync=False, dp_attn_adapter=Passes(), ngram_embedding_manager=Passes(),
                     _should_defer_prefill=lambda running: False,
                     get_new_batch_prefill=lambda running: NextBatchPlan(batch_to_run=batch, running_batch=running))
error = None
try:
    plan = Scheduler.get_next_batch_to_run(scheduler, Running(), None)
except Exception as exc:  # noqa: BLE001 - reported, the test says what failed
    error, plan = f"{type(exc).__name__}: {exc}", None
path = reqstate.path_for(0, directory)
listed = reqstate.read(path) if os.path.exists(path) else None


class Prebuilt:
    """A forward mode SGLang's run_batch hands to its prebuilt path at once (the launch itself is
    a GPU's): run_batch returns, and the hook after it marks the listed step launched."""

    def is_split_prefill(self):
        return False

    def is_prebuilt(self):
        return True


launch_error = None
try:
    Scheduler.run_batch(Anything(forward_ct=0, _sched_idled=False, processed_tokens_counter=0,
                                 scripted_scheduler_hook=None, forward_sleep_time=None),
                        SimpleNamespace(forward_mode=Prebuilt(), extend_num_tokens=0, reqs=[], split_index=0))
except Exception as exc:  # noqa: BLE001 - reported, the test says what failed
    launch_error = f"{type(exc).__name__}: {exc}"
inst = installer()
snap = reqstate.read(path) if os.path.exists(path) else None

# The KV pool's slots in use, as the hook reads them from SGLang's own allocators (CPU tensors).
import torch  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402
from adapter.scheduler_requests import kv_in_use  # noqa: E402

slots = TokenToKVPoolAllocator(10_000, torch.float16, "cpu", None, False)
held = slots.alloc(7044)
in_use = [kv_in_use(SimpleNamespace(token_to_kv_pool_allocator=slots))]
slots.free(held[:1000])
in_use.append(kv_in_use(SimpleNamespace(token_to_kv_pool_allocator=slots)))
paged = PagedTokenToKVPoolAllocator(8192, 64, torch.float16, "cpu", None, False)
in_use.append(kv_in_use(SimpleNamespace(token_to_kv_pool_allocator=paged)))
emit({
    "launch_error": launch_error,
    "launched_before_run_batch": bool(listed and listed.launched_ns),
    "launched_after_run_batch": bool(snap and snap.launched_ns and snap.launched_ns >= snap.written_ns),
    "marked": marked(Scheduler.get_next_batch_to_run),
    "installed": bool(inst and inst.applied("inflight")),
    "error": error,
    "plan_is_sglangs": plan is not None and plan.batch_to_run is batch,
    "records": [[r.rid, r.state, r.prompt_tokens, r.prefilled_tokens, r.chunk_tokens] for r in snap.records]
    if snap else None,
    "cached": [r.cached_tokens for r in snap.records] if snap else None,
    # the requests as SGLang left them: the adapter's match touched none of their fields
    "waiting_prefix_lens": [r.prefix_len for r in (queued, partial, cold)],
    "tree_still_matches": tree.match_prefix(__import__("sglang.srt.mem_cache.base_prefix_cache", fromlist=["x"])
                                            .MatchPrefixParams(key=RadixKey(token_ids=array("q", range(12_000)))))
    .device_prefix_len,
    "writer_is_this_process": bool(snap and snap.pid == os.getpid()),
    "kv_in_use": in_use,
})
