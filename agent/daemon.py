"""dsv41-agent: the node agent daemon (Type=notify).

It re-adopts an existing rank unit, serves the agent gRPC service, reports READY=1 once serving,
keeps STATUS= current and pets the watchdog. SIGTERM stops serving and never touches the rank.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc

from dsv41.adapterversion import InstalledAdapter
from dsv41.journal import EventLog
from dsv41.relay import Limits, Relay
from dsv41.v1 import agent_pb2_grpc
from dsv41.version import VERSION

from . import settings as settings_mod
from .auth import CallerCheck, CredentialFiles, PinFile
from .container import ContainerProcesses, signal_rank
from .events import EventHub
from .fabric.watch import FabricWatch
from .floor import NodeFloor
from .gpu.telemetry import GpuTelemetry
from .memory import MemorySampler, PsiTrigger, RankMemoryReader, TriggerWatcher
from .rank import RankManager
from .rankspec import RANK_UNIT
from dsv41.sdnotify import SdNotify
from .service import AgentService, build_handlers, ensure_dirs
from .treewatch import ProcessTreeWatch
from .systemd import Systemd, SystemdError


def _credentials(s: settings_mod.AgentSettings, log: EventLog) -> grpc.ServerCredentials | None:
    """Mutual TLS with the cluster CA; a rotated certificate is picked up from the next connection on."""
    if not s.tls:
        return None
    files = CredentialFiles(s.tls_ca, s.tls_cert, s.tls_key,
                            problem=lambda why: log.warning("tls_reload_failed", why))
    return files.server_credentials()


RUNTIME_DIR = "/run/dsv41-agent"  # RuntimeDirectory= of the unit, 0700: the real gRPC socket lives here
MAX_WORKERS = 64
MAX_CONCURRENT_RPCS = 48  # beyond this, RESOURCE_EXHAUSTED at once instead of a queue without end


def server_options(s: settings_mod.AgentSettings) -> list[tuple[str, int]]:
    """gRPC server settings: a caller that never finishes its TLS handshake is dropped after
    TLS_HANDSHAKE_TIMEOUT_S (gRPC's default is 120 s), a silent peer within half a minute."""
    return [("grpc.max_receive_message_length", 8 << 20),
            ("grpc.server_handshake_timeout_ms", int(s.handshake_timeout_s * 1000)),
            ("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
            # the coordinator pings every 10 s while it streams: not "too many pings"
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
            ("grpc.http2.max_ping_strikes", 3),
            ("grpc.max_concurrent_streams", 32),
            ("grpc.max_connection_idle_ms", 600_000)]


def runtime_dir() -> str:
    given = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    return given or RUNTIME_DIR


def _status_line(s: settings_mod.AgentSettings, rank: RankManager) -> str:
    state = rank.status()
    rank_text = f"rank {state.active_state}" + (f" pid {state.main_pid}" if state.main_pid else "")
    return f"serving on {s.listen}; {rank_text}"


class _StartFailed(Exception):
    """The agent cannot start: `event` and the text go to the journal, `code` is the exit status."""

    def __init__(self, code: int, text: str, event: str = "agent_failed") -> None:
        super().__init__(text)
        self.code, self.event = code, event


@dataclass
class _Watches:
    """What runs beside the gRPC service and is stopped with it."""
    floor: NodeFloor
    tree: ProcessTreeWatch
    triggers: TriggerWatcher

    def stop(self) -> None:
        self.triggers.stop()
        self.floor.stop()
        self.tree.stop()


def _start_watches(s: settings_mod.AgentSettings, log: EventLog, events: EventHub, systemd: Systemd,
                   rank: RankManager) -> _Watches:
    # The node's last line runs before anything else can be asked of the agent: a rank it re-adopts
    # is guarded at once. Its own sampler: the streams' is read from their threads.
    container = ContainerProcesses()
    floor = NodeFloor(rank, MemorySampler(),
                      lambda signum: signal_rank(lambda n: systemd.kill(RANK_UNIT, n), container, signum),
                      events, s.node)
    floor.start()
    tree = ProcessTreeWatch(rank, rank.cgroup_roots)
    tree.start()
    trigger = PsiTrigger()
    if not trigger.armed:
        log.warning("psi_trigger_unavailable", f"PSI trigger not armed ({trigger.error}); sampling only")
    return _Watches(floor, tree, TriggerWatcher(trigger))


def _tls(s: settings_mod.AgentSettings, log: EventLog, config: str
         ) -> tuple[grpc.ServerCredentials | None, PinFile | None]:
    try:
        creds = _credentials(s, log)
    except (OSError, ValueError) as exc:
        raise _StartFailed(2, f"unusable TLS files (TLS_CA/TLS_CERT/TLS_KEY in {config}): {exc}") from exc
    if not creds:
        return None, None
    try:
        return creds, PinFile(s.tls_pin, problem=lambda why: log.warning("tls_pin_reload_failed", why))
    except ValueError as exc:
        raise _StartFailed(2, f"TLS_PIN: {exc}") from exc


def _grpc_server(s: settings_mod.AgentSettings, events: EventHub, service: AgentService,
                 creds: grpc.ServerCredentials | None, pins: PinFile | None, upstream: str) -> grpc.Server:
    """The service on `upstream`, a socket only root can reach; the port is the relay's, which counts
    connections."""
    # TLS proves the caller holds a cluster certificate; only the coordinator's, and only the one
    # this node's bundle pins, may drive this node (a rotated-away certificate is refused).
    interceptors = [CallerCheck(s.coordinator_name, lambda method, why: events.warning(
        "caller_refused", f"refused {method}: {why}", method=method),
        pins.pins if pins else None)] if creds else []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=MAX_WORKERS, thread_name_prefix="rpc"),
                         options=server_options(s), interceptors=interceptors,
                         maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS)
    agent_pb2_grpc.add_AgentServicer_to_server(service, server)
    private = os.path.dirname(upstream)
    os.makedirs(private, mode=0o700, exist_ok=True)
    os.chmod(private, 0o700)
    try:
        os.unlink(upstream)
    except FileNotFoundError:
        pass
    try:
        bound = server.add_secure_port(f"unix:{upstream}", creds) if creds else \
            server.add_insecure_port(f"unix:{upstream}")
    except RuntimeError as exc:
        raise _StartFailed(1, f"cannot listen on {upstream}: {exc}") from exc
    if not bound:
        raise _StartFailed(1, f"cannot listen on {upstream}: cannot bind")
    return server


