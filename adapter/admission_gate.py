"""admission_gate: a new request's first prefill step waits while it would take the node below the guard.

The coordinator's guard sees a request only in a listing, and a prompt that arrives while a step
runs goes into the next step before any listing shows it. Its first step allocates at once: its
tokens' cost and the indexer's buffers over its whole prefix, which for a prefix-cache hit is the
cached prefix (up to a few hundred MB; bench/memory_guard's scenarios went up to 147 MB below the
guard that way). Only the scheduler can stop that, at admission: an AROUND hook on
`PrefillAdder.add_one_req` answers AddReqResult.OTHER, which ends this pass's admissions as any
other refusal does (the request and those behind it stay queued, in their order), when

    headroom - what this step already takes - the candidate's first piece < the guard

and something else is in flight (a step planned, a chunked request, decoding requests): memory
comes back when they end. With nothing in flight it waits too, though nothing will come back for
it: for the coordinator's guard, which looks at the waiting requests every few hundred ms, to
abort it before its first step takes the node below the guard at once (a prefix-cache hit's first
step spans its whole cached prefix). So that no request waits forever on a guard that is not
running, one alone waits at most DSV41_ADMISSION_LONE_WAIT_S (LONE_WAIT_S; 0 while the guard
only observes), then goes in. A request already being
chunk-prefilled is never held (SGLang's own rule: it keeps its slot across chunks).

With SGLang's KV pool (the scheduler's token_to_kv_pool_allocator) a piece's KV costs nothing
while the pool has slots that were used before and are free now: their pages are the process's
already (the pool never gives memory back). The gate counts those free slots as the high-water
mark of the slots in use it saw at each pass less the slots in use now, and charges KV only
beyond them.

Headroom is what the process can still take: the tighter of MemAvailable and the memory cgroup's
room (on GB10 host memory is GPU memory; on a discrete GPU the device's free memory), plus what
PyTorch's caching allocator holds free (reserved - allocated), taken as the minimum over the TP
group with one all-reduce on its CPU group (with it, whether a lone request's wait is over on any
rank), so that every rank makes the same decision: the ranks must schedule the same batch. One
measurement per scheduling pass, only when a request is up for admission. The rule and what a
piece costs are the guard's own (dsv41/admission.py, dsv41/cost.py: MEMORY_GUARD_TOKEN_BYTES and
MEMORY_GUARD_TRANSIENT_BYTES, or their defaults), passed by the coordinator with the guard level as
DSV41_ADMISSION_* when MEMORY_GUARD_ADMISSION=1; the stand-in (sim/engine.py) applies the same rule.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dsv41.admission import GateSettings, admits, pieces_bytes, step_bytes
from dsv41.adapterlog import AdapterLog
from adapter.patching import AROUND, AdapterSpec, Patch
from adapter.scheduler_requests import kv_in_use as scheduler_kv_in_use
from dsv41 import rankadapters

NAME = "admission_gate"
ENV_KEYS = rankadapters.BY_NAME[NAME].keys  # every variable build() reads, declared in dsv41
SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
POLICY_MODULE = "sglang.srt.managers.schedule_policy"
UNLIMITED = 1 << 62  # a cgroup without a limit, and a measurement that failed
def settings_from_env(env: Mapping[str, str]) -> GateSettings | None:
    """None when DSV41_ADMISSION_GUARD_BYTES is empty or 0 (the gate is off)."""
    guard = rankadapters.DSV41_ADMISSION_GUARD_BYTES.read(env)
    if guard == 0:
        return None
    return GateSettings(guard, rankadapters.DSV41_ADMISSION_TOKEN_BYTES.read(env),
                        rankadapters.DSV41_ADMISSION_TRANSIENT_BYTES.read(env),
                        rankadapters.DSV41_ADMISSION_LONE_WAIT_S.read(env))


def _field(text: bytes, name: bytes) -> int | None:
    """A /proc/meminfo field in bytes (its kB figure x 1024), None when absent."""
    for line in text.splitlines():
        if line.startswith(name):
            parts = line.split()
            return int(parts[1]) * 1024 if len(parts) >= 2 and parts[1].isdigit() else None
    return None


class NodeRoom:
    """What the node still lets this process take: the tighter of MemAvailable and the memory
    cgroup's room at the root of this process's view: v2's memory.max, else v1's memory controller
    (as the agent's sampler, agent/memory.py, reads them)."""

    def __init__(self, proc_root: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> None:
        self._meminfo = f"{proc_root}/meminfo"
        if os.path.exists(f"{cgroup_root}/memory.max") or os.path.exists(f"{cgroup_root}/cgroup.controllers"):
            self._limit, self._usage = f"{cgroup_root}/memory.max", f"{cgroup_root}/memory.current"
        else:
            self._limit = f"{cgroup_root}/memory/memory.limit_in_bytes"
            self._usage = f"{cgroup_root}/memory/memory.usage_in_bytes"

    def __call__(self) -> int:
        room = UNLIMITED
        try:
            with open(self._meminfo, "rb") as f:
                available = _field(f.read(), b"MemAvailable:")
            if available is not None:
                room = available
        except OSError:
            pass
        try:
            with open(self._limit, "rb") as f:
                limit = f.read().strip()
            if limit != b"max" and int(limit) < UNLIMITED:  # v1 says "no limit" as a huge number
                with open(self._usage, "rb") as f:
                    room = min(room, max(0, int(limit) - int(f.read().strip())))
        except (OSError, ValueError):
            pass
        return room


def _allocator_free(torch: Any, device: int) -> int:
    """What the caching allocator holds free (reserved - allocated). The nested statistics cost
    10 us on an H200 where memory_reserved() and memory_allocated(), each flattening them, cost
    120 us together (bench/results/admission_gate-h200.txt); the public call is the fallback."""
    try:
        stats = torch._C._cuda_memoryStats(device)
        reserved, allocated = stats["reserved_bytes"]["all"]["current"], stats["allocated_bytes"]["all"]["current"]
    except (AttributeError, KeyError, TypeError):
        flat = torch.cuda.memory_stats(device)
        reserved, allocated = flat.get("reserved_bytes.all.current", 0), flat.get("allocated_bytes.all.current", 0)
    return max(0, int(reserved) - int(allocated))


def torch_headroom(node_room: Callable[[], int]) -> int:
    """The node's room (integrated GPU) or the device's free memory (discrete), plus what the
    caching allocator holds free."""
    import torch

    if not torch.cuda.is_available():
        return node_room()
    device = torch.cuda.current_device()
    if getattr(torch.cuda.get_device_properties(device), "is_integrated", False):
        room = node_room()
    else:
        room = int(torch.cuda.mem_get_info(device)[0])
    return room + _allocator_free(torch, device)


def torch_group_min(scheduler: Any, values: tuple[int, ...]) -> tuple[int, ...]:
    """Each of `values` at its smallest over the scheduler's TP group (its gloo CPU group), in one
    all-reduce: every rank calls this at the same point of the same pass, since they schedule the
    same queue."""
    if int(getattr(scheduler, "tp_size", 1) or 1) <= 1:
        return tuple(values)
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(list(values), dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=scheduler.tp_cpu_group)
    return tuple(int(x) for x in tensor.tolist())


def _piece(req: Any, rem_chunk_tokens: int | None) -> tuple[int, int]:
    """(tokens, prefix) of the piece `req` would prefill in this step. SGLang 0.5.23's Req has no
    extend_input_len: a request the adder took has `extend_end` set (its piece ends there, a chunk
    cut included: Req.extend_len); a candidate does not yet, and its piece is the rest of its fill
    ids (init_next_round_input refreshed them and matched the prefix before add_one_req)."""
    prefix = int(getattr(req, "prefix_len", 0) or 0)
    end = getattr(req, "extend_end", None)
    if end is None:
        fill = getattr(req, "full_untruncated_fill_ids", None)
        end = len(fill) if fill is not None else prefix
    take = max(0, int(end) - prefix)
    if rem_chunk_tokens is not None:
        take = min(take, max(0, int(rem_chunk_tokens)))
    return take, prefix


def _busy(scheduler: Any, adder: Any) -> bool:
    running = getattr(adder, "running_batch", None)
    is_empty = getattr(running, "is_empty", None)
    return bool(getattr(adder, "can_run_list", None)) or getattr(scheduler, "chunked_req", None) is not None \
        or (running is not None and callable(is_empty) and not is_empty())


class HoldReport:
    """The gate's lines: one when a request starts to wait, one when it goes in after waiting (not
    one per pass while it waits). The rank's gate and the stand-in's write the same lines."""

    def __init__(self, line: Callable[[str], None]) -> None:
        self._line = line
        self._held_rid: str | None = None

    def waits(self, rid: str) -> bool:
        """Whether `rid` is the request whose wait was reported (its admission is to be reported)."""
        return self._held_rid == rid

    def held(self, rid: str, take: int, prefix: int, need: int, planned: int, headroom: int, guard: int,
             alone_s: float = 0.0) -> None:
        """`alone_s`: nothing else is in flight, and it waits that long at most."""
        if self._held_rid == rid:
            return
        self._held_rid = rid
        then = (f"nothing else is in flight, so nothing will come back for it: it waits for the guard to abort "
                f"it, at most {alone_s:g} s") if alone_s else "it goes in when memory comes back"
        self._line(f"{NAME}: request {rid} waits: its first step ({take} tokens over a {prefix}-token prefix, "
                   f"{need // 1_000_000} MB) with this step's {planned // 1_000_000} MB would leave "
                   f"{(headroom - planned - need) // 1_000_000} MB of {headroom // 1_000_000} MB, "
                   f"below the guard's {guard // 1_000_000} MB; {then}")

    def admitted(self, rid: str, headroom: int, step: int, waited_alone_s: float = 0.0) -> None:
        if self._held_rid != rid:
            return
        self._held_rid = None
        why = (f"waited {waited_alone_s:g} s with nothing else in flight and was not aborted" if waited_alone_s
               else "after waiting")
        self._line(f"{NAME}: request {rid} admitted {why} (headroom {headroom // 1_000_000} MB, "
                   f"this step {step // 1_000_000} MB)")


class AdmissionGate:
    """The hooks' state. Both run on the scheduler's thread; the pass's scheduler and headroom are
    kept per thread all the same, so that nothing leaks from one pass into another."""

    def __init__(self, settings: GateSettings, log: AdapterLog,
                 headroom: Callable[[], int] | None = None,
                 group_min: Callable[[Any, tuple[int, ...]], tuple[int, ...]] = torch_group_min,
                 refused: Callable[[], Any] | None = None,
                 kv_in_use: Callable[[Any], int | None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        if headroom is None:
            room = NodeRoom()
            headroom = lambda: torch_headroom(room)  # noqa: E731 - one NodeRoom per gate
        self._headroom = headroom
        self._group_min = group_min
        self._refused = refused or _add_req_result_other
        self._kv_in_use = kv_in_use or scheduler_kv_in_use
        self._clock = clock
        self._pass = threading.local()
        self._report = HoldReport(log.line)
        self._kv_high = 0  # the most KV pool slots in use seen at a pass
        self._alone: tuple[str, float] | None = None  # the request waiting with nothing else in flight, since
        self.refusals = 0
        self.measurements = 0

    def around_prefill(self, original: Callable[..., Any], scheduler: Any, *args: Any, **kwargs: Any) -> Any:
        in_use = self._kv_in_use(scheduler)
        if in_use is not None:
            self._kv_high = max(self._kv_high, in_use)
        self._pass.scheduler, self._pass.measured = scheduler, None
        self._pass.kv_free = max(0, self._kv_high - in_use) if in_use is not None else 0
        try:
            return original(scheduler, *args, **kwargs)
        finally:
            self._pass.scheduler = self._pass.measured = None

    def around_add_one_req(self, original: Callable[..., Any], adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        scheduler = getattr(self._pass, "scheduler", None)
        if scheduler is None:
            return original(adder, req, *args, **kwargs)
        s = self.settings
        rid = str(getattr(req, "rid", ""))
        alone = not _busy(scheduler, adder)
        if alone and s.lone_wait_s <= 0:
            return original(adder, req, *args, **kwargs)  # waiting would change nothing: idle passes stay cheap
        if self._pass.measured is None:
            try:
                local = int(self._headroom())
            except Exception:  # never skip the collective below: the other ranks wait in it
                local = UNLIMITED
            waited = self._alone is not None and self._alone[0] == rid and \
                self._clock() - self._alone[1] >= s.lone_wait_s
            # (headroom, 0 once a lone request's wait is over on this rank): the minimum of each
            self._pass.measured = self._group_min(scheduler, (local, 0 if alone and waited else 1))
            self.measurements += 1
        headroom, over = self._pass.measured[0], self._pass.measured[1] == 0
        rem = getattr(adder, "rem_chunk_tokens", None)
        planned, kv_free = pieces_bytes([_piece(r, None) for r in getattr(adder, "can_run_list", None) or ()], s,
                                        self._pass.kv_free)
        take, prefix = _piece(req, rem)
        need = step_bytes(take, prefix, s.token_bytes, s.transient_bytes, kv_free)
        step = sum(planned) + need
        if admits(headroom, sum(planned), need, s.guard_bytes) or (alone and over):
            fits = admits(headroom, sum(planned), need, s.guard_bytes)
            self._report.admitted(rid, headroom, step, waited_alone_s=0.0 if fits else s.lone_wait_s)
            if self._alone is not None and self._alone[0] == rid:
                self._alone = None
            return original(adder, req, *args, **kwargs)
        if alone and (self._alone is None or self._alone[0] != rid):
            self._alone = (rid, self._clock())
        self.refusals += 1
        self._report.held(rid, take, prefix, need, sum(planned), headroom, s.guard_bytes,
                          alone_s=s.lone_wait_s if alone else 0.0)
        return self._refused()


def _add_req_result_other() -> Any:
    from sglang.srt.managers.schedule_policy import AddReqResult

    return AddReqResult.OTHER


def build(env: Mapping[str, str], log: AdapterLog | None = None, **kwargs: Any) -> AdapterSpec | None:
    settings = settings_from_env(env)
    if settings is None:
        return None
    gate = AdmissionGate(settings, log or AdapterLog(), **kwargs)
    return AdapterSpec(
        name=NAME,
        state=gate,
        detail=(f"a new request's first prefill step waits while it would leave less than "
                f"{settings.guard_bytes} bytes ({settings.token_bytes} per token, {settings.transient_bytes:g} per "
                f"chunk x prefix token)"),
        patches=(
            Patch(SCHEDULER_MODULE, "Scheduler._get_new_batch_prefill_raw", AROUND, gate.around_prefill,
                  params=("self",)),
            Patch(POLICY_MODULE, "PrefillAdder.add_one_req", AROUND, gate.around_add_one_req,
                  params=("self", "req", "has_chunked_req")),
        ),
    )
