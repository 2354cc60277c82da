"""admission_gate on the real Scheduler._get_new_batch_prefill_raw and PrefillAdder.add_one_req: inside a
scheduling pass a request whose first piece would leave less than the guard gets SGLang's own
AddReqResult.OTHER and SGLang's body never runs, with something else in flight and alone; alone, once it
has waited LONE_WAIT_S, the body runs (here its ignore_eos branch, on a stand-in adder)."""

import sys
import time
from array import array
from types import SimpleNamespace

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit, installer, marks  # noqa: E402

from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.managers.scheduler import Scheduler  # noqa: E402

inst = installer()
spec = inst.spec("admission_gate") if inst else None


class Running:
    def __init__(self, n):
        self.reqs = [object()] * n

    def is_empty(self):
        return not self.reqs


def adder(running):
    # SGLang's body: prefill_max_requests None, then ignore_eos with a disabled tree cache takes
    # add_one_req_ignore_eos, which this stand-in answers
    return SimpleNamespace(prefill_max_requests=None, can_run_list=[], running_batch=Running(running),
                           rem_chunk_tokens=768, tree_cache=SimpleNamespace(disable=True),
                           add_one_req_ignore_eos=lambda req: "SGLang's body")


def req():
    # SGLang's own Req as init_next_round_input leaves it before add_one_req: its fill ids
    # refreshed, 60000 of its 61000 tokens matched in the prefix cache
    r = Req("hit", "", array("q", range(61_000)), SamplingParams(max_new_tokens=8, ignore_eos=True))
    r.refresh_fill_ids()
    r.prefix_len = 60_000
    return r


def offer(running):
    if spec is None:
        return PrefillAdder.add_one_req(adder(running), req(), has_chunked_req=False, truncation_align_size=None)
    gate = spec.state
    scheduler = SimpleNamespace(tp_size=1, chunked_req=None)
    # the pass as _get_new_batch_prefill_raw's hook opens it, around the real (wrapped) add_one_req
    return gate.around_prefill(lambda s: PrefillAdder.add_one_req(adder(running), req(), has_chunked_req=False,
                                                                  truncation_align_size=None), scheduler)


busy, idle = offer(2), offer(0)
if spec is not None:
    from dsv41.admission import LONE_WAIT_S

    later = time.monotonic() + LONE_WAIT_S
    spec.state._clock = lambda: later  # the lone request's wait is over
waited = offer(0)
emit({
    "marked_prefill": marks(Scheduler._get_new_batch_prefill_raw),
    "marked_add_one_req": marks(PrefillAdder.add_one_req),
    "busy": busy.name if isinstance(busy, AddReqResult) else busy,
    "idle": idle.name if isinstance(idle, AddReqResult) else idle,
    "waited": waited.name if isinstance(waited, AddReqResult) else waited,
    "refusals": spec.state.refusals if spec else None,
})
