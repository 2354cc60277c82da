"""Typed reading of the DSV41_* / SGLANG_* variables that switch the adapters.

Every adapter reads its own keys through these helpers; a bad value raises SettingError with the
key, the value and what is allowed, and only that adapter stays out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class SettingError(ValueError):
    """A variable has a value the adapter cannot use."""


def env_flag(env: Mapping[str, str], key: str, default: bool) -> bool:
    raw = env.get(key, "").strip()
    if not raw:
        return default
    low = raw.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise SettingError(f"{key}={raw!r}: expected 1 or 0 (also true/false, yes/no, on/off)")


def env_int(env: Mapping[str, str], key: str, default: int, minimum: int, maximum: int) -> int:
    raw = env.get(key, "").strip()
    if not raw:
        return default
    try:
        value = int(raw, 10)
    except ValueError:
        raise SettingError(f"{key}={raw!r}: expected an integer in [{minimum}, {maximum}]") from None
    if not minimum <= value <= maximum:
        raise SettingError(f"{key}={value}: outside the allowed range [{minimum}, {maximum}]")
    return value


def env_float(env: Mapping[str, str], key: str, default: float, minimum: float, maximum: float) -> float:
    raw = env.get(key, "").strip()
    if not raw:
        return default
    allowed = f"[{_number(minimum)}, {_number(maximum)}]"
    try:
        value = float(raw)
    except ValueError:
        raise SettingError(f"{key}={raw!r}: expected a number in {allowed}") from None
    if not minimum <= value <= maximum:  # (NaN too)
        raise SettingError(f"{key}={raw!r}: outside the allowed range {allowed}")
    return value


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def env_choice(env: Mapping[str, str], key: str, default: str, allowed: Sequence[str]) -> str:
    raw = env.get(key, "").strip()
    if not raw:
        return default
    value = raw.lower()
    if value not in allowed:
        raise SettingError(f"{key}={raw!r}: expected one of {', '.join(allowed)}")
    return value
