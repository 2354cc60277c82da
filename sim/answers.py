"""What the stand-in answers a chat request: a pure function of the request body.

19+23 gives 42 (finish "stop"); a `tools` request gives a call of the chosen tool with arguments
that fit its schema; a JSON-schema `response_format` gives JSON valid for simple object schemas;
anything else gets a short, fixed-form sentence that is clearly not garbage.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from .tokens import content_text

_ARITH = re.compile(r"(-?\d{1,12})\s*(\+|-|\*|×|x|plus|minus|times)\s*(-?\d{1,12})", re.I)
_OPS = {"+": "+", "plus": "+", "-": "-", "minus": "-", "*": "*", "×": "*", "x": "*", "times": "*"}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


@dataclass(frozen=True)
class Answer:
    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: str | None = None
    finish_reason: str = "stop"  # "tool_calls" when tool_calls

    @property
    def text_for_tokens(self) -> str:
        """What the answer's output tokens are counted over."""
        return (self.reasoning or "") + (self.content or "") + "".join(c.arguments for c in self.tool_calls)


@dataclass(frozen=True)
class Arithmetic:
    a: int
    op: str
    b: int

    @property
    def result(self) -> int:
        return {"+": self.a + self.b, "-": self.a - self.b, "*": self.a * self.b}[self.op]

    def sentence(self) -> str:
        return f"{self.a} {self.op} {self.b} = {self.result}."


def find_arithmetic(text: str) -> Arithmetic | None:
    match = _ARITH.search(text)
    if not match:
        return None
    return Arithmetic(int(match.group(1)), _OPS[match.group(2).lower()], int(match.group(3)))


def _last(messages: list[dict], role: str) -> dict | None:
    return next((m for m in reversed(messages) if m.get("role") == role), None)


def value_for(schema: Any, number: int | None, depth: int = 0) -> Any:
    """A value valid for a simple JSON schema (object, array, string, number, integer, boolean,
    null, enum, const, anyOf/oneOf); `number` fills numeric fields when the prompt computed one."""
    if not isinstance(schema, dict) or depth > 8:
        return None
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            return value_for(schema[key][0], number, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        kind = "object" if "properties" in schema else "string"
    if kind == "object":
        props = schema.get("properties") or {}
        return {name: value_for(sub, number, depth + 1) for name, sub in props.items()}
    if kind == "array":
        count = max(int(schema.get("minItems", 1)), 0)
        if "maxItems" in schema:
            count = min(count, int(schema["maxItems"]))
        return [value_for(schema.get("items", {"type": "string"}), number, depth + 1) for _ in range(count)]
    if kind in ("integer", "number"):
        value = number if number is not None else 0
        if "minimum" in schema:
            value = max(value, schema["minimum"])
        if "maximum" in schema:
            value = min(value, schema["maximum"])
        return int(value) if kind == "integer" else value
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    text = str(number) if number is not None else "stand-in"
    min_length = int(schema.get("minLength", 0))
    text = text.ljust(min_length, "x")
    return text[: int(schema["maxLength"])] if "maxLength" in schema else text


def _plain(prompt: str, arithmetic: Arithmetic | None) -> str:
    if arithmetic:
        return f"{arithmetic.sentence()} The answer is {arithmetic.result}."
    words = prompt.split()
    if not words:
        return "Hello. This is the dsv41 stand-in engine; it has no model and gives fixed-form answers."
    topic = " ".join(words[:6])
    return (f"This is the dsv41 stand-in engine, which has no model. Your message of {len(words)} words "
            f"began with \"{topic}\".")


def _tool_name(tools: list[dict], choice: Any) -> str | None:
    names = [t.get("function", {}).get("name") for t in tools if isinstance(t, dict)]
    names = [n for n in names if n]
    if not names or choice == "none":
        return None
    if isinstance(choice, dict):
        wanted = (choice.get("function") or {}).get("name")
        return wanted if wanted in names else None
    return names[0]


def answer(body: dict, rid: str) -> Answer:
    messages = body.get("messages") or []
    user = _last(messages, "user")
    prompt = content_text(user.get("content")) if user else ""
    arithmetic = find_arithmetic(prompt)
    number = arithmetic.result if arithmetic else None
    kwargs = body.get("chat_template_kwargs") or {}
    thinking = bool(kwargs.get("thinking") or kwargs.get("enable_thinking"))
    reasoning = (f"The user asks: {prompt[:80]}. " + (f"{arithmetic.sentence()}" if arithmetic else "Answer briefly.")
                 if thinking else None)

    tools = body.get("tools") or []
    last = messages[-1] if messages else {}
    choice = body.get("tool_choice", "auto")
    name = _tool_name(tools, choice) if tools else None
    if name and (last.get("role") != "tool" or choice == "required" or isinstance(choice, dict)):
        tool = next(t for t in tools if t.get("function", {}).get("name") == name)
        arguments = json.dumps(value_for(tool["function"].get("parameters") or {"type": "object"}, number))
        call_id = "call_" + hashlib.sha256(f"{rid}:{name}".encode()).hexdigest()[:24]
        return Answer(None, (ToolCall(call_id, name, arguments),), reasoning, "tool_calls")
    if last.get("role") == "tool":
        result = content_text(last.get("content"))
        return Answer(f"The tool returned: {result}", (), reasoning)

    fmt = body.get("response_format") or {}
    if fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema") or {}
        schema = spec.get("schema") or spec.get("schema_") or {"type": "object"}
        return Answer(json.dumps(value_for(schema, number)), (), reasoning)
    if fmt.get("type") == "json_object":
        return Answer(json.dumps({"answer": number if number is not None else _plain(prompt, None)}), (), reasoning)
    return Answer(_plain(prompt, arithmetic), (), reasoning)
