"""Puts the metrics together for the daemon: a recorder fed by the event log and the runtime's
incidents, a node poller, the guard's margin window, a collector on a private registry and the
HTTP server on METRICS_LISTEN."""

from __future__ import annotations

from dsv41.journal import EventLog
from prometheus_client import CollectorRegistry

from .. import plan as plan_mod
from ..gpuslow import GpuSlowWatch, rules_from_config
from ..gpuwatch import GpuSlowIncidents
from ..messages import IncidentSeen
from .collector import ClusterCollector
from .low import WindowLow
from .nodes import NodePoller
from .recorder import Recorder
from .server import MetricsServer

GUARD_WINDOW_S = 60.0


class Metrics:
    def __init__(self, cfg, runtime, log: EventLog, guard=None, clients: dict | None = None,
                 gpus: GpuSlowIncidents | None = None):
        """Subscribes at once (so no event is missed); serves only after start(). `clients`: agent
        clients of the metrics' own (default the runtime's), so that polling an agent that is down
        never puts the supervisor's channel into reconnect backoff; `gpus`: the GPU slow-state watch
        this poll feeds (default one recording its incidents with the runtime)."""
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
        self.gpus = gpus or GpuSlowIncidents(GpuSlowWatch(rules_from_config(cfg)),
                                             lambda *seen: runtime.post(IncidentSeen(*seen)), log)
        self.poller = NodePoller(clients or runtime.clients, {p.node: p for p in plans if p.pack.required},
                                 cfg.number("METRICS_POLL_S"), log, on_poll=self.gpus.on_poll)
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
                                                runtime.liveness_views, self.gpus.slow))
        if hasattr(runtime, "group_snapshots"):  # GROUPS: each group's phase and the gateway
            from .groups import GroupCollector
            gateway = getattr(runtime, "gateway", None)
            self.registry.register(GroupCollector(
                lambda: [(run.name, snap.phase, snap.serving_since) for run, snap in runtime.group_snapshots()],
                (lambda: runtime.gateway.view()) if gateway is not None else None))
        self._listen = listen

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
