"""/dsv41/inflight: the snapshot of the tokenizer manager's request states and its JSON."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from adapter.inflight import InflightRoute, payload, record_prompt_length, snapshot

pytestmark = pytest.mark.unit


def state(*, created: float, prompt=None, prompt_ids=None, out=False, finished=False, recorded=None):
    s = SimpleNamespace(
        finished=finished,
        out_list=[{"text": "x"}] if out else [],
        output_ids=[],
        obj=SimpleNamespace(input_ids=prompt),
        prompt_token_ids=prompt_ids,
        time_stats=SimpleNamespace(created_time=created, first_token_time=0.0),
    )
    if recorded is not None:
        s.dsv41_prompt_tokens = recorded
    return s


def test_snapshot_lists_unfinished_requests_largest_prompt_first() -> None:
    states = {
        "small": state(created=90.0, prompt=list(range(10)), out=True),
        "huge": state(created=50.0, recorded=200_000),
        "done": state(created=10.0, prompt=list(range(5)), finished=True),
        "text": state(created=99.5, prompt="a text prompt"),  # not tokenized yet
        "ids": state(created=80.0, prompt_ids=list(range(3000))),
    }
    reqs = snapshot(states, now=100.0)
    assert [r.rid for r in reqs] == ["huge", "ids", "small", "text"]
    huge, ids, small, text = reqs
    assert (huge.prompt_tokens, huge.prefilled_tokens, huge.age_s) == (200_000, 0, 50.0)
    assert (ids.prompt_tokens, ids.prefilled_tokens) == (3000, 0)
    assert (small.prompt_tokens, small.prefilled_tokens) == (10, 10)  # output arrived: prefilled
    assert (text.prompt_tokens, text.prefilled_tokens, text.age_s) == (0, 0, 0.5)


def test_payload_schema() -> None:
    body = payload(snapshot({"r1": state(created=1.0, recorded=7)}, now=3.25))
    assert json.loads(json.dumps(body)) == {
        "requests": [{"rid": "r1", "prompt_tokens": 7, "prefilled_tokens": 0, "age_s": 2.25}],
        "source": "tokenizer_manager",
    }


def test_prompt_length_is_recorded_at_dispatch() -> None:
    st = state(created=1.0, prompt="text")
    manager = SimpleNamespace(rid_to_state={"r": st})
    record_prompt_length(manager, SimpleNamespace(rid="r", input_ids=list(range(1234))))
    record_prompt_length(manager, SimpleNamespace(rid="gone", input_ids=[1]))
    assert st.dsv41_prompt_tokens == 1234
    route = InflightRoute(states=lambda: manager.rid_to_state, clock=lambda: 2.0)
    route.before_send_batch(manager, [SimpleNamespace(rid="r", input_ids=list(range(99)))])
    assert route.body() == (200, {"requests": [{"rid": "r", "prompt_tokens": 99, "prefilled_tokens": 0, "age_s": 1.0}], "source": "tokenizer_manager"})


def test_unreadable_states_answer_503() -> None:
    status, body = InflightRoute(states=lambda: None).body()
    assert status == 503 and "not available" in body["error"]
