"""The agents' figures for the metrics: every METRICS_POLL_S each agent's GetStatus (memory, PSI,
mount, rank) and, where the plan needs packed shards, GetPackState, all nodes at once. A scrape
reads the last answers and never waits for an agent."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from ..agents import AgentUnavailable


@dataclass(frozen=True)
class NodeView:
    node: str
    up: bool
    status: object | None = None  # pb.NodeStatus of the last answer (None before the first)
    pack: object | None = None    # pb.PackState, when the node's plan needs packed shards
    error: str = ""
    at_monotonic_s: float = 0.0


class NodePoller:
    def __init__(self, clients: dict, pack_plans: dict, interval_s: float, log=None,
                 monotonic: Callable[[], float] = time.monotonic,
                 on_poll: Callable[[dict[str, NodeView]], None] | None = None):
        """pack_plans: node -> NodePlan for nodes whose plan needs packed shards (pack.required);
        on_poll: given every poll's views, in the poller's thread (the GPU slow-state watch)."""
        self._on_poll = on_poll
        self._clients = clients
        self._pack_plans = pack_plans
        self._interval = interval_s
        self._monotonic = monotonic
        self._log = log
        self._lock = threading.Lock()
        self._views: dict[str, NodeView] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-poll", daemon=True)
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(clients)), thread_name_prefix="metrics-node")

    def start(self) -> "NodePoller":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started (a session stopped before its start never was)
            self._thread.join(5.0)
        self._pool.shutdown(wait=False)

    @property
    def clients(self) -> dict:
        return dict(self._clients)

    def views(self) -> dict[str, NodeView]:
        with self._lock:
            return dict(self._views)

    def poll_once(self) -> None:
        timeout = max(1.0, min(self._interval, 5.0))
        futures = {node: self._pool.submit(self._ask, node, client, timeout) for node, client in self._clients.items()}
        views = {node: future.result() for node, future in futures.items()}
        with self._lock:
            self._views = views
        if self._on_poll is not None:
            self._on_poll(views)

    def _ask(self, node: str, client, timeout: float) -> NodeView:
        now = self._monotonic()
        try:
            status = client.status(timeout=timeout)
        except AgentUnavailable as exc:
            return NodeView(node, False, error=f"{exc.code}: {exc.details}", at_monotonic_s=now)
        pack = None
        if node in self._pack_plans:
            try:
                pack = client.pack_state(self._pack_plans[node], timeout=timeout)
            except AgentUnavailable:
                pack = None  # the status answered: the agent is up; the pack gauge is left out this time
        return NodeView(node, True, status, pack, at_monotonic_s=now)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception as exc:  # never let a surprise end the poller; the next round tries again
                if self._log is not None:
                    self._log.warning("metrics_poll_error", f"metrics: polling the agents failed: {exc!r}")
            self._stop.wait(self._interval)
