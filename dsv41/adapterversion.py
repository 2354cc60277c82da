"""Which adapter version is installed, and which one a rank unit was started with.

A rank loads the adapter's files (ADAPTER_DIR) once, at its start; an upgrade of dsv41-adapter
restarts the agent, which re-adopts the running rank without restarting it. So the version a run
loaded is recorded on its unit (LogExtraFields DSV41_ADAPTER_VERSION, beside the plan's
fingerprint: it survives the agent's restarts and never enters the plan) and compared with the
version installed now, read from the installed adapter's own dsv41/version.py (the file the next
start loads, whatever installed it) rather than from dpkg. Standard library only: the agent and the
coordinator (which renders the comparison) share it.
"""

from __future__ import annotations

import ast
import os
import re
import threading
from typing import Iterable

ADAPTER_VERSION_FIELD = "DSV41_ADAPTER_VERSION"
_VERSION = re.compile(r"[0-9][A-Za-z0-9.+~:-]{0,63}")


def version_from_source(text: str) -> str:
    """VERSION = "x.y.z" from the text of a dsv41/version.py, without running it; "" when the text
    has no such assignment or the value is not a version (letters, digits and . + ~ : -)."""
    try:
        body = ast.parse(text).body
    except (SyntaxError, ValueError):
        return ""
    for node in body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "VERSION"
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            return node.value.value if _VERSION.fullmatch(node.value.value) else ""
    return ""


def adapter_stale(running: str, installed: str) -> bool:
    """The run loaded other adapter code than the next start would. Unknown on either side (a run
    started before agents recorded it, an adapter without a version file) is not stale: nothing
    says so."""
    return bool(running and installed and running != installed)


def adapter_version_field(version: str) -> list[str]:
    """The LogExtraFields entry that records a run's adapter version; none for an unknown one."""
    return [f"{ADAPTER_VERSION_FIELD}={version}"] if _VERSION.fullmatch(version) else []


def adapter_version_from_fields(fields: Iterable[bytes]) -> str:
    """The adapter version a rank unit was started with (its LogExtraFields); "" for a unit
    started before agents recorded it."""
    prefix = ADAPTER_VERSION_FIELD + "="
    for item in fields:
        text = bytes(item).decode(errors="replace")
        if text.startswith(prefix):
            return text[len(prefix):]
    return ""


class InstalledAdapter:
    """The version in <adapter_dir>/dsv41/version.py, read again when the file changes (an upgrade
    replaces it while the agent runs only until dpkg restarts the agent, but a hand install may not)."""

    def __init__(self, adapter_dir: str):
        self._path = os.path.join(adapter_dir, "dsv41", "version.py")
        self._lock = threading.Lock()
        self._last: tuple[tuple[int, int, int], str] | None = None  # ((inode, size, mtime ns), version)

    @property
    def path(self) -> str:
        return self._path

    def version(self) -> str:
        """"" when the file is missing or holds no version."""
        try:
            st = os.stat(self._path)
        except OSError:
            return ""
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:
            if self._last is not None and self._last[0] == key:
                return self._last[1]
        try:
            with open(self._path, encoding="utf-8", errors="replace") as f:
                value = version_from_source(f.read(65536))
        except OSError:
            return ""
        with self._lock:
            self._last = (key, value)
        return value
