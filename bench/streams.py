"""What the CPU benches share: the memory guard's stream request and the bare-Python floor."""

from coordinator.guard.settings import GuardSettings
from dsv41.v1 import agent_pb2 as pb

# The least any Python sampler does: wake every 50 ms and read /proc/meminfo, nothing else. Run as
# `python3 -c FLOOR`; a bench measures its CPU next to the agent's in the same run.
FLOOR = r"""
import os, select, time
fd = os.open("/proc/meminfo", os.O_RDONLY)
poll = select.poll()
next_at = time.monotonic()
while True:
    poll.poll(max(0, int((next_at - time.monotonic()) * 1000 + 0.999)))
    next_at += 0.05
    os.pread(fd, 4096, 0)
"""


def guard_request(interval_ms: int = 50) -> pb.WatchMemoryRequest:
    """What the memory guard asks an agent for, with the example configuration's 10-sample window."""
    settings = GuardSettings(interval_ms=interval_ms, window_s=10 * interval_ms / 1000)
    return pb.WatchMemoryRequest(interval_ms=interval_ms, psi_trigger=True, **settings.send_request())
