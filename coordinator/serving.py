"""Health and smoke checks against rank 0's OpenAI-compatible HTTP API (stdlib HTTP only).

A worker's own /health proves nothing (it always answers 200); only rank 0's counts, and a
real completion is the proof: 19+23 must come back as 42 with finish_reason "stop".
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from dataclasses import dataclass

from .parallel import on_each


@dataclass(frozen=True)
class CheckResult:
    ok: bool
    detail: str


def _request(url: str, body: dict | None, timeout: float, api_key: str | None = None) -> tuple[int, dict | str]:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=data, headers=headers, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode(errors="replace")
            status = response.status
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")[:500]
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text[:500]


# SGLang's /health answers 503 after 20 s without a generation; a hung TP group shows as a client
# timeout, so waiting longer for one answer learns nothing more.
HEALTH_TIMEOUT_S = 20.0


def health(base: str, timeout: float = HEALTH_TIMEOUT_S) -> CheckResult:
    try:
        status, body = _request(f"{base}/health", None, timeout)
    except (OSError, urllib.error.URLError) as exc:
        return CheckResult(False, f"{base}/health: {getattr(exc, 'reason', exc)}")
    return CheckResult(status == 200, f"{base}/health answered {status}")


def _chat(base: str, model: str, messages: list, timeout: float, api_key: str | None = None, **extra) -> dict:
    body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": extra.pop("max_tokens", 64),
            **extra}
    status, reply = _request(f"{base}/v1/chat/completions", body, timeout, api_key)
    if status != 200 or not isinstance(reply, dict):
        raise SmokeFailed(f"/v1/chat/completions answered {status}: {str(reply)[:200]}")
    return reply


class SmokeFailed(Exception):
    pass


def _choice(reply: dict) -> tuple[dict, str]:
    try:
        choice = reply["choices"][0]
        return choice["message"], choice.get("finish_reason") or ""
    except (KeyError, IndexError, TypeError):
        raise SmokeFailed(f"malformed completion: {str(reply)[:200]}") from None


def looks_like_garbage(text: str) -> str | None:
    """Why a reply looks like the NaN-logits failure (empty, replacement characters, one token
    repeated), or None when it reads like text."""
    stripped = text.strip()
    if not stripped:
        return "empty answer"
    if "\ufffd" in stripped:
        return "replacement characters in the answer"
    words = stripped.split()
    if len(words) >= 8 and len(set(words)) <= 2:
        return f"one word repeated: {words[0]!r}"
    letters = sum(ch.isalnum() for ch in stripped)
    if letters < len(stripped) * 0.4:
        return "mostly punctuation or symbols"
    return None


def requires_key(base: str, timeout: float) -> CheckResult:
    """With API_KEY_FILE set, rank 0 must refuse a request without the key: a rank that lost the
    key on its way (adapter not loaded, DSV41_API_KEY_FILE not reaching it) would otherwise serve
    everyone, and the smoke test, which sends the key, could not tell."""
    status, _ = _request(f"{base}/v1/models", None, timeout)
    if status == 401:
        return CheckResult(True, "requests without the API key are refused (401)")
    return CheckResult(False, f"{base}/v1/models answered {status} without the API key, expected 401: rank 0 "
                              "serves without authentication although API_KEY_FILE is set (is the adapter on "
                              "the rank's PYTHONPATH, and does DSV41_API_KEY_FILE reach rank 0?)")


def key_not_shown(base: str, timeout: float, api_key: str) -> CheckResult:
    """SGLang answers /server_info and /get_server_info with its server args, the key in clear,
    unless the adapter redacts it: a rank without the adapter would hand the key to anyone who
    reads those routes (dashboards, proxies, logs of clients)."""
    for route in ("/server_info", "/get_server_info"):
        status, body = _request(f"{base}{route}", None, timeout, api_key)
        text = json.dumps(body) if isinstance(body, dict) else str(body)
        if api_key in text:
            return CheckResult(False, f"{base}{route} answers with the API key in clear (status {status}): rank 0 "
                                      "runs without the adapter's redaction (is the adapter on its PYTHONPATH?)")
    return CheckResult(True, "the API key is not in /server_info")


def smoke(base: str, model: str, quick: bool, batch: int, timeout: float, api_key: str | None = None) -> CheckResult:
    try:
        if api_key:
            guarded = requires_key(base, timeout)
            if not guarded.ok:
                return guarded
            hidden = key_not_shown(base, timeout, api_key)
            if not hidden.ok:
                return hidden
        message, finish = _choice(_chat(base, model, [{"role": "user", "content": "What is 19+23? Answer with the "
                                                        "number only."}], timeout, api_key))
        content = str(message.get("content") or "")
        if not re.search(r"(?<!\d)42(?!\d)", content) or finish != "stop":
            return CheckResult(False, f"19+23 came back as {content[:80]!r} (finish_reason {finish!r}); expected 42, stop")
        if quick:
            return CheckResult(True, "19+23 = 42")
        schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
        message, _ = _choice(_chat(base, model, [{"role": "user", "content": "Give 19+23 as JSON."}], timeout,
                                   api_key, response_format={"type": "json_schema",
                                                             "json_schema": {"name": "sum", "schema": schema}}))
        try:
            parsed = json.loads(message.get("content") or "")
            if not isinstance(parsed, dict) or not isinstance(parsed.get("answer"), int):
                raise ValueError
        except ValueError:
            return CheckResult(False, f"JSON-schema answer is not valid: {str(message.get('content'))[:80]!r}")
        tool = {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                                 "parameters": {"type": "object", "properties": {
                                                     "a": {"type": "integer"}, "b": {"type": "integer"}},
                                                     "required": ["a", "b"]}}}
        message, finish = _choice(_chat(base, model, [{"role": "user", "content": "Use the add tool for 19+23."}],
                                        timeout, api_key, tools=[tool]))
        calls = message.get("tool_calls") or []
        if not calls or calls[0].get("function", {}).get("name") != "add":
            return CheckResult(False, f"no tool call in the answer (finish_reason {finish!r})")
        prompts = [f"Write one sentence about the number {n}." for n in range(batch)]
        replies = on_each(lambda p: _chat(base, model, [{"role": "user", "content": p}], timeout, api_key), prompts)
        for prompt, reply in replies.items():
            text = str(_choice(reply)[0].get("content") or "")
            why = looks_like_garbage(text)
            if why:
                return CheckResult(False, f"batch of {batch}: {why} for {prompt!r}: {text[:80]!r}")
        return CheckResult(True, f"19+23 = 42, JSON schema, tool call, batch of {batch} readable")
    except SmokeFailed as exc:
        return CheckResult(False, str(exc))
    except (OSError, urllib.error.URLError) as exc:
        return CheckResult(False, f"{base}: {getattr(exc, 'reason', exc)}")
