"""max_new_tokens and reasoning_effort on the real OpenAI chat serving modules."""

import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit, installer, marked  # noqa: E402

from sglang.srt.entrypoints.openai import serving_deepseek_recipe  # noqa: E402
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest  # noqa: E402
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat  # noqa: E402


class Reached(Exception):
    """Raised by the stand-in serving object once SGLang's own conversion code runs."""


class StandInServing:
    def __getattr__(self, name):
        raise Reached(name)


def convert(**fields):
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)
    try:
        OpenAIServingChat._convert_to_internal_request(StandInServing(), request)
    except Reached:
        pass
    return [request.max_completion_tokens, request.max_tokens]


class Recipe:
    """Records what SGLang's V4.1 encoder hands to deepseek-recipe."""

    def __init__(self):
        self.calls = []

    def encode(self, body, *, task=None, effort_budget=None, image_urls=None):
        self.calls.append({"effort_budget": effort_budget, "named": body.get("reasoning_effort")})
        return [1, 2, 3]


def encode(effort, spec="dsv41", default=None):
    enc = object.__new__(serving_deepseek_recipe.DeepSeekRecipeChatEncodingAdapter)
    enc._spec = spec
    enc._default_effort = default
    enc.deepseek_recipe = Recipe()
    try:
        enc._encode({"messages": [], "thinking": True}, effort=effort)
    except ValueError as e:
        return {"error": str(e)}
    return enc.deepseek_recipe.calls[-1]


def request_effort(**fields):
    """What a chat request's reasoning fields become after SGLang's own request parsing."""
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)
    effort = request.reasoning_effort
    if request.chat_template_kwargs and "reasoning_effort" in request.chat_template_kwargs:
        effort = request.chat_template_kwargs["reasoning_effort"]
    return encode(effort, default=75)


inst = installer()
emit(
    {
        "mode": inst.mode() if inst else None,
        "marked_convert": marked(OpenAIServingChat._convert_to_internal_request),
        "marked_encode": marked(serving_deepseek_recipe.DeepSeekRecipeChatEncodingAdapter._encode),
        "omitted": convert(),
        "small": convert(max_tokens=100),
        "large_completion": convert(max_completion_tokens=500_000),
        "large_both": convert(max_tokens=900_000, max_completion_tokens=400_000),
        "tier_high": encode("high"),
        "tier_low": encode("low"),
        "tier_max": encode("max"),
        "tier_xhigh": encode("xhigh"),
        "float": encode(0.3),
        "integer_string": encode("60"),
        "none_uses_default": encode(None, default=75),
        "v4_keeps_tiers": encode("high", spec="dsv4"),
        "openai_float": request_effort(reasoning_effort=0.42),
        "openai_tier": request_effort(reasoning_effort="low"),
        "template_kwargs": request_effort(chat_template_kwargs={"reasoning_effort": 33}),
    }
)
