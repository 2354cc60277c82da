"""What the coordinator runs from one configuration, and its replacement when the configuration changes.

Everything built from cluster.env (the agents' clients, the supervisor, the memory guard, the serving
probe, the metrics, the incident hook) belongs to a Session. Applying a new file builds a new Session
and starts it the way a restarted coordinator starts: it re-adopts the ranks when their plans are
unchanged, and restarts them once when they are not (under a Rollout that brings the configuration
before it back if the group does not serve). The control socket and the daemon outlive sessions.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

from dsv41.journal import EventLog

from . import config as config_mod
from . import configdiff, pki
from .agents import AgentClient, Tls
from .configstore import ConfigStore
from .gpuslow import GpuSlowWatch, rules_from_config
from .gpuwatch import GpuSlowIncidents
from .guard.runner import MemoryGuard
from .hook import IncidentHook, file_problem
from .incidentlog import HISTORY_NAME, IncidentHistory
from .messages import IncidentSeen
from .metrics.nodes import NodePoller
from .probe import ServingProbe
from . import groups as groups_mod
from . import plan as plan_mod
from .agents import launch_pb
from .gateway import Gateway
from .grouped import GroupedRuntime, GroupRun, group_state_dir
from .runtime import ClusterRuntime, Rollout, boottime
from .state import Phase

STOPPED_PHASES = (Phase.STOPPED, Phase.FAILED)


def load_tls(cfg: config_mod.ClusterConfig) -> Tls | None:
    if cfg.flag("INSECURE_NO_TLS"):
        return None
    pki_dir = cfg.text("PKI_DIR")
    paths = [os.path.join(pki_dir, name) for name in ("ca.crt", "coordinator.crt", "coordinator.key")]
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise FileNotFoundError(f"missing {', '.join(missing)}: run `dsv41ctl pki init` (or set INSECURE_NO_TLS=1 "
                                "on an isolated test network)")
    mode = os.stat(paths[2]).st_mode & 0o777
    if mode & 0o077:
        raise PermissionError(f"{paths[2]}: mode {mode:04o} lets group or other read the coordinator's key; "
                              f"run `chmod 600 {paths[2]}`")
    ca, cert, key = (open(p, "rb").read() for p in paths)
    try:
        pki.check_leaf(ca, cert, key, pki.COORDINATOR_NAME)
    except (pki.PkiError, ValueError) as exc:
        raise OSError(f"{pki_dir}: unusable coordinator certificate: {exc}") from None
    return Tls(ca, cert, key)


def make_clients(cfg: config_mod.ClusterConfig, tls: Tls | None) -> dict[str, AgentClient]:
    return {n.name: make_client(cfg, n, tls) for n in cfg.nodes}


def make_client(cfg: config_mod.ClusterConfig, node: config_mod.Node, tls: Tls | None) -> AgentClient:
    return AgentClient(node.name, f"{node.address}:{cfg.integer('AGENT_PORT')}", tls)


class Unusable(Exception):
    """A configuration that is valid but cannot be run from here (its certificates, its API key file)."""


@dataclass(frozen=True)
class Credentials:
    tls: Tls | None
    api_key: str | None


def credentials(cfg: config_mod.ClusterConfig) -> Credentials:
    try:
        tls = load_tls(cfg)
    except OSError as exc:
        raise Unusable(str(exc)) from None
    api_key = None
    if key_file := cfg.optional_text("API_KEY_FILE"):
        try:
            api_key = pki.read_api_key(key_file)
        except pki.PkiError as exc:
            raise Unusable(f"API_KEY_FILE: {exc}") from None
    return Credentials(tls, api_key)


class Session:
    """The parts built from one configuration; started once, stopped once."""

    def __init__(self, cfg: config_mod.ClusterConfig, text: str, creds: Credentials, log: EventLog,
                 listeners: list[Callable], state_dir: str, started_unix_s: float | None = None):
        self.cfg, self.text, self.api_key = cfg, text, creds.api_key
        # One supervisor per TP group (GROUPS); a one-group cluster is its own, with no gateway.
        self.supervisors = _supervisors(cfg, creds, log, state_dir, started_unix_s)
        self.runtime = self.supervisors[0] if len(self.supervisors) == 1 else \
            _grouped(cfg, self.supervisors, creds, log)
        for listener in listeners:
            self.runtime.on_incident(listener)
        self.hook = None
        if hook_file := cfg.optional_text("INCIDENT_HOOK"):
            self.hook = IncidentHook(hook_file, cfg.number("INCIDENT_HOOK_TIMEOUT_S"), log).start()
            self.runtime.on_incident(self.hook.offer)  # only queues: the hook runs in its own thread
        # Each group's guard acts on its own group's supervisor only.
        self.guards = [g for g in (MemoryGuard.for_runtime(r, r.log, creds.api_key) for r in self.supervisors) if g]
        # The GPU slow state is an incident whether or not metrics are on: their poll feeds it, else one
        # of its own (coordinator/gpuwatch.py).
        self.gpus = GpuSlowIncidents(GpuSlowWatch(rules_from_config(cfg)),
                                     lambda *seen: self.runtime.post(IncidentSeen(*seen)), log)
        self.metrics = _start_metrics(cfg, self.runtime, log, self.guards[0] if self.guards else None, creds.tls,
                                      self.gpus)
        self.gpu_poller = None if self.metrics is not None else NodePoller(
            make_clients(cfg, creds.tls), {}, cfg.number("GPU_POLL_S"), log, on_poll=self.gpus.on_poll)
        self.probes: list[ServingProbe] = []

    def start(self, autostart: bool, restart_for: tuple[str, ...] = (), rollout: Rollout | None = None) -> None:
        self.runtime.run(autostart=autostart, restart_for=restart_for, rollout=rollout)
        self.probes = [ServingProbe.for_runtime(r, self.api_key).start() for r in self.supervisors]
        for guard in self.guards:
            guard.start()
        if self.gpu_poller is not None:
            self.gpu_poller.start()

    def stop(self, stop_cluster: bool) -> None:
        for guard in self.guards:
            guard.stop()  # first, so that it cannot act on a cluster going down
        for probe in self.probes:
            probe.stop()
        self.runtime.shutdown(stop_cluster=stop_cluster)
        if self.metrics is not None:
            self.metrics.stop()
        if self.gpu_poller is not None:
            self.gpu_poller.stop()
            for client in self.gpu_poller.clients.values():
                client.close()
        if self.hook is not None:
            self.hook.stop()
        for client in self.runtime.clients.values():
            client.close()
        if isinstance(self.runtime, GroupedRuntime):
            self.runtime.gateway_client.close()


def _supervisors(cfg: config_mod.ClusterConfig, creds: Credentials, log: EventLog, state_dir: str,
                 started_unix_s: float | None) -> list[ClusterRuntime]:
    groups = groups_mod.groups_of(cfg)
    out = []
    for group in groups:
        own = groups_mod.group_config(cfg, group) if len(groups) > 1 else cfg
        group_log = log.with_fields(DSV41_GROUP=group.name) if len(groups) > 1 else log
        own_dir = group_state_dir(state_dir, group)
        os.makedirs(own_dir, mode=0o700, exist_ok=True)
        out.append(ClusterRuntime(own, make_clients(own, creds.tls), group_log, api_key=creds.api_key,
                                  state_dir=own_dir, boottime=boottime,
                                  history=IncidentHistory(os.path.join(own_dir, HISTORY_NAME), group_log),
                                  started_unix_s=started_unix_s))
    return out


def _grouped(cfg: config_mod.ClusterConfig, supervisors: list[ClusterRuntime], creds: Credentials,
             log: EventLog) -> GroupedRuntime:
    runs = [GroupRun(group, r) for group, r in zip(groups_mod.groups_of(cfg), supervisors)]
    grouped = GroupedRuntime(cfg, runs, log)
    head_client = make_client(cfg, cfg.head, creds.tls)  # the gateway manager's own channel to the head

    def head_rank_spec():
        """The head rank's spec for the gateway's runtime; the API key's file goes to the head first."""
        if creds.api_key:
            head_client.put_file(os.path.basename(plan_mod.API_KEY_NODE_PATH), creds.api_key.encode(), mode=0o600)
        launch, fingerprint = plan_mod.gateway_launch(supervisors[0].cfg)
        return launch_pb(launch, fingerprint=fingerprint)

    grouped.gateway = Gateway(cfg, head_client, head_rank_spec, creds.api_key, log, grouped.routable)
    grouped.gateway_client = head_client
    return grouped


def _start_metrics(cfg: config_mod.ClusterConfig, runtime: ClusterRuntime, log: EventLog, guard, tls: Tls | None,
                   gpus: GpuSlowIncidents):
    """The metrics endpoint, or None (METRICS_LISTEN empty, or it cannot listen: the cluster is kept
    serving without it, and a scrape target that is down is what Prometheus alerts on)."""
    listen = cfg.optional_listen("METRICS_LISTEN")
    if listen is None:
        return None
    from .metrics.exporter import Metrics  # prometheus_client only when metrics are on
    clients = make_clients(cfg, tls)
    try:
        return Metrics(cfg, runtime, log, guard, clients=clients, gpus=gpus).start()
    except OSError as exc:
        for client in clients.values():
            client.close()
        log.error("metrics_failed", f"metrics: cannot listen on {listen}: {exc.strerror or exc}; "
                  "serving without metrics", listen=str(listen))
        return None


@dataclass(frozen=True)
class Outcome:
    ok: bool
    message: str
    diff: configdiff.ConfigDiff | None = None


def parse_text(text: str, path: str) -> config_mod.ClusterConfig:
    return config_mod.parse(text, path, os.environ, file_problem)
