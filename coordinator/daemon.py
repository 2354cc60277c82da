"""dsv41-coordinator: brings the cluster up, keeps it serving, and brings it down on stop (Type=notify).

READY=1 is sent when the coordinator is up (not when the 12-minute model load ends); STATUS=
shows the phase. SIGTERM (systemctl stop) stops rank 0 first, then the workers, and confirms on
every node that no rank is left. SIGKILL or a crash leaves the ranks serving; started again, the
coordinator re-adopts ranks that run the current plans.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from dsv41.journal import EventLog
from dsv41.sdnotify import SdNotify
from dsv41.version import VERSION

from . import config as config_mod
from . import pki
from .agents import AgentClient, Tls
from .control import serve
from .guard.runner import MemoryGuard
from .hook import IncidentHook
from .incidentlog import HISTORY_PATH, IncidentHistory
from .probe import ServingProbe
from .runtime import ClusterRuntime
from .state import Phase
from .sockets import CONTROL_SOCKET

DEFAULT_CONFIG = "/etc/dsv41/cluster.env"


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
    return {n.name: AgentClient(n.name, f"{n.address}:{cfg.integer('AGENT_PORT')}", tls) for n in cfg.nodes}


def status_line(runtime: ClusterRuntime, clock=time.time) -> str:
    snap = runtime.snapshot()
    if snap.phase == Phase.SERVING:
        up = int(clock() - snap.serving_since)
        total = len(runtime.clients)
        running = sum(1 for r in snap.ranks.values() if r.active_state == "active")
        return f"serving on :{runtime.cfg.integer('PORT')}, {running}/{total} ranks, up {up // 3600}h{up % 3600 // 60:02d}m"
    return f"{snap.phase}" + (f": {snap.detail}" if snap.detail else "")


def start_metrics(cfg: config_mod.ClusterConfig, runtime: ClusterRuntime, log: EventLog, guard, tls: Tls | None):
    """The metrics endpoint, or None (METRICS_LISTEN empty, or it cannot listen: the cluster is kept
    serving without it, and a scrape target that is down is what Prometheus alerts on)."""
    listen = cfg.optional_listen("METRICS_LISTEN")
    if listen is None:
        return None
    from .metrics.exporter import Metrics  # prometheus_client only when metrics are on
    clients = make_clients(cfg, tls)
    try:
        return Metrics(cfg, runtime, log, guard, clients=clients).start()
    except OSError as exc:
        for client in clients.values():
            client.close()
        log.error("metrics_failed", f"metrics: cannot listen on {listen}: {exc.strerror or exc}; "
                  "serving without metrics", listen=str(listen))
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dsv41-coordinator", description="dsv41 cluster coordinator")
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--control-socket", default=CONTROL_SOCKET)
    parser.add_argument("--no-autostart", action="store_true", help="wait for `dsv41ctl start`")
    parser.add_argument("--version", action="version", version=VERSION)
    args = parser.parse_args(argv)
    try:
        cfg = config_mod.load(args.config)
    except config_mod.ConfigInvalid as exc:
        print(f"<3>dsv41-coordinator: {args.config} is invalid; nothing was started:\n{exc}", file=sys.stderr)
        return 2
    log = EventLog("dsv41-coordinator", {"DSV41_NODE": cfg.head.name})
    try:
        tls = load_tls(cfg)
    except (OSError, FileNotFoundError) as exc:
        log.error("coordinator_failed", str(exc))
        return 2
    api_key = None
    if key_file := cfg.optional_text("API_KEY_FILE"):
        try:
            api_key = pki.read_api_key(key_file)
        except pki.PkiError as exc:
            log.error("coordinator_failed", f"API_KEY_FILE: {exc}")
            return 2
    runtime = ClusterRuntime(cfg, make_clients(cfg, tls), log, api_key=api_key,
                             history=IncidentHistory(HISTORY_PATH, log))  # incidents of earlier coordinators
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    hook = None
    if hook_file := cfg.optional_text("INCIDENT_HOOK"):
        hook = IncidentHook(hook_file, cfg.number("INCIDENT_HOOK_TIMEOUT_S"), log).start()
        runtime.on_incident(hook.offer)  # only queues: the hook runs in its own thread
    guard = MemoryGuard.for_runtime(runtime, log, api_key)  # watches memory whenever the cluster serves
    metrics = start_metrics(cfg, runtime, log, guard, tls)  # before run(): it counts the first bring-up's steps
    server = serve(cfg, runtime, args.control_socket, log, api_key=api_key)
    notify = SdNotify.from_env()
    runtime.run(autostart=not args.no_autostart)
    probe = ServingProbe.for_runtime(runtime, api_key).start()  # work pending, for the hang check
    if guard is not None:
        guard.start()
    log.info("coordinator_started", f"dsv41-coordinator {VERSION}: {len(cfg.nodes)} nodes, control socket "
             f"{args.control_socket}", version=VERSION)
    notify.ready(status_line(runtime))
    watchdog_usec = int(os.environ.get("WATCHDOG_USEC", "0") or 0)
    period = min(2.0, watchdog_usec / 2e6) if watchdog_usec else 2.0
    last = ""
    while not stop.wait(period):
        if watchdog_usec:
            notify.watchdog()
        line = status_line(runtime)
        if line != last:
            notify.status(line)
            last = line
    notify.stopping()
    notify.status("stopping the cluster: rank 0 first, then the workers")
    log.info("coordinator_stopping", "stopping the cluster")
    if guard is not None:
        guard.stop()  # before the stop, so that it cannot act on a cluster going down
    probe.stop()
    runtime.shutdown(stop_cluster=True)
    server.stop(grace=1.0).wait(3.0)
    if metrics is not None:
        metrics.stop()
    if hook is not None:
        hook.stop()
    log.info("coordinator_stopped", "cluster stopped; coordinator exiting")
    return 0


if __name__ == "__main__":
    sys.exit(main())
