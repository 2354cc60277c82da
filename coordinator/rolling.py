"""Changes that take the groups out one at a time: a planned restart, or a configuration the ranks
restart for. A group leaves the gateway before it is restarted (drained: what it has in flight
finishes), and comes back once it serves again; a group is never taken out while it is the only one
serving, so the gateway answers throughout.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

from dsv41.journal import EventLog

from .state import Phase, Snapshot

# How long a group waits for another group to serve before it may be taken out; then it is left
# running and the rollout ends there (the operator sees why in the journal).
OTHER_GROUP_WAIT_S = 1800.0
POLL_S = 0.5


def combined_phase(phases: Sequence[tuple[str, Phase, str]]) -> tuple[Phase, str]:
    """The cluster's phase from its groups' (name, phase, detail): serving while any group serves
    (the gateway answers), else the first group's bring-up, else failed or stopped."""
    serving = [name for name, phase, _ in phases if phase == Phase.SERVING]
    others = [f"{name} {phase}" + (f" ({detail})" if detail else "")
              for name, phase, detail in phases if phase != Phase.SERVING]
    if serving:
        detail = f"{len(serving)}/{len(phases)} groups serving through the gateway"
        return Phase.SERVING, detail + (f"; {'; '.join(others)}" if others else "")
    if all(phase == Phase.STOPPED for _, phase, _ in phases):
        return Phase.STOPPED, "; ".join(f"{name}: {detail}" for name, _, detail in phases if detail)
    moving = [(name, phase) for name, phase, _ in phases if phase not in (Phase.STOPPED, Phase.FAILED)]
    if moving:
        return moving[0][1], "; ".join(others)
    return Phase.FAILED, "; ".join(others)


def may_take_out(name: str, phases: Mapping[str, Phase]) -> bool:
    """A serving group may leave only while another serves; one that does not serve takes nothing out."""
    if phases.get(name) != Phase.SERVING:
        return True
    return any(phase == Phase.SERVING for other, phase in phases.items() if other != name)


def served_again(before: Snapshot, now: Snapshot) -> bool | None:
    """True once the group serves in a run begun after `before`; False when it failed or stopped
    instead; None while it is still on its way."""
    if now.phase == Phase.SERVING and now.serving_since > before.serving_since:
        return True
    if now.phase in (Phase.FAILED, Phase.STOPPED) and now.since > before.since:
        return False
    return None


class Member(Protocol):
    name: str

    def snapshot(self) -> Snapshot: ...


class Roller:
    """One rolling change, in its own thread: for each group in order, wait until another serves,
    take the group out of the gateway (`gateway.remove_now`), `take_out(group)` (a drained restart,
    or starting its supervisor on the new configuration), wait until it serves again, put it back
    (`gateway.release`). A group that fails ends the rollout: the others keep serving."""

    def __init__(self, members: Sequence[Member], gateway, take_out: Callable[[Member], None], log: EventLog,
                 what: str, monotonic: Callable[[], float] = time.monotonic, poll_s: float = POLL_S,
                 other_wait_s: float = OTHER_GROUP_WAIT_S, bring_up_wait_s: float = 7200.0):
        self._members, self._gateway, self._take_out, self._log = list(members), gateway, take_out, log
        self._what, self._monotonic, self._poll_s = what, monotonic, poll_s
        self._other_wait_s, self._bring_up_wait_s = other_wait_s, bring_up_wait_s
        self.cancelled = threading.Event()
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rolling", daemon=True)

    def start(self) -> "Roller":
        self._log.event("rolling_started", f"{self._what}: one group at a time ({', '.join(m.name for m in self._members)})",
                        "notice", groups=len(self._members))
        self._thread.start()
        return self

    def cancel(self) -> None:
        self.cancelled.set()

    def _phases(self) -> dict[str, Phase]:
        """Each group's phase, where one the gateway does not route to yet (it adds a group a second or
        two after it serves) does not count as serving: it would not answer for the group taken out."""
        phases = {m.name: m.snapshot().phase for m in self._members}
        if self._gateway is not None:
            phases = {name: Phase.HEALTH if phase == Phase.SERVING and not self._gateway.routes(name) else phase
                      for name, phase in phases.items()}
        return phases

    def _run(self) -> None:
        try:
            for member in self._members:
                if not self._wait_for_another(member) or not self._roll(member):
                    return
            self._log.event("rolling_done", f"{self._what}: every group restarted and serving", "notice")
        except Exception as exc:  # the rollout must not die silently
            self._log.error("rolling_failed", f"{self._what}: internal error: {exc!r}")
        finally:
            self.done.set()

    def _wait_for_another(self, member: Member) -> bool:
        deadline = self._monotonic() + self._other_wait_s
        told = False
        while not may_take_out(member.name, self._phases()):
            if self.cancelled.is_set():
                return False
            if self._monotonic() >= deadline:
                self._log.warning("rolling_held", f"{self._what}: {member.name} left serving: it is the only group "
                                  f"serving after {self._other_wait_s:g} s; the rollout ends here", group=member.name)
                return False
            if not told:
                self._log.info("rolling_waiting", f"{self._what}: {member.name} waits until another group serves",
                               group=member.name)
                told = True
            self.cancelled.wait(self._poll_s)
        return not self.cancelled.is_set()

    def _roll(self, member: Member) -> bool:
        before = member.snapshot()
        if self._gateway is not None and not self._gateway.remove_now(member.name):
            self._log.warning("rolling_gateway", f"{member.name}: the gateway did not confirm its removal; "
                              "restarting it anyway (the gateway retries its requests on another group)",
                              group=member.name)
        self._take_out(member)
        outcome = None
        deadline = self._monotonic() + self._bring_up_wait_s
        while outcome is None and not self.cancelled.is_set() and self._monotonic() < deadline:
            self.cancelled.wait(self._poll_s)
            outcome = served_again(before, member.snapshot())
        if self._gateway is not None:
            self._gateway.release(member.name)
        if outcome:
            self._log.info("rolling_group_done", f"{self._what}: {member.name} serves again", group=member.name)
            return True
        if not self.cancelled.is_set():
            self._log.warning("rolling_stopped", f"{self._what}: {member.name} did not serve again "
                              f"({member.snapshot().phase}); the groups not yet restarted keep serving",
                              group=member.name)
        return False
