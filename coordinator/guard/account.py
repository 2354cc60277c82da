"""Whether the fall a node showed between two in-flight listings is what the cost model charges.

The projection replays the listed requests' prefill so far through its allocator model
(projection.Projection): what that replay takes from the system is the memory the model says
those requests hold now. Between two listings the model's account of the fall is the difference
of the two; the node's is the difference of its two levels. When the node fell no further than
the model says the steps in between took, the model has just been checked against this fall, and
the guard may trust its projection with little time left (policy.py's urgency). Anything the
model does not know makes the node fall further than the account (a request that ended and left
its blocks cached is in neither replay, memory another process takes, a model charging too
little): then the account does not explain the fall and the guard distrusts the model as before.

Pure: listings, levels and the coordinator's clock in, tuples out.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv41.cost import CostModel
from dsv41.inflight import InflightList

from .charge import projector

# How much further than the model's account a node may fall and the account still explain it:
# samples are noisy by a few MB, and a model off by a quarter or more is not one to trust.
SLACK_BYTES = 4_000_000
SLACK_FRACTION = 0.1


@dataclass(frozen=True)
class Account:
    """One listing's account: the node, when, its level then, and what the model says the listed
    requests had taken from the system by then."""
    node: str
    at: float
    level: int
    taken: int


def account(node: str, at: float, level: int, inflight: InflightList, model: CostModel,
            running_in_level: bool) -> Account | None:
    """The account of this listing (None when it has no scheduler view)."""
    if inflight.unavailable or not inflight.scheduler_view:
        return None
    return Account(node, at, level, projector(inflight, level, model, running_in_level).taken)


def explains(before: Account | None, now: Account | None) -> tuple[bool, str]:
    """Whether the node's fall from `before` to `now` is within what the model says was taken in
    between; and the figures, for the journal."""
    if before is None or now is None or before.node != now.node or now.at <= before.at:
        return False, "no earlier listing of this fall to check the model against"
    fell, charged = before.level - now.level, now.taken - before.taken
    if fell <= 0:
        return False, "memory did not fall between the listings"
    if charged <= 0 or fell > charged * (1 + SLACK_FRACTION) + SLACK_BYTES:
        return False, (f"memory fell {fell / 1e9:.3f} GB in {now.at - before.at:.2f} s, more than the "
                       f"{max(0, charged) / 1e9:.3f} GB the model charges the steps listed")
    return True, (f"memory fell {fell / 1e9:.3f} GB in {now.at - before.at:.2f} s, as the model charges the "
                  f"steps listed ({charged / 1e9:.3f} GB)")
