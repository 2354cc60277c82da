import json

import pytest
from hypothesis import given, strategies as st

from sim.answers import answer, find_arithmetic, value_for
from sim.tokens import count_tokens, output_pieces, prompt_text

pytestmark = pytest.mark.unit


def user(text):
    return {"messages": [{"role": "user", "content": text}]}


@pytest.mark.parametrize("text, tokens", [("", 0), ("abcd", 1), ("abcde", 2), ("x" * 400, 100),
                                          ("é" * 2, 1), ("日本", 2)])
def test_prompt_tokens_are_utf8_bytes_over_four_rounded_up(text, tokens):
    assert count_tokens(text) == tokens


def test_prompt_text_joins_message_texts_parts_and_tool_arguments():
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {}}]},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"function": {"name": "f", "arguments": "{\"a\": 1}"}}]}]
    assert prompt_text(messages) == "be brief\nlook\n\n{\"a\": 1}"


def test_prompt_text_refuses_a_content_of_the_wrong_type():
    with pytest.raises(ValueError, match="content must be"):
        prompt_text([{"role": "user", "content": 5}])


@given(st.text())
def test_output_pieces_join_back_to_the_text(text):
    pieces = output_pieces(text)
    assert "".join(pieces) == text
    assert all(p for p in pieces)


def test_output_pieces_are_words_with_their_spaces():
    assert output_pieces("19 + 23 = 42.") == ["19 ", "+ ", "23 ", "= ", "42."]


@pytest.mark.parametrize("prompt", ["What is 19+23?", "Compute 19 + 23.", "19 plus 23 = ?"])
def test_the_smoke_question_is_answered_with_42(prompt):
    ans = answer(user(prompt), "r")
    assert "42" in ans.content and ans.finish_reason == "stop" and not ans.tool_calls


def test_arithmetic_operators():
    assert find_arithmetic("7 * 6").result == 42 and find_arithmetic("50 - 8").result == 42
    assert find_arithmetic("no numbers here") is None


def test_other_prompts_get_a_deterministic_readable_answer():
    first = answer(user("Tell me about the weather in Paris today"), "a")
    again = answer(user("Tell me about the weather in Paris today"), "b")
    assert first == again
    assert "\"Tell me about the weather in\"" in first.content
    words = first.content.split()
    assert len(words) >= 8 and len(set(words)) > len(words) // 2  # not a repeated token
    assert first.content.isascii()


SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "integer"}, "name": {"type": "string", "minLength": 3},
    "ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2},
    "mode": {"enum": ["fast", "slow"]}, "nested": {"type": "object", "properties": {"x": {"type": "number"}}},
    "maybe": {"type": ["null", "string"]}}, "required": ["answer", "name"]}


def test_json_schema_answers_are_valid_json_of_the_schema():
    body = {**user("Return 19+23 as JSON"),
            "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}}
    value = json.loads(answer(body, "r").content)
    assert value["answer"] == 42
    assert isinstance(value["name"], str) and len(value["name"]) >= 3
    assert value["ok"] is True and value["mode"] == "fast" and isinstance(value["maybe"], str)
    assert len(value["tags"]) == 2 and all(isinstance(t, str) for t in value["tags"])
    assert set(value["nested"]) == {"x"} and isinstance(value["nested"]["x"], (int, float))


def test_value_for_honours_bounds():
    assert value_for({"type": "integer", "minimum": 100}, 42) == 100
    assert value_for({"type": "integer", "maximum": 10}, 42) == 10
    assert value_for({"type": "string", "maxLength": 2}, None) == "st"
    assert value_for({"const": "x"}, None) == "x"


def test_json_object_mode():
    assert json.loads(answer({**user("19+23"), "response_format": {"type": "json_object"}}, "r").content) == \
        {"answer": 42}


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


def test_a_tools_request_gets_a_tool_call_with_schema_valid_arguments():
    ans = answer({**user("What is the weather in Paris?"), "tools": TOOLS}, "rid-1")
    assert ans.finish_reason == "tool_calls" and ans.content is None
    (call,) = ans.tool_calls
    assert call.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.arguments)
    assert isinstance(arguments["city"], str) and arguments["days"] >= 1


def test_tool_choice_names_the_tool_or_turns_tools_off():
    named = answer({**user("time?"), "tools": TOOLS,
                    "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "r")
    assert named.tool_calls[0].name == "get_time"
    assert not answer({**user("time?"), "tools": TOOLS, "tool_choice": "none"}, "r").tool_calls


def test_the_tool_round_trip_ends_in_a_text_answer_with_the_result():
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    ans = answer({"messages": messages, "tools": TOOLS}, "r")
    assert ans.finish_reason == "stop" and not ans.tool_calls and "sunny, 21 C" in ans.content


def test_thinking_requests_get_reasoning_content():
    ans = answer({**user("What is 19+23?"), "chat_template_kwargs": {"thinking": True}}, "r")
    assert ans.reasoning and "42" in ans.reasoning and "42" in ans.content
    assert answer(user("What is 19+23?"), "r").reasoning is None
