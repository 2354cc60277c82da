"""Whether a path the rank is told to use can only have been written by root.

The rank runs as root and loads code from what it is shown: Python from the model directory
(--trust-remote-code), libraries from LD_LIBRARY_PATH, byte code from its cache. A directory a
user owns, or one that group or other may write, anywhere along such a path, hands that user root
on the node. Every component is checked as the host sees it (PID 1's root, not the agent's private
/tmp), symbolic links too (a link is followed only when root owns it). A world-writable directory
with the sticky bit (/var/tmp) is accepted above data, as long as what is below it belongs to root:
nobody else can rename or replace it. Code accepts no such directory at all.

Mounts the agent made itself (the weights' NFS mount) are not walked into: a stale server would
block the walk, and what they hold was checked where it is exported.
"""

from __future__ import annotations

import os
import posixpath
import stat
from dataclasses import dataclass
from typing import Callable, Iterable

MAX_LINKS = 40


@dataclass(frozen=True)
class PathUse:
    path: str  # absolute, as the host sees it
    what: str  # what the rank uses it for, for the message: "bind source", "env LD_LIBRARY_PATH entry"
    code: bool = False  # code is loaded from it: no world-writable directory above it, sticky or not
    must_exist: bool = True


def _fix(component: str, st: os.stat_result, code: bool, owner: int = 0) -> str:
    fixes = []
    if st.st_uid != owner:
        fixes.append(f"chown root {component}")
    if st.st_mode & 0o022:
        fixes.append(f"chmod go-w {component}")
    if not fixes:  # a sticky directory above code
        return f"move it out of {component}"
    return "run `" + "; ".join(fixes) + "`" + (", or move it to a directory only root can write" if code else "")


def component_problem(st: os.stat_result, last: bool, code: bool, owner: int = 0) -> str | None:
    """Why one path component (its lstat) lets someone other than `owner` (root) change what lies
    below it, or None. Pure."""
    if st.st_uid != owner:
        return f"owned by uid {st.st_uid}, not root"
    writable = st.st_mode & 0o022
    if not writable:
        return None
    sticky_dir = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
    if sticky_dir and not last and not code:
        return None  # like /var/tmp: others may add entries but not replace root's
    return f"writable by {'group and other' if writable == 0o022 else 'group' if writable & 0o020 else 'other'}" \
        f" (mode {stat.S_IMODE(st.st_mode):04o})"


class PathTrust:
    """Checks PathUses against the host's file system, seen through `view_root`."""

    def __init__(self, view_root: str = "/", vouched: Callable[[], Iterable[str]] = tuple, owner: int = 0):
        self._view = view_root.rstrip("/")
        self._vouched = vouched  # mount points the agent made; their content is not walked
        self._owner = owner  # root; a test over its own files passes its uid

    def _host(self, path: str) -> str:
        return (self._view + path) if self._view else path

    def problem(self, use: PathUse) -> str | None:
        """None when only root can have written `use.path`; otherwise what is wrong and the fix."""
        vouched = tuple(self._vouched())
        todo = [p for p in use.path.split("/") if p]
        done: list[str] = []
        links = 0
        try:
            st = os.stat(self._host("/") if self._view else "/")
        except OSError as exc:
            return f"{use.what} {use.path}: cannot read /: {exc.strerror}"
        why = component_problem(st, not todo, use.code, self._owner)
        if why:
            return f"{use.what} {use.path}: / is {why}"
        while todo:
            name = todo.pop(0)
            if name == ".":
                continue
            if name == "..":
                if done:
                    done.pop()
                continue
            current = "/" + "/".join(done + [name])
            if any(current == v for v in vouched):
                return None  # the agent's own mount (nosuid, nodev, read-only, from an allowed server)
            try:
                st = os.lstat(self._host(current))
            except FileNotFoundError:
                if use.must_exist:
                    return f"{use.what} {use.path}: {current} does not exist"
                parent = "/" + "/".join(done)
                # Whoever may create the missing directory decides what goes in it.
                try:
                    pst = os.stat(self._host(parent))
                except OSError as exc:
                    return f"{use.what} {use.path}: cannot read {parent}: {exc.strerror}"
                why = component_problem(pst, True, True, self._owner)
                if why:
                    return (f"{use.what} {use.path}: {current} does not exist and {parent} is {why}: anyone could "
                            f"create it first; create it as root (mkdir -m 0755 {current})")
                return None
            except OSError as exc:
                return f"{use.what} {use.path}: cannot read {current}: {exc.strerror}"
            if stat.S_ISLNK(st.st_mode):
                if st.st_uid != self._owner:
                    return (f"{use.what} {use.path}: {current} is a symbolic link owned by uid {st.st_uid}: whoever "
                            f"owns it decides where it points; replace it with the real path")
                links += 1
                if links > MAX_LINKS:
                    return f"{use.what} {use.path}: too many levels of symbolic links"
                target = os.readlink(self._host(current))
                if target.startswith("/"):
                    done = []
                todo = [p for p in target.split("/") if p] + todo
                continue
            why = component_problem(st, not todo, use.code, self._owner)
            if why:
                return (f"{use.what} {use.path}: {current} is {why}: whoever can write there can run code as root "
                        f"in the rank; {_fix(current, st, use.code, self._owner)}")
            done.append(name)
        return None

    def shadow_problem(self, target: str) -> str | None:
        """None when nothing of the host's is at `target` (a bind target, or a path outside the
        rank's roots it is told about): it does not exist, or it is an empty directory or file of
        root's (the mount point a previous start left behind)."""
        host = self._host(target)
        try:
            st = os.lstat(host)
        except FileNotFoundError:
            return None
        except OSError as exc:
            return f"bind target {target}: cannot read it: {exc.strerror}"
        empty = (stat.S_ISDIR(st.st_mode) and not os.listdir(host)) or (stat.S_ISREG(st.st_mode) and not st.st_size)
        if st.st_uid == self._owner and empty:
            return None
        return (f"{target}: the rank is shown this path, which exists on this node outside ALLOWED_PATHS: a bind "
                "onto it would hide the node's own files, and what is there is not the rank's to read; choose a "
                "path that does not exist (e.g. /engram), or add its directory to ALLOWED_PATHS")

    def problems(self, uses: Iterable[PathUse]) -> list[str]:
        seen: set[tuple[str, bool]] = set()
        out = []
        for use in uses:
            key = (posixpath.normpath(use.path), use.code)
            if key in seen:
                continue
            seen.add(key)
            why = self.problem(use)
            if why:
                out.append(why)
        return out
