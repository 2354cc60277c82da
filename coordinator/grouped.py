"""Several TP groups as one cluster: a supervisor (coordinator/runtime.py) per group, the gateway
in front of them, and what the control socket, the metrics and the daemon ask of a runtime answered
for the whole. A fault in one group is that group's supervisor's alone; a planned restart or a
configuration the ranks restart for rolls group by group (coordinator/rolling.py).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable

from dsv41.journal import EventLog
from dsv41.v1 import control_pb2 as cpb

from . import groups as groups_mod
from .config import ClusterConfig
from .groups import Group
from .rolling import Roller, combined_phase
from .runtime import ClusterRuntime, Rollout
from .state import Phase, Snapshot


@dataclass
class GroupRun:
    """One group's supervisor and the configuration it runs."""
    group: Group
    runtime: ClusterRuntime  # over the group's view of the configuration (groups.group_config)
    started: bool = False
    # A rolling configuration change has not reached it: its ranks serve the previous configuration,
    # unsupervised until its turn (its supervisor starts then, and restarts them).
    awaiting_turn: bool = False

    @property
    def name(self) -> str:
        return self.group.name

    def snapshot(self) -> Snapshot:
        snap = self.runtime.snapshot()
        if self.awaiting_turn and not self.started:
            return replace(snap, phase=Phase.SERVING, detail="serving the previous configuration until its turn in "
                           "the rollout")
        return snap


def group_state_dir(state_dir: str, group: Group) -> str:
    """The first group keeps the coordinator's state directory (a one-group cluster's history stays
    its own when groups are added); the others have one each below it."""
    return state_dir if group.name == "g1" else os.path.join(state_dir, "groups", group.name)


