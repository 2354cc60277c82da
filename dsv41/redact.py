"""Removes secrets from text that leaves a machine (dsv41ctl bundle): PEM private key blocks, and
given secret strings such as the SGLang API key."""

from __future__ import annotations

import re
from typing import Iterable

_PEM_KEY = re.compile(rb"-----BEGIN ([A-Z0-9 ]*)PRIVATE KEY-----.*?(-----END \1PRIVATE KEY-----|\Z)", re.DOTALL)
REDACTED = b"[redacted]"
MIN_SECRET = 8  # shorter strings would turn ordinary words into "[redacted]"; keys are long


class Redactor:
    def __init__(self, secrets: Iterable[bytes | str] = ()):
        raw = {s.encode() if isinstance(s, str) else s for s in secrets}
        self._secrets = sorted((s for s in raw if len(s) >= MIN_SECRET), key=len, reverse=True)

    def __call__(self, data: bytes) -> bytes:
        data = _PEM_KEY.sub(lambda m: b"-----BEGIN " + m.group(1) + b"PRIVATE KEY----- " + REDACTED, data)
        for secret in self._secrets:
            data = data.replace(secret, REDACTED)
        return data
