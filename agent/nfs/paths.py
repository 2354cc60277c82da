"""Path rules for exports and mounts, systemd's unit-name escaping, symlink resolution. Pure
functions, except resolve_in(), which reads links under a given root."""

from __future__ import annotations

import os
import re

from .errors import Invalid

MAX_PATH = 1024
UNIT_NAME_MAX = 255  # systemd's UNIT_NAME_MAX (256) includes the terminating NUL
# One path component: no blanks, quotes, backslashes or '#', which the exports(5) and ganesha
# config syntaxes would need quoting for, and no ':' (it separates SERVER:/path in What=).
_COMPONENT = re.compile(r"[A-Za-z0-9._+@%=,~-]{1,255}")
# Never exported or mounted over: the system, the agent's own state, and whole homes.
_DENIED_EXACT = frozenset({
    "/", "/usr", "/usr/local", "/var", "/var/lib", "/var/cache", "/var/tmp", "/tmp", "/home", "/root",
    "/srv", "/mnt", "/media", "/opt", "/snap",
})
_DENIED_TREES = (
    "/etc", "/proc", "/sys", "/dev", "/boot", "/run", "/var/run", "/bin", "/sbin", "/lib", "/lib32",
    "/lib64", "/libx32", "/usr/bin", "/usr/sbin", "/usr/lib", "/usr/lib32", "/usr/lib64", "/usr/libexec",
    "/usr/include", "/usr/share", "/usr/src", "/var/lib/dsv41", "/var/cache/dsv41", "/var/lib/dpkg",
    "/var/lib/apt", "/var/lib/systemd", "/var/lib/nfs", "/var/log", "/var/spool", "/var/mail",
)
_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789:_.")


def check_path(path: str, what: str) -> str:
    """An absolute, normalized path of plain components that is not a system directory."""
    if not isinstance(path, str) or not path:
        raise Invalid(f"{what}: required (an absolute path)")
    if len(path) > MAX_PATH:
        raise Invalid(f"{what}: longer than {MAX_PATH} characters")
    if not path.startswith("/"):
        raise Invalid(f"{what} {path!r}: must be an absolute path")
    if path != "/":
        parts = path[1:].split("/")
        for part in parts:
            if part in ("", ".", ".."):
                raise Invalid(f"{what} {path!r}: must be normalized (no '//', trailing '/', '.' or '..')")
            if not _COMPONENT.fullmatch(part):
                raise Invalid(f"{what} {path!r}: component {part!r} may only use letters, digits and ._+@%=,~-")
    denied = path in _DENIED_EXACT or any(path == t or path.startswith(t + "/") for t in _DENIED_TREES)
    if denied or _whole_home(path) or ".ssh" in path.split("/"):
        raise Invalid(f"{what} {path!r}: refused: / , system directories, whole home directories and the agent's "
                      "own state are never exported or mounted over; use the model's own directory, e.g. "
                      "/var/tmp/DeepSeek-V4.1-Flash")
    return path


def _whole_home(path: str) -> bool:
    parts = path.split("/")
    return len(parts) == 3 and parts[1] == "home"


def unit_name_for_path(path: str, suffix: str = ".mount") -> str:
    """systemd's name for the unit of a path (`systemd-escape --path --suffix=mount`)."""
    trimmed = path.strip("/")
    if not trimmed:
        return "-" + suffix
    out = []
    for i, byte in enumerate(trimmed.encode("utf-8")):
        ch = chr(byte)
        if ch == "/":
            out.append("-")
        elif (i == 0 and ch == ".") or ch not in _SAFE:
            out.append(f"\\x{byte:02x}")
        else:
            out.append(ch)
    return "".join(out) + suffix


def check_unit_path(path: str, what: str) -> str:
    """check_path() plus: the unit named after it fits systemd's limit."""
    check_path(path, what)
    if len(unit_name_for_path(path)) > UNIT_NAME_MAX:
        raise Invalid(f"{what} {path!r}: too long for a systemd mount unit name ({UNIT_NAME_MAX} characters "
                      "after escaping)")
    return path


def resolve_in(root: str, path: str, max_links: int = 40) -> str:
    """The path with every symlink resolved as seen from `root` (like a chroot; absolute link
    targets restart at `root`). Components that do not exist are kept as they are."""
    parts = [p for p in path.split("/") if p]
    done: list[str] = []
    links = 0
    while parts:
        part = parts.pop(0)
        if part == ".":
            continue
        if part == "..":
            if done:
                done.pop()
            continue
        candidate = "/" + "/".join(done + [part])
        try:
            target = os.readlink(os.path.join(root, candidate.lstrip("/")) if root != "/" else candidate)
        except OSError:  # not a link, or not there
            done.append(part)
            continue
        links += 1
        if links > max_links:
            raise Invalid(f"{path!r}: too many levels of symbolic links")
        if target.startswith("/"):
            done = []
        parts = [p for p in target.split("/") if p] + parts
    return "/" + "/".join(done)