class GroupedRuntime:
    """The runtime interface (snapshot, request, incidents, ...) over every group's supervisor."""

    def __init__(self, cfg: ClusterConfig, runs: list[GroupRun], log: EventLog, gateway=None):
        self.cfg = cfg
        self.runs = runs
        self.gateway = gateway
        self.gateway_client = None  # the head agent's client the gateway's manager uses (the session closes it)
        self._log = log
        self.clients = {name: client for run in runs for name, client in run.runtime.clients.items()}
        self.base_url = f"http://{cfg.text('HEAD_IP')}:{cfg.integer('GATEWAY_PORT')}"
        self.started_unix_s = runs[0].runtime.started_unix_s
        self._lock = threading.Lock()
        self._roller: Roller | None = None

    # ------------------------------------------------------------------ what readers ask

    def snapshot(self) -> Snapshot:
        snaps = self.group_snapshots()
        phase, detail = combined_phase([(run.name, snap.phase, snap.detail) for run, snap in snaps])
        first = snaps[0][1]
        incidents = [s.last_incident for _, s in snaps if s.last_incident is not None]
        merged: dict[str, dict] = {"fabric": {}, "fingerprints": {}, "ranks": {}}
        for _, snap in snaps:
            for key, into in merged.items():
                into.update(getattr(snap, key))
        serving = [s.serving_since for _, s in snaps if s.phase == Phase.SERVING]
        return replace(first, phase=phase, detail=detail, since=max(s.since for _, s in snaps),
                       serving_since=min(serving) if serving else 0.0,
                       restart_attempt=max(s.restart_attempt for _, s in snaps),
                       generation=" ".join(f"{run.name}:{s.generation}" for run, s in snaps),
                       last_incident=max(incidents, key=lambda i: i.at_unix_s) if incidents else None, **merged)

    def group_snapshots(self) -> list[tuple[GroupRun, Snapshot]]:
        return [(run, run.snapshot()) for run in self.runs]

    def routable(self) -> dict[str, str]:
        """The groups the gateway routes to: those serving, the ones a rolling configuration change has
        not reached yet included."""
        return {run.name: groups_mod.worker_url(self.cfg, run.group) for run in self.runs
                if run.snapshot().phase == Phase.SERVING}

    def incidents(self) -> list:
        return sorted((i for run in self.runs for i in run.runtime.incidents()), key=lambda i: i.at_unix_s)

    def earlier_incidents(self) -> int:
        return sum(run.runtime.earlier_incidents() for run in self.runs)

    def on_incident(self, listener: Callable) -> None:
        for run in self.runs:
            run.runtime.on_incident(listener)

    def follow_incidents(self, listener: Callable) -> dict:
        counts: dict = {}
        for run in self.runs:
            for key, n in run.runtime.follow_incidents(listener).items():
                counts[key] = counts.get(key, 0) + n
        return counts

    def liveness_views(self) -> dict:
        return {node: view for run in self.runs for node, view in run.runtime.liveness_views().items()}

    def run_of(self, node: str) -> GroupRun:
        for run in self.runs:
            if node in run.runtime.clients:
                return run
        return self.runs[0]

    def post(self, message: object) -> None:
        self.run_of(getattr(message, "node", "")).runtime.post(message)

    # ------------------------------------------------------------------ start, requests, stop

    def run(self, autostart: bool = True, restart_for: tuple[str, ...] = (), rollout: Rollout | None = None) -> None:
        """Every group's supervisor at once (each re-adopts its ranks); with `restart_for`, one group
        at a time, the others serving on the previous configuration until their turn."""
        if self.gateway is not None and autostart:
            self.gateway.start()
        if not restart_for:
            for run in self.runs:
                self._start(run, autostart)
            return

        def take_out(run: GroupRun) -> None:
            self._start(run, True, restart_for, rollout)
        for run in self.runs:
            run.awaiting_turn = True
        self._roll(take_out, f"configuration change ({', '.join(restart_for)})")

    def _start(self, run: GroupRun, autostart: bool, restart_for: tuple[str, ...] = (),
               rollout: Rollout | None = None) -> None:
        run.started, run.awaiting_turn = True, False
        run.runtime.run(autostart=autostart, restart_for=restart_for, rollout=rollout)

    def _supervised(self, run: GroupRun) -> ClusterRuntime:
        """The group's supervisor, started (without a bring-up) if a rollout had not reached it: a
        request reaches every group's ranks."""
        if not run.started:
            self._start(run, False)
        return run.runtime

    def request(self, action: str, reason: str | None = None, source: str = "dsv41ctl", drain: bool = False) -> None:
        self._cancel_roll()
        if action == "restart":
            def take_out(run: GroupRun) -> None:
                self._supervised(run).request("restart", reason, source, drain=True)
            self._roll(take_out, f"restart ({reason or 'requested by ' + source})")
            return
        if self.gateway is not None:
            if action == "start":
                self.gateway.start()
            elif action == "stop":
                threading.Thread(target=self.gateway.stop_unit, name="gateway-stop", daemon=True).start()
        for run in self.runs:
            self._supervised(run).request(action, reason, source, drain)

    def _roll(self, take_out: Callable[[GroupRun], None], what: str) -> None:
        with self._lock:
            self._roller = Roller(self.runs, self.gateway, take_out, self._log, what).start()

    def _cancel_roll(self) -> None:
        with self._lock:
            roller, self._roller = self._roller, None
        if roller is not None:
            roller.cancel()
            roller.done.wait(5.0)

    def shutdown(self, stop_cluster: bool) -> None:
        """Every group's supervisor stops; with stop_cluster, every group's ranks too (those a rollout
        had not reached included)."""
        self._cancel_roll()
        started = [run for run in self.runs if run.started or stop_cluster]
        for run in started:
            self._supervised(run)
        with ThreadPoolExecutor(max_workers=len(self.runs)) as pool:
            list(pool.map(lambda run: run.runtime.shutdown(stop_cluster), started))
        if self.gateway is not None:
            self.gateway.stop(stop_unit=stop_cluster)

    # ------------------------------------------------------------------ operator's jobs, group by group

    def unexport(self, force: bool, unmount: bool, **kw) -> tuple[bool, str]:
        busy = [run.name for run, snap in self.group_snapshots() if snap.phase not in (Phase.STOPPED, Phase.FAILED)]
        if busy and not force:
            return False, f"groups {', '.join(busy)} run or start ranks from the export: `dsv41ctl stop` first"
        return self.runs[0].runtime.unexport(force, unmount, **kw)

    def start_pack(self, **kw) -> list[str]:
        return [node for run in self.runs for node in run.runtime.start_pack(**kw)]

    def autotune_reset(self, **kw) -> tuple[bool, str]:
        return _joined([(run.name, run.runtime.autotune_reset(**kw)) for run in self.runs])

    def fabric_test(self) -> tuple[bool, str]:
        return _joined([(run.name, run.runtime.fabric_test()) for run in self.runs])

    def guarded_run(self):
        return None  # each group's guard watches its own supervisor


def _joined(results: list[tuple[str, tuple[bool, str]]]) -> tuple[bool, str]:
    return all(ok for _, (ok, _) in results), "\n".join(f"{name}: {message}" for name, (_, message) in results)


def fill_status(status: cpb.ClusterStatus, grouped: GroupedRuntime) -> None:
    """Each group's phase and the gateway in the cluster's status; its nodes' ranks within their group,
    and the gateway as the endpoint clients use."""
    by_node = {}
    for run, snap in grouped.group_snapshots():
        status.groups.append(cpb.GroupStatus(
            name=run.name, phase=snap.phase, phase_detail=snap.detail, nodes=[n.name for n in run.group.nodes],
            endpoint=groups_mod.worker_url(grouped.cfg, run.group), serving_since_unix_s=snap.serving_since,
            generation=snap.generation, restart_attempt=snap.restart_attempt))
        by_node.update({n.name: (run.name, n.rank) for n in run.group.nodes})
    for view in status.nodes:
        view.group, view.rank = by_node.get(view.name, ("", view.rank))
    status.endpoint = grouped.base_url if status.phase == Phase.SERVING else ""
    if grouped.gateway is None:
        return
    seen = grouped.gateway.view()
    status.gateway.CopyFrom(cpb.GatewayStatus(
        url=seen.url, unit_state=seen.unit_state, ready=seen.ready, error=seen.error,
        workers=[cpb.GatewayWorker(group=group, url=url, healthy=healthy) for group, url, healthy in seen.workers]))
