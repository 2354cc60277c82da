"""One rank-side setting as both sides read it: its name, type, default, allowed values and help
(standard library only).

The rank's adapters read their variables through `Setting.read` (or the env_* helpers); a bad value
raises SettingError with the key, the value and what is allowed, and only that adapter stays out.
The coordinator derives each setting's cluster.env key (parser, default, help) from the same record
(coordinator/schema.py), so `dsv41ctl config check` refuses what the rank would refuse.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


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


def env_float(env: Mapping[str, str], key: str, default: float, minimum: float, maximum: float,
              minimum_open: bool = False, maximum_open: bool = False) -> float:
    raw = env.get(key, "").strip()
    if not raw:
        return default
    allowed = f"{'(' if minimum_open else '['}{_number(minimum)}, {_number(maximum)}{')' if maximum_open else ']'}"
    try:
        value = float(raw)
    except ValueError:
        raise SettingError(f"{key}={raw!r}: expected a number in {allowed}") from None
    above = minimum < value if minimum_open else minimum <= value
    below = value < maximum if maximum_open else value <= maximum
    if not (above and below):  # (NaN too)
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


class Kind(enum.Enum):
    FLAG = "flag"  # 1/0 (also true/false, yes/no, on/off)
    INTEGER = "integer"  # in [low, high]
    REAL = "real"  # in [low, high], either end open
    CHOICE = "choice"  # one of `choices`
    PATH = "path"  # an absolute path
    TEXT = "text"  # read as written
    VERIFY_CAP = "verify cap"  # 0 or conf:<T>, 0 < T <= 1 (the verify_cap adapter parses it)
    REASONING_EFFORT = "reasoning effort"  # 1-100 or a tier name (the reasoning_effort adapter parses it)


@dataclass(frozen=True)
class Setting:
    """One variable of the rank's environment that an adapter reads."""
    name: str
    kind: Kind
    default: str  # cluster.env's default: what every rank the coordinator starts is given
    help: str
    low: float = 0
    high: float = 0
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] = ()
    # What the rank takes when its environment lacks the variable (a rank not started by dsv41),
    # where that is not `default`: the opt-in decode adapters are then off, so such a rank runs
    # SGLang's own numerics.
    absent: str | None = None
    in_cluster_env: bool = True  # False: set by the coordinator's plan or by SGLang's own settings

    @property
    def when_absent(self) -> str:
        return self.default if self.absent is None else self.absent

    def read(self, env: Mapping[str, str]) -> object:
        """The typed value (bool, int, float or str); an empty variable reads as absent."""
        source = env if env.get(self.name, "").strip() else {self.name: self.when_absent}
        if self.kind is Kind.FLAG:
            return env_flag(source, self.name, False)
        if self.kind is Kind.INTEGER:
            return env_int(source, self.name, 0, int(self.low), int(self.high))
        if self.kind is Kind.REAL:
            return env_float(source, self.name, 0.0, self.low, self.high, self.low_open, self.high_open)
        if self.kind is Kind.CHOICE:
            return env_choice(source, self.name, "", self.choices)
        value = source.get(self.name, "").strip()
        if self.kind is Kind.PATH and value and not value.startswith("/"):
            raise SettingError(f"{self.name}={value!r}: expected an absolute path")
        return value
