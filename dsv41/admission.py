"""The ranks' admission rule (standard library only): a new request's first prefill step waits
while it would take the node below the guard.

The rank applies it in SGLang's scheduler (adapter/admission_gate.py), the stand-in in its own
(sim/engine.py), and the coordinator's guard replays it when it projects what the ranks will
hold back (coordinator/guard/projection.py). A piece's cost is the guard's cost model
(dsv41/cost.py), passed to the ranks with the guard level as DSV41_ADMISSION_*.
"""

from __future__ import annotations

from dataclasses import dataclass

# The most a request waits with nothing else in flight (for the guard's look to abort it) before it
# goes in all the same: the guard looks every 0.2 s, and may not be running at all. The coordinator
# passes 0 (no such wait) when its guard only observes.
LONE_WAIT_S = 5.0


@dataclass(frozen=True)
class GateSettings:
    guard_bytes: int
    token_bytes: int
    transient_bytes: float
    lone_wait_s: float = LONE_WAIT_S  # 0: a request alone goes in at once


def step_bytes(take: int, prefix: int, token_bytes: int, transient_bytes: float, kv_free_tokens: int = 0) -> int:
    """What a prefill piece of `take` tokens after `prefix` tokens allocates: its tokens' cost (past
    `kv_free_tokens` free KV pool slots whose pages are there) and the indexer's buffers
    [take, prefix + take]."""
    if take <= 0:
        return 0
    return max(0, take - kv_free_tokens) * token_bytes + int(transient_bytes * take * (prefix + take))


def admits(headroom: int, planned: int, need: int, guard: int) -> bool:
    """Whether a request's first piece (`need`) goes into the step: when the step (`planned`
    already, then it) leaves at least `guard`."""
    return headroom - planned - need >= guard


def pieces_bytes(pieces: list[tuple[int, int]], s: GateSettings, kv_free_tokens: int) -> tuple[list[int], int]:
    """Each (take, prefix) piece's step_bytes in order, the free KV pool slots taken by the pieces
    before it; and the free slots left after them."""
    out = []
    for take, prefix in pieces:
        out.append(step_bytes(take, prefix, s.token_bytes, s.transient_bytes, kv_free_tokens))
        kv_free_tokens = max(0, kv_free_tokens - take)
    return out, kv_free_tokens
