"""Replacing SGLang's API keys wherever SGLang shows its server arguments. Standard library only:
the stand-in engine (sim/) applies the same function where SGLang would show the key."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

SECRET_FIELDS = ("api_key", "admin_api_key")
REDACTED = "<redacted>"


def redact_secrets(value: Any) -> Any:
    """`value` with every api_key/admin_api_key that is set replaced by "<redacted>", at any depth
    of dicts, lists and tuples and in dataclass records (copied, never changed in place)."""
    if isinstance(value, dict):
        return {k: (REDACTED if k in SECRET_FIELDS and v is not None else redact_secrets(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_secrets(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(redact_secrets(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = [f.name for f in dataclasses.fields(value)
                 if f.name in SECRET_FIELDS and getattr(value, f.name, None) is not None]
        if names:
            out = copy.copy(value)
            for name in names:
                object.__setattr__(out, name, REDACTED)  # sealed records too, as SGLang's own redaction does
            return out
    return value

