"""prefill_empty_cache on the real Scheduler.run_batch (before SGLang's body launches the batch); autotune_keep on the real
flashinfer_autotune module."""

import sys
from types import SimpleNamespace

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import Anything, emit, installer, marked, marks  # noqa: E402

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


def launch(mode, *prompt_lengths):
    batch = SimpleNamespace(forward_mode=mode, reqs=[req(n) for n in prompt_lengths], is_dllm=lambda: False)
    before = len(emptied)
    try:
        Scheduler.run_batch(Anything(), batch)
    except Exception:  # noqa: BLE001 - SGLang's body on a stand-in scheduler may fail after the hook
        pass
    return len(emptied) - before


inst = installer()
emit(
    {
        "marked": marks(Scheduler.run_batch),
        "marked_autotune": marked(flashinfer_autotune.flashinfer_autotune_cache_path),
        # in this order: each release is of the batch launched before
        "long_prefill_chunk": launch(ForwardMode.EXTEND, 20_000),
        "mixed_batch": launch(ForwardMode.EXTEND, 100, 9_000),
        "after_the_last_long_chunk": launch(ForwardMode.EXTEND, 100, 200),
        "short_prefill": launch(ForwardMode.EXTEND, 100, 200),
        "decode": launch(ForwardMode.DECODE, 20_000),
        "installed": sorted(s for s in ("prefill_empty_cache", "autotune_keep") if inst and inst.applied(s)),
    }
)
