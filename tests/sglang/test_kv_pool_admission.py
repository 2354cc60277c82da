"""The stand-in's KV pool admission (sim/engine.plan_chunk) and the guard's projection of it,
against SGLang 0.5.23's own PrefillAdder over its own token allocator (checks/chk_kv_admission.py)."""

from __future__ import annotations

import pytest

from sim.engine import plan_chunk
from tests.sglang.harness import Sglang

pytestmark = pytest.mark.sglang


def test_a_request_waits_while_its_whole_prompt_does_not_fit_in_the_free_slots(sglang: Sglang) -> None:
    result, _ = sglang.check("chk_kv_admission", armed=False)
    empty, busy = result["empty"], result["held_6000"]
    # admitted requests take one chunk now (the rest later): what counts is their whole prompt
    assert empty["9000"] == {"result": "OTHER", "admitted": ["r9000"], "piece": 768}
    assert busy["3000"] == {"result": "OTHER", "admitted": ["r3000"], "piece": 768}
    # SGLang wants the prompt, its expected output (max_new_tokens 1 here, up to 4096) and one
    # slot more below the free slots: 9997 + 1 + 1 < 10000 goes in, 9998 waits (NO_TOKEN)
    assert empty["9997"]["admitted"] == ["r9997"] and busy["3997"]["admitted"] == ["r3997"]
    for got in (empty["9998"], empty["12000"], busy["3998"], busy["4000"]):
        assert got == {"result": "NO_TOKEN", "admitted": [], "piece": 0}
    assert result["free"] == 4_000
    # The stand-in keeps the prompt alone below the free slots: it admits up to max_new + 1 more
    # tokens than SGLang (harder on memory, never kinder), and waits where SGLang waits past that.
    assert plan_chunk([("r", 9_000)], 768, 10_000) == [("r", 768)]
    assert plan_chunk([("r", 3_998)], 768, 4_000) == [("r", 768)]  # SGLang: NO_TOKEN (its +2)
    assert plan_chunk([("r", 4_000)], 768, 4_000) == [] and plan_chunk([("r", 12_000)], 768, 10_000) == []
