"""Reads the recipe's `.env` format: the subset of shell that `set -a; source .env` understands.

Supported, because the existing cluster.env files use it: comments, blank lines, `KEY=VALUE`,
an optional `export ` prefix, double-quoted values (with `\\"`, `\\\\`, `\\$` escapes), single-quoted
literal values, trailing `# comments` after whitespace, and `$NAME` / `${NAME}` / `${NAME:-default}`
expansion from keys defined earlier in the file, then from the given environment.
Anything else (command substitution, arrays, unterminated quotes) is an error with its line,
never a silent guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BRACED = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


@dataclass(frozen=True)
class Entry:
    key: str
    value: str
    line: int
    from_environ: tuple[str, ...] = ()  # names the value expanded from the environment, not the file


@dataclass(frozen=True)
class ParseError:
    line: int
    key: str | None
    message: str


class _Syntax(Exception):
    pass


def parse(text: str, environ: Mapping[str, str]) -> tuple[list[Entry], list[ParseError]]:
    """Returns the entries in file order and every error found (never stops at the first)."""
    entries: list[Entry] = []
    errors: list[ParseError] = []
    seen: dict[str, int] = {}
    defined: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export "):].lstrip()
        match = _KEY.match(line)
        if not match or line[match.end():match.end() + 1] != "=":
            errors.append(ParseError(number, None, f"expected KEY=VALUE, got {raw.strip()!r}"))
            continue
        key = match.group(0)
        used: list[str] = []
        try:
            value = _value(line[match.end() + 1:], defined, _Recording(environ, used))
        except _Syntax as exc:
            errors.append(ParseError(number, key, str(exc)))
            continue
        if key in seen:
            errors.append(ParseError(number, key, f"defined twice (first on line {seen[key]}); keep one"))
            continue
        seen[key] = number
        defined[key] = value
        entries.append(Entry(key, value, number, tuple(dict.fromkeys(used))))
    return entries, errors


class _Recording(Mapping[str, str]):
    """The environment, noting each name a value took from it."""

    def __init__(self, environ: Mapping[str, str], used: list[str]):
        self._environ, self._used = environ, used

    def __getitem__(self, name: str) -> str:
        value = self._environ[name]
        self._used.append(name)
        return value

    def __contains__(self, name: object) -> bool:
        return name in self._environ

    def __iter__(self):
        return iter(self._environ)

    def __len__(self) -> int:
        return len(self._environ)


def _value(text: str, defined: Mapping[str, str], environ: Mapping[str, str]) -> str:
    out: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch in " \t":
            rest = text[i:].lstrip()
            if rest and not rest.startswith("#"):
                raise _Syntax("unquoted whitespace in value: quote the whole value, e.g. KEY=\"a b\"")
            break
        if ch == "'":
            end = text.find("'", i + 1)
            if end < 0:
                raise _Syntax("unterminated single quote")
            out.append(text[i + 1:end])
            i = end + 1
        elif ch == '"':
            i = _double_quoted(text, i + 1, out, defined, environ)
        elif ch == "\\":
            if i + 1 >= len(text):
                raise _Syntax("trailing backslash (line continuations are not supported)")
            out.append(text[i + 1])
            i += 2
        elif ch == "$":
            i = _expand(text, i, out, defined, environ)
        elif ch in "`;|&<>()":
            raise _Syntax(f"shell syntax {ch!r} is not supported in a value; quote it")
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _double_quoted(text: str, i: int, out: list[str], defined: Mapping[str, str],
                   environ: Mapping[str, str]) -> int:
    while i < len(text):
        ch = text[i]
        if ch == '"':
            return i + 1
        if ch == "\\" and i + 1 < len(text) and text[i + 1] in '"\\$`':
            out.append(text[i + 1])
            i += 2
        elif ch == "$":
            i = _expand(text, i, out, defined, environ)
        elif ch == "`":
            raise _Syntax("command substitution is not supported")
        else:
            out.append(ch)
            i += 1
    raise _Syntax("unterminated double quote")


def _expand(text: str, i: int, out: list[str], defined: Mapping[str, str],
            environ: Mapping[str, str]) -> int:
    """Expands the reference starting at text[i] == '$'; returns the index after it."""
    rest = text[i + 1:]
    if rest.startswith("("):
        raise _Syntax("command substitution $(...) is not supported")
    braced = _BRACED.match(rest)
    if braced:
        name, default = braced.group(1), braced.group(2)
        consumed = braced.end()
    elif rest.startswith("{"):
        raise _Syntax("only ${NAME} and ${NAME:-default} expansions are supported")
    else:
        plain = _KEY.match(rest)
        if not plain:
            out.append("$")
            return i + 1
        name, default, consumed = plain.group(0), None, plain.end()
    if name in defined:
        value = defined[name]
    elif name in environ:
        value = environ[name]
    elif default is not None:
        value = default
    else:
        raise _Syntax(f"${name} is not defined earlier in the file or in the environment")
    if default is not None and value == "":
        value = default
    out.append(value)
    return i + 1 + consumed
