"""WatchMemory: this node's memory, sampled on a steady cadence, each sample or only the changes.

A PSI trigger (when asked for) cuts a tick's wait short, so a stall is seen at once.
"""

from __future__ import annotations

import time
from typing import Callable

import grpc

from dsv41.v1 import agent_pb2 as pb

from .memory import ChangeFilter, MeminfoInvalid, MemorySampler, Sample, SendPolicy, TriggerWatcher, Wakeup

MIN_INTERVAL_MS, MAX_INTERVAL_MS = 20, 10_000
MAX_UNREADABLE_TICKS = 25  # ticks in a row without a readable meminfo before a stream gives up
MAX_MIN_CHANGE_BYTES = 1 << 40
MAX_HEARTBEAT_MS = 60_000
DEFAULT_HEARTBEAT_MS = 1_000
MAX_REPLAY_SAMPLES = 256


def send_policy(request: pb.WatchMemoryRequest, interval_ms: int) -> SendPolicy | str:
    """The stream's SendPolicy, or what is wrong with the request."""
    if request.min_change_bytes > MAX_MIN_CHANGE_BYTES:
        return f"min_change_bytes {request.min_change_bytes}: must be 0..{MAX_MIN_CHANGE_BYTES} (0: send every sample)"
    if not request.min_change_bytes:
        if request.heartbeat_ms or request.replay_samples or request.follow_samples:
            return "heartbeat_ms, replay_samples and follow_samples apply only with min_change_bytes > 0"
        return SendPolicy()
    heartbeat_ms = request.heartbeat_ms or DEFAULT_HEARTBEAT_MS
    if not interval_ms <= heartbeat_ms <= MAX_HEARTBEAT_MS:
        return f"heartbeat_ms {heartbeat_ms}: must be interval_ms ({interval_ms})..{MAX_HEARTBEAT_MS}"
    for name in ("replay_samples", "follow_samples"):
        if getattr(request, name) > MAX_REPLAY_SAMPLES:
            return f"{name} {getattr(request, name)}: must be 0..{MAX_REPLAY_SAMPLES}"
    return SendPolicy(request.min_change_bytes, heartbeat_ms / 1000.0, request.replay_samples,
                      request.follow_samples)


def pressure_pb(p) -> pb.Pressure:
    return pb.Pressure(avg10=p.avg10, avg60=p.avg60, avg300=p.avg300, total_us=p.total_us)


def sample_pb(s: Sample) -> pb.MemorySample:
    return pb.MemorySample(
        at_monotonic_s=s.at_monotonic_s, mem_total_bytes=s.mem_total, mem_available_bytes=s.mem_available,
        cgroup_limit_bytes=s.cgroup_limit, cgroup_usage_bytes=s.cgroup_usage, available_bytes=s.available,
        some=pb.Pressure(avg10=s.some.avg10, avg60=s.some.avg60, avg300=s.some.avg300, total_us=s.some.total_us),
        full=pb.Pressure(avg10=s.full.avg10, avg60=s.full.avg60, avg300=s.full.avg300, total_us=s.full.total_us),
        rank_memory_bytes=s.rank_memory, psi_triggered=s.psi_triggered, seq=s.seq)


class MemoryRpcs:
    """WatchMemory, over the node's sampler and its PSI trigger."""

    def __init__(self, sampler: MemorySampler, triggers: TriggerWatcher,
                 monotonic: Callable[[], float] = time.monotonic):
        self._sampler = sampler
        self._triggers = triggers
        self._monotonic = monotonic

    def WatchMemory(self, request, context):
        interval_ms = request.interval_ms or 50
        if not MIN_INTERVAL_MS <= interval_ms <= MAX_INTERVAL_MS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"interval_ms {interval_ms}: must be {MIN_INTERVAL_MS}..{MAX_INTERVAL_MS}")
        policy = send_policy(request, interval_ms)
        if isinstance(policy, str):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, policy)
        sends = ChangeFilter(policy)
        fired = Wakeup()
        remove = self._triggers.add(fired.set) if request.psi_trigger else (lambda: None)
        interval = interval_ms / 1000.0
        # Sending only changes, a tick reads just what "available" needs; PSI and the rank's memory
        # are read for the samples sent (held-back ones that may be replayed are read in full).
        lazy = policy.min_change_bytes > 0 and policy.replay == 0
        complete = self._sampler.with_details if lazy else (lambda sample: sample)
        taken = unreadable = 0
        try:
            next_at = self._monotonic()
            while context.is_active():
                taken += 1
                pushed = fired.wait(next_at - self._monotonic())
                try:
                    sample = self._sampler.sample(psi_triggered=pushed, details=not lazy, seq=taken)
                    unreadable = 0
                except MeminfoInvalid as exc:
                    # A tick that cannot be read is skipped (seq shows the gap); one that never can ends
                    # the stream with the reason rather than sending a node that seems out of memory.
                    unreadable += 1
                    if unreadable >= MAX_UNREADABLE_TICKS:
                        context.abort(grpc.StatusCode.INTERNAL, f"cannot read this node's memory: {exc}")
                    sample = None
                for sent in sends.offer(sample) if sample is not None else ():
                    yield sample_pb(complete(sent))
                if pushed:  # a PSI trigger cut the wait short: the timer's tick is still due
                    continue
                next_at += interval
                now = self._monotonic()
                if next_at < now:
                    # A tick missed (a slow reader, or the agent starved of CPU while the rank
                    # populates memory): take the next sample at once, then keep the cadence from
                    # it. One fresh sample, not a burst of the missed ones, and not a further
                    # interval's wait: a node falling fast is seen when the agent can look.
                    next_at = now
        finally:
            remove()
            fired.close()
