"""loop_abort on the real Req.update_finish_state of sglang.srt.managers.schedule_batch."""

import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import WordTokenizer, emit, installer, marked  # noqa: E402

from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402


def run(ids, tokenizer=None, ignore_eos=False, max_new_tokens=100_000):
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
    params.normalize(None)
    req = Req("rid-1", "prompt", [1, 2, 3], params)
    req.tokenizer = tokenizer
    for n, tok in enumerate(ids, 1):
        req.output_ids.append(tok)
        req.update_finish_state()
        if req.finished():
            return {"finished_at": n, "reason": req.finished_reason.to_json()}
    return {"finished_at": None, "reason": None}


tok = WordTokenizer()
table = "| id | name | qty |\n| --- | --- | --- |\n" + "".join(f"| {i} | part-{i} | {i % 7} |\n" for i in range(80))
inst = installer()
emit(
    {
        "armed": inst is not None,
        "mode": inst.mode() if inst else None,
        "marked": marked(Req.update_finish_state),
        "same_token": run([5] * 200),
        "lines": run(tok.encode("Hello\n" + "I apologize for the confusion above .\n" * 20), tokenizer=tok),
        "block": run(tok.encode("Start . " + "the car moves left and the road scrolls by while the sky stays blue " * 3 * 8)),
        "table": run(tok.encode(table), tokenizer=tok),
        "ignore_eos": run([5] * 200, ignore_eos=True),
        "length_still_wins": run([5] * 200, max_new_tokens=30),
    }
)