def _relay(s: settings_mod.AgentSettings, events: EventHub, upstream: str) -> Relay:
    relay = Relay(upstream, Limits(s.max_connections, s.max_connections_per_source),
                  refused=lambda peer, why: events.warning("connection_refused", why, source=peer.source_key))
    host, _, port = s.listen.rpartition(":")
    try:
        relay.listen_tcp(host.strip("[]"), int(port), "agent")
    except OSError as exc:
        raise _StartFailed(1, f"cannot listen on {s.listen}: {exc.strerror or exc}") from exc
    return relay


def _serve_until_stopped(s: settings_mod.AgentSettings, rank: RankManager, notify: SdNotify) -> None:
    """READY=1, then STATUS= kept current and the watchdog petted until SIGTERM or SIGINT."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    notify.ready(_status_line(s, rank))
    watchdog_usec = int(os.environ.get("WATCHDOG_USEC", "0") or 0)
    period = watchdog_usec / 2e6 if watchdog_usec else 10.0
    last_status = ""
    while not stop.wait(min(period, 10.0)):
        if watchdog_usec:
            notify.watchdog()
        line = _status_line(s, rank)
        if line != last_status:
            notify.status(line)
            last_status = line
    notify.stopping()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dsv41-agent", description="dsv41 node agent")
    parser.add_argument("--config", default=settings_mod.DEFAULT_PATH, help="agent.env (default %(default)s)")
    parser.add_argument("--version", action="version", version=VERSION)
    args = parser.parse_args(argv)
    try:
        s = settings_mod.load(args.config)
    except settings_mod.SettingsError as exc:
        print(f"<3>dsv41-agent: invalid configuration:\n{exc}", file=sys.stderr)
        return 2

    started = time.monotonic()
    log = EventLog("dsv41-agent", {"DSV41_NODE": s.node})
    events = EventHub(log)
    ensure_dirs(s)
    try:
        systemd = Systemd()
        # Not the state directory: `python -m` would import from it, and PutFile writes there.
        rank = RankManager(systemd, s.node, events, working_directory=s.rank_cache_dir,
                           installed_adapter=InstalledAdapter(s.adapter_dir).version)
        rank.adopt()
    except SystemdError as exc:
        log.error("agent_failed", f"cannot reach systemd over D-Bus: {exc}")
        return 1
    sampler = MemorySampler(rank_memory=RankMemoryReader(rank.control_group))
    watches = _start_watches(s, log, events, systemd, rank)
    gpus = GpuTelemetry(log=log)
    # NVML's first open can take a second without persistence mode: not in the first status call.
    threading.Thread(target=gpus.read, name="gpu-open", daemon=True).start()
    fabric = FabricWatch(events, s.sysfs_root, s.state_dir).start()
    try:
        creds, pins = _tls(s, log, args.config)
        service = AgentService(build_handlers(s, systemd, rank, sampler, watches.triggers, events, started,
                                              gpus=gpus, fabric=fabric))
        upstream = os.path.join(runtime_dir(), "agent.sock")
        server = _grpc_server(s, events, service, creds, pins, upstream)
        relay = _relay(s, events, upstream)
    except _StartFailed as exc:
        log.error(exc.event, str(exc))
        return exc.code
    if creds is None:
        log.warning("agent_insecure", f"serving on {s.listen} WITHOUT TLS (INSECURE_NO_TLS=1): anyone who can "
                    "reach this port can start processes as root")
    server.start()
    relay.start()
    log.info("agent_started", f"dsv41-agent {VERSION} serving on {s.listen}", version=VERSION, listen=s.listen)
    _serve_until_stopped(s, rank, SdNotify.from_env())

    log.info("agent_stopping", "dsv41-agent stopping; the rank unit is left as it is")
    relay.stop()
    server.stop(grace=2.0).wait(5.0)
    watches.stop()
    fabric.stop()
    gpus.close()
    systemd.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
