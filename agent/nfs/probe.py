"""The mount health check, run as a short-lived child: `python3 -m agent.nfs.probe PATH SHARDS`.

A stat or read on a stale NFS mount (or a wedged FUSE file system) may never return, and a
process blocked there cannot even be killed: so this runs in its own process, never in the
agent. It announces each step on stdout before taking it ("step list"), so the agent can say
where it got stuck, and ends with one "result {json}" line. Standard library only: it must
start fast and small.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import sys

SHARD = re.compile(r"model-(\d{1,6})-of-(\d{1,6})\.safetensors")
MAX_CONFIG = 4 << 20
LIST_LIMIT = 1_000_000
KEEP = 5


def _step(name: str) -> None:
    sys.stdout.write(f"step {name}\n")
    sys.stdout.flush()


def _oserror(step: str, exc: OSError) -> dict:
    return {"step": step, "errno": errno.errorcode.get(exc.errno or 0, str(exc.errno)), "message": exc.strerror or ""}


def _shard_problem(path: str) -> str | None:
    """None when the file starts like a safetensors file: an u64 header length, then '{'."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(9)
    if len(head) < 9:
        return f"{size} bytes: too short for a safetensors file"
    length = int.from_bytes(head[:8], "little")
    if not 2 <= length <= size - 8 or head[8:9] != b"{":
        return f"not a safetensors file (header length {length} in a {size}-byte file)"
    return None


def check(path: str, expected: int) -> dict:
    result: dict = {"error": None, "entries": 0, "config": None, "totals": {}, "seen": 0, "missing": [], "bad": [],
                    "sample": []}
    _step("stat")
    try:
        st = os.stat(path)
    except OSError as exc:
        result["error"] = _oserror("stat", exc)
        return result
    if not stat.S_ISDIR(st.st_mode):
        result["error"] = {"step": "stat", "errno": "ENOTDIR", "message": "not a directory"}
        return result
    _step("list")
    try:
        names = []
        with os.scandir(path) as it:
            for entry in it:
                names.append(entry.name)
                if len(names) >= LIST_LIMIT:
                    break
    except OSError as exc:
        result["error"] = _oserror("list", exc)
        return result
    names.sort()
    result["entries"] = len(names)
    result["sample"] = names[:8]
    _step("config")
    try:
        with open(os.path.join(path, "config.json"), "rb") as f:
            raw = f.read(MAX_CONFIG + 1)
        if len(raw) > MAX_CONFIG:
            result["config"] = {"invalid": f"larger than {MAX_CONFIG} bytes"}
        else:
            json.loads(raw)
            result["config"] = {"ok": True}
    except OSError as exc:
        result["config"] = _oserror("config", exc)
    except ValueError as exc:
        result["config"] = {"invalid": f"not valid JSON ({exc})"}
    _step("shards")
    totals: dict[int, set[int]] = {}
    wanted: dict[int, str] = {}
    for name in names:
        m = SHARD.fullmatch(name)
        if not m:
            continue
        index, total = int(m.group(1)), int(m.group(2))
        totals.setdefault(total, set()).add(index)
        if total == expected and 1 <= index <= expected:
            wanted[index] = name
    result["totals"] = {str(t): len(indices) for t, indices in sorted(totals.items())}
    result["seen"] = len(wanted)
    result["missing"] = [i for i in range(1, expected + 1) if i not in wanted][:KEEP]
    for index in sorted(wanted):
        try:
            problem = _shard_problem(os.path.join(path, wanted[index]))
        except OSError as exc:
            problem = None
            result["bad"].append({"name": wanted[index], **_oserror("shard", exc)})
        if problem:
            result["bad"].append({"name": wanted[index], "problem": problem})
        if len(result["bad"]) >= KEEP:
            break
    return result


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[1].isdigit():
        sys.stderr.write("usage: python3 -m agent.nfs.probe PATH EXPECTED_SHARDS\n")
        return 2
    result = check(argv[0], int(argv[1]))
    sys.stdout.write("result " + json.dumps(result, sort_keys=True) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
