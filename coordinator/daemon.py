"""dsv41-coordinator: brings the cluster up, keeps it serving, and brings it down on stop (Type=notify).

READY=1 is sent when the coordinator is up (not when the 12-minute model load ends); STATUS=
shows the phase. On SIGTERM it asks systemd which job runs for its unit (coordinator/stopjob.py):
in a stop job (`systemctl stop`, shutdown, package removal) it stops rank 0 first, then the
workers, and confirms on every node that no rank is left; in a restart job (`systemctl restart`,
a package upgrade) it exits leaving the ranks serving. A SIGTERM without a job (`kill`) or when
systemd cannot be asked also leaves them serving, with a warning: an outage the operator did not
ask for costs a 12-minute model load, while `systemctl stop` or `dsv41ctl stop` stop the cluster
on request. SIGKILL or a crash leaves the ranks serving too; started again, the coordinator
re-adopts ranks that run the current plans. Exit status is 0 either way (Restart=on-failure).
Run by hand, not as a systemd service, SIGTERM or Ctrl-C stops the cluster: nothing would restart it.
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
from .configstore import ConfigStore
from .groups import is_grouped
from .control import serve
from .reconfig import Coordinator, first_config
from .runtime import ClusterRuntime
from .session import Unusable, credentials
from .stopjob import StopDecision, SystemdJobQuery
from .sockets import CONTROL_SOCKET
from .state import Phase

DEFAULT_CONFIG = "/etc/dsv41/cluster.env"
STATE_DIR = "/var/lib/dsv41/coordinator"


def status_line(runtime: ClusterRuntime, clock=time.time) -> str:
    snap = runtime.snapshot()
    if snap.phase == Phase.SERVING:
        up = int(clock() - snap.serving_since)
        total = len(runtime.clients)
        running = sum(1 for r in snap.ranks.values() if r.active_state == "active")
        port = runtime.cfg.integer("GATEWAY_PORT") if is_grouped(runtime.cfg) else runtime.cfg.integer("PORT")
        return f"serving on :{port}, {running}/{total} ranks, up {up // 3600}h{up % 3600 // 60:02d}m"
    return f"{snap.phase}" + (f": {snap.detail}" if snap.detail else "")


def log_stopping(log: EventLog, notify: SdNotify, decision: StopDecision) -> None:
    """The journal event and the STATUS= line for a SIGTERM, saying whether the ranks are stopped."""
    fields = {"job_type": decision.job_type or "none", "ranks_kept": "no" if decision.stop_cluster else "yes"}
    if decision.stop_cluster:
        notify.status("stopping the cluster: rank 0 first, then the workers")
        log.info("coordinator_stopping", f"stopping the cluster: {decision.reason}", **fields)
    elif decision.certain:
        notify.status("exiting; the ranks are left serving for the next coordinator")
        log.info("coordinator_stopping", f"exiting, ranks left serving: {decision.reason}", **fields)
    else:
        notify.status("exiting; the ranks are left serving (SIGTERM without a stop job)")
        log.warning("coordinator_stopping", f"exiting, ranks left serving: {decision.reason}", **fields)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dsv41-coordinator", description="dsv41 cluster coordinator")
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--control-socket", default=CONTROL_SOCKET)
    parser.add_argument("--state-dir", default=STATE_DIR)
    parser.add_argument("--no-autostart", action="store_true", help="wait for `dsv41ctl start`")
    parser.add_argument("--version", action="version", version=VERSION)
    args = parser.parse_args(argv)
    store = ConfigStore(os.path.join(args.state_dir, "config"))
    try:
        cfg, text, not_file = first_config(args.config, store)
    except config_mod.ConfigInvalid as exc:
        print(f"<3>dsv41-coordinator: {args.config} is invalid; nothing was started:\n{exc}", file=sys.stderr)
        return 2
    log = EventLog("dsv41-coordinator", {"DSV41_NODE": cfg.head.name})
    if not_file:
        log.error("config_not_used", not_file, config=args.config)
    coordinator = Coordinator(args.config, store, log, args.state_dir)
    try:
        creds = credentials(cfg)
    except Unusable as exc:
        log.error("coordinator_failed", str(exc))
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    notify = SdNotify.from_env()
    coordinator.start(cfg, text, creds, autostart=not args.no_autostart)
    # After the first session exists: every call reads it (its status says "starting" while it looks for ranks).
    server = serve(cfg, None, args.control_socket, log, api_key=creds.api_key, live=coordinator)
    log.info("coordinator_started", f"dsv41-coordinator {VERSION}: {len(cfg.nodes)} nodes, control socket "
             f"{args.control_socket}", version=VERSION)
    notify.ready(status_line(coordinator.runtime))
    watch(stop, notify, coordinator)
    notify.stopping()
    decision = SystemdJobQuery().decision()  # systemctl stop, or the stop half of a restart?
    log_stopping(log, notify, decision)
    coordinator.stop(stop_cluster=decision.stop_cluster)  # the guard first: it cannot act on a cluster going down
    server.stop(grace=1.0).wait(3.0)
    log.info("coordinator_stopped", f"{'cluster stopped' if decision.stop_cluster else 'ranks left serving'}; "
             "coordinator exiting", ranks_kept="no" if decision.stop_cluster else "yes")
    return 0


def watch(stop: threading.Event, notify: SdNotify, coordinator: Coordinator) -> None:
    """Until SIGTERM: the watchdog's keep-alive and the unit's STATUS= line."""
    watchdog_usec = int(os.environ.get("WATCHDOG_USEC", "0") or 0)
    period = min(2.0, watchdog_usec / 2e6) if watchdog_usec else 2.0
    last = ""
    while not stop.wait(period):
        if watchdog_usec:
            notify.watchdog()
        line = status_line(coordinator.runtime)
        if line != last:
            notify.status(line)
            last = line


if __name__ == "__main__":
    sys.exit(main())
