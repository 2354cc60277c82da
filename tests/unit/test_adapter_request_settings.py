"""Request-side adapters: output-length limit, reasoning budgets, settings parsing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from adapter import max_new_tokens, reasoning_effort
from adapter.max_new_tokens import MaxNewTokens, limit_output
from adapter.reasoning_effort import PUBLISHER_TIERS, ReasoningEffort, default_budget, remap_effort
from dsv41.ranksettings import SettingError, env_choice, env_flag, env_int

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "mct, mt, limit, expected",
    [
        (None, None, 32768, (32768, None)),  # omitted: filled
        (1000, None, 32768, (1000, None)),  # smaller: kept
        (None, 500, 32768, (None, 500)),
        (100_000, None, 32768, (32768, None)),  # larger: clamped
        (None, 1_000_000, 32768, (None, 32768)),
        (40_000, 50_000, 32768, (32768, 32768)),
        (None, None, 0, (None, None)),  # 0: SGLang's behaviour
        (10**6, None, 0, (10**6, None)),
    ],
)
def test_limit_output(mct, mt, limit, expected) -> None:
    assert limit_output(mct, mt, limit) == expected


def test_before_convert_edits_the_request_in_place() -> None:
    request = SimpleNamespace(max_completion_tokens=None, max_tokens=None)
    assert MaxNewTokens(4096).before_convert(object(), request) is None
    assert (request.max_completion_tokens, request.max_tokens) == (4096, None)


def test_max_new_tokens_setting() -> None:
    assert max_new_tokens.build({"DSV41_MAX_NEW_TOKENS": "0"}) is None
    spec = max_new_tokens.build({})
    assert spec is not None and spec.state.limit == 32768
    with pytest.raises(SettingError, match="DSV41_MAX_NEW_TOKENS"):
        max_new_tokens.build({"DSV41_MAX_NEW_TOKENS": "-5"})


def test_named_tiers_take_the_publishers_budgets() -> None:
    assert remap_effort("low") == 50 and remap_effort("HIGH") == 75 and remap_effort("max") == 100
    assert PUBLISHER_TIERS["low"] < remap_effort("xhigh") < PUBLISHER_TIERS["max"] and remap_effort("xhigh") > 75
    for passthrough in (None, "none", "medium", 0.3, 60, "60"):
        assert remap_effort(passthrough) == passthrough


def test_default_budget() -> None:
    assert default_budget(None) == 75 and default_budget("  ") == 75
    assert default_budget("40") == 40 and default_budget("high") == 75
    for bad in ("0", "101", "0.5", "huge"):
        with pytest.raises(SettingError, match="SGLANG_DSV41_REASONING_EFFORT"):
            default_budget(bad)


def test_encoder_hooks_act_only_on_the_v41_spec() -> None:
    adapter = ReasoningEffort(default=60)
    v41, v4 = SimpleNamespace(_spec="dsv41", _default_effort="high"), SimpleNamespace(_spec="dsv4", _default_effort="high")
    adapter.after_init(None, v41)
    adapter.after_init(None, v4)
    assert v41._default_effort == 60 and v4._default_effort == "high"
    args, kwargs = adapter.before_encode(v41, {"messages": []}, effort="max", task=None)
    assert args == (v41, {"messages": []}) and kwargs == {"effort": 100, "task": None}
    assert adapter.before_encode(v4, {}, effort="max") is None


def test_reasoning_setting_switch() -> None:
    assert reasoning_effort.build({"DSV41_REASONING_EFFORT_REMAP": "0"}) is None
    assert reasoning_effort.build({"SGLANG_DSV41_REASONING_EFFORT": "30"}).state.default == 30


def test_settings_helpers_name_the_key_and_the_allowed_values() -> None:
    assert env_flag({"K": "On"}, "K", False) is True and env_flag({}, "K", True) is True
    with pytest.raises(SettingError, match=r"K='maybe': expected 1 or 0"):
        env_flag({"K": "maybe"}, "K", True)
    assert env_int({"N": " 12 "}, "N", 1, 0, 20) == 12
    with pytest.raises(SettingError, match=r"N=21: outside the allowed range \[0, 20\]"):
        env_int({"N": "21"}, "N", 1, 0, 20)
    assert env_choice({"C": "CUDNN"}, "C", "b12x", ("b12x", "cudnn")) == "cudnn"
    with pytest.raises(SettingError, match="expected one of b12x, cudnn"):
        env_choice({"C": "x"}, "C", "b12x", ("b12x", "cudnn"))
