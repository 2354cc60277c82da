"""Puts the metrics together for the daemon: a recorder fed by the event log and the runtime's
incidents, a node poller, the guard's margin window, a collector on a private registry and the
HTTP server on METRICS_LISTEN."""

from __future__ import annotations

from dsv41.journal import EventLog
from prometheus_client import CollectorRegistry

from .. import plan as plan_mod
from ..gpuslow import GpuSlowWatch, rules_from_config
from .collector import ClusterCollector
from .low import WindowLow
from .nodes import NodePoller
from .recorder import Recorder
from .server import MetricsServer

GUARD_WINDOW_S = 60.0


class Metrics:
    def __init__(self, cfg, runtime, log: EventLog, guard=None, clients: dict | None = None):
        """Subscribes at once (so no event is missed); serves only after start(). `clients`: agent
        clients of the metrics' own (default the runtime's), so that polling an agent that is down
        never puts the supervisor's channel into reconnect backoff."""
        listen = cfg.optional_listen("METRICS_LISTEN")
        if listen is None:
            raise ValueError("METRICS_LISTEN is empty: there is no address to serve metrics on")
        self.registry = CollectorRegistry(auto_describe=False)
        self.server = MetricsServer(listen.host, listen.port, self.registry)  # binds first: nothing to undo
        self.recorder = Recorder()
        self._unsubscribe = log.subscribe(self.recorder.on_event)
        # The incident counters carry on from the coordinator's history: earlier coordinators' too.
        self.recorder.add_incidents(runtime.follow_incidents(self.recorder.on_incident))
        plans = plan_mod.render_cluster(cfg)
        self._own_clients = clients
        self._log = log
        self.gpu_slow = GpuSlowWatch(rules_from_config(cfg))
        self.poller = NodePoller(clients or runtime.clients, {p.node: p for p in plans if p.pack.required},
                                 cfg.number("METRICS_POLL_S"), log, on_poll=self._watch_gpus)
        low = None
        self.guard_window = None
        if guard is not None:
            self.guard_window = WindowLow(GUARD_WINDOW_S)
            guard.on_sample(lambda node, available: self.guard_window.add(available))
            low = self.guard_window.lowest
        mounts = tuple(n.name for n in cfg.nodes if not n.is_head) if cfg.flag("NFS_SHARE") else ()
        self.registry.register(ClusterCollector(runtime.snapshot, [n.name for n in cfg.nodes], self.recorder,
                                                self.poller.views, low,
                                                guard.settings.guard_bytes if guard is not None else 0, mounts,
                                                runtime.liveness_views, self.gpu_slow.slow))
        self._listen = listen

    def _watch_gpus(self, views) -> None:
        """Journals each GPU that has just become slow (once per episode; dsv41_gpu_slow shows it while it lasts)."""
        statuses = {node: view.status for node, view in views.items() if view.up and view.status is not None}
        for slow in self.gpu_slow.observe(statuses):
            self._log.warning("gpu_slow", slow.message, node=slow.gpu.node, gpu=slow.gpu.index, uuid=slow.gpu.uuid,
                              cause=slow.cause, slow_s=round(slow.for_s))

    def start(self) -> "Metrics":
        self.poller.start()
        self.server.start()
        self._log.info("metrics_started", f"metrics on http://{self._listen}/metrics", listen=str(self._listen))
        return self

    def stop(self) -> None:
        self.server.stop()
        self.poller.stop()
        self._unsubscribe()
        for client in (self._own_clients or {}).values():
            client.close()
