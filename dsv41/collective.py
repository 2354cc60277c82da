"""The collective bandwidth gate's contract: what the job (adapter/collective_bench.py, in the
rank's runtime) prints, how its figures are computed, how NCCL's transport is read from NCCL's own
INFO lines, and the floor decision the coordinator takes. Standard library only: the job imports it
from the rank's PYTHONPATH, the agent and the coordinator from theirs.

Bus bandwidth is nccl-tests' definition for all-reduce: algbw = bytes / time, and
busbw = algbw * 2(n-1)/n, so that figures of groups of different sizes compare with the link's
speed. The job prints exactly one line starting with RESULT_PREFIX, followed by JSON.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

RESULT_PREFIX = "DSV41_COLLECTIVE_RESULT "
GROUP = "all"  # the name of the whole group's figure
BACKENDS = ("nccl", "gloo")
GB = 1e9  # figures are in GB/s (10^9 bytes), as nccl-tests prints them


def bus_bandwidth_gbps(nbytes: int, seconds: float, ranks: int) -> float:
    """nccl-tests' all-reduce bus bandwidth in GB/s for `nbytes` reduced among `ranks` in `seconds`
    (the mean of the timed iterations, warm-up excluded)."""
    if seconds <= 0 or ranks < 2:
        raise ValueError(f"busbw needs a positive time and at least 2 ranks, not {seconds} s and {ranks}")
    return nbytes / seconds * 2 * (ranks - 1) / ranks / GB


def pair_name(a: str, b: str) -> str:
    """A pair as status, metrics and the failure name it: the two nodes in rank order."""
    return f"{a}–{b}"


@dataclass(frozen=True)
class Figure:
    group: str  # pair_name(...) or GROUP
    nodes: tuple[str, ...]
    nbytes: int
    seconds: float  # mean time of one all-reduce
    busbw_gbps: float


@dataclass(frozen=True)
class Result:
    """The job's one line: its figures, the backend it ran and the transport NCCL chose ("" for
    gloo, or when NCCL's INFO lines did not say)."""
    backend: str
    transport: str
    figures: tuple[Figure, ...] = field(default=())

    def to_line(self) -> str:
        return RESULT_PREFIX + json.dumps(asdict(self), separators=(",", ":"))


def parse_result_line(lines: list[str]) -> Result | None:
    """The last result line among `lines` (a job's log), or None when it printed none."""
    for line in reversed(lines):
        at = line.find(RESULT_PREFIX)
        if at < 0:
            continue
        data = json.loads(line[at + len(RESULT_PREFIX):])
        figures = tuple(Figure(str(f["group"]), tuple(f["nodes"]), int(f["nbytes"]), float(f["seconds"]),
                               float(f["busbw_gbps"])) for f in data.get("figures", ()))
        return Result(str(data["backend"]), str(data.get("transport", "")), figures)
    return None


# ------------------------------------------------------------------ NCCL's transport

# NCCL_DEBUG=INFO prints, for every channel it connects, e.g.
#   "NCCL INFO Channel 00/0 : 0[0] -> 1[1] [send] via NET/IB/0/GDRDMA"
#   "NCCL INFO Channel 00/0 : 1[1] -> 0[0] [receive] via NET/Socket/0"
#   "NCCL INFO Channel 00 : 0[0] -> 1[1] via P2P/IPC"   "... via SHM/direct/direct"
_VIA = re.compile(r"NCCL INFO .*\bvia (NET/[A-Za-z0-9_]+|P2P|SHM|COLLNET|NVLS)\b")
_ORDER = ("NET/Socket",)  # a socket anywhere is what the gate must see, whatever else was chosen


def nccl_transports(lines: list[str]) -> tuple[str, ...]:
    """The transports NCCL's INFO lines say it connected channels over, in first-seen order
    (NET/IB, NET/Socket, P2P, SHM, ...)."""
    seen: dict[str, None] = {}
    for line in lines:
        match = _VIA.search(line)
        if match:
            seen.setdefault(match.group(1), None)
    return tuple(seen)


def inter_node_transport(lines: list[str]) -> str:
    """The transport between the nodes: the NET/ one NCCL chose (NET/Socket if any channel fell
    back to sockets), "" when the lines name none (one node, or NCCL_DEBUG not at INFO)."""
    nets = [t for t in nccl_transports(lines) if t.startswith("NET/")]
    for worst in _ORDER:
        if worst in nets:
            return worst
    return nets[0] if nets else ""


# ------------------------------------------------------------------ the gate's decision

@dataclass(frozen=True)
class Floors:
    pair_gbps: float
    group_gbps: float
    transport: str = ""  # the transport NCCL must choose ("NET/IB" on the Sparks), "" for any


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str  # the failure, naming the slowest figure below its floor; "" when ok
    slowest: Figure | None = None


def judge(result: Result, floors: Floors) -> Verdict:
    """The gate's decision over the figures every node agreed on: the slowest pair below the pair
    floor fails it first (it names the link to look at), then the group below its floor, then a
    transport other than the required one."""
    pairs = sorted((f for f in result.figures if f.group != GROUP), key=lambda f: f.busbw_gbps)
    if pairs and pairs[0].busbw_gbps < floors.pair_gbps:
        slow = pairs[0]
        return Verdict(False, f"{slow.group}: {slow.busbw_gbps:.2f} GB/s, floor {floors.pair_gbps:g} GB/s "
                              f"(COLLECTIVE_PAIR_MIN_GBPS)", slow)
    group = next((f for f in result.figures if f.group == GROUP), None)
    if group is not None and group.busbw_gbps < floors.group_gbps:
        return Verdict(False, f"all {len(group.nodes)} nodes: {group.busbw_gbps:.2f} GB/s, floor "
                              f"{floors.group_gbps:g} GB/s (COLLECTIVE_GROUP_MIN_GBPS)", group)
    if floors.transport and result.backend == "nccl" and result.transport != floors.transport:
        return Verdict(False, f"NCCL chose {result.transport or 'no network transport'}, not {floors.transport}: "
                              "check the HCAs, NCCL_IB_HCA and the GID index (NCCL_DEBUG=INFO in the job's log)")
    return Verdict(True, "")


def summary(result: Result) -> str:
    """One line of every figure, as the journal and dsv41ctl show them."""
    figures = ", ".join(f"{f.group} {f.busbw_gbps:.2f} GB/s" for f in result.figures)
    via = f" via {result.transport}" if result.transport else ""
    return f"{result.backend}{via}: {figures}"
