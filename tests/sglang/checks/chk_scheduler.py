"""prefill_empty_cache on the real Scheduler.process_batch_result; autotune_keep on the real
flashinfer_autotune module."""

import sys
from types import SimpleNamespace

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import Anything, emit, installer, marked  # noqa: E402

import torch  # noqa: E402

from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.managers.scheduler import Scheduler  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.model_executor.runner import flashinfer_autotune  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

emptied = []
torch.cuda.is_available = lambda: True  # CPU machine: count the calls instead
torch.cuda.empty_cache = lambda: emptied.append(1)


def req(prompt_tokens):
    params = SamplingParams(max_new_tokens=16)
    params.normalize(None)
    return Req(f"r{prompt_tokens}", "", list(range(prompt_tokens)), params)


def process(mode, *prompt_lengths):
    batch = SimpleNamespace(forward_mode=mode, reqs=[req(n) for n in prompt_lengths], is_dllm=lambda: False)
    before = len(emptied)
    Scheduler.process_batch_result(Anything(), batch, Anything())
    return len(emptied) - before


inst = installer()
emit(
    {
        "marked": marked(Scheduler.process_batch_result),
        "marked_autotune": marked(flashinfer_autotune.flashinfer_autotune_cache_path),
        "long_prefill_chunk": process(ForwardMode.EXTEND, 20_000),
        "mixed_batch": process(ForwardMode.EXTEND, 100, 9_000),
        "short_prefill": process(ForwardMode.EXTEND, 100, 200),
        "decode": process(ForwardMode.DECODE, 20_000),
        "installed": sorted(s for s in ("prefill_empty_cache", "autotune_keep") if inst and inst.applied(s)),
    }
)
