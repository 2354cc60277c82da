"""The coordinator's control service for dsv41ctl, on unix sockets: control.sock (0660 root:dsv41)
for everything, status.sock (0660 root:dsv41-read) for what only reads.

Both sockets belong to a relay (dsv41/relay.py) that counts connections and tells the service who
called (SO_PEERCRED): every action is a journal event with the caller's uid, and an action asked
on the read-only socket is refused. Streams are bounded (MAX_STREAMS) so that followers cannot take
every thread, and end with their caller.
"""

from __future__ import annotations

import grp
import os
import pwd
import queue
import tempfile
import threading
import time
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from dsv41.journal import EventLog
from dsv41.relay import Limits, Peer, Relay, parse_peer
from dsv41.v1 import agent_pb2 as apb
from dsv41.v1 import control_pb2 as pb
from dsv41.v1 import control_pb2_grpc
from dsv41.version import VERSION

from . import plan as plan_mod
from .agents import AgentClient, AgentUnavailable
from .packstate import incomplete
from .config import ClusterConfig
from .drain import OPERATOR_REASON as DRAIN_REASON
from .grouped import GroupedRuntime, fill_status
from .runtime import ClusterRuntime, Incident, Snapshot
from .sockets import CONTROL_GROUP, CONTROL_SOCKET, STATUS_GROUP, private_socket, status_socket
from .state import Phase

MAX_WORKERS = 32
MAX_STREAMS = 16  # events/logs/pack streams at once; unary calls always find a thread
MAX_CONNECTIONS = 64
MAX_CONNECTIONS_PER_USER = 32
# What the read-only socket answers; everything else changes the cluster.
READ_ONLY = frozenset({"GetStatus", "Events", "Logs", "Pack"})


@dataclass(frozen=True)
class Caller:
    uid: int
    pid: int
    user: str
    socket: str  # "control" or "status"; "internal" for a root process on the private socket

    def describe(self) -> str:
        return f"uid {self.uid} ({self.user}, pid {self.pid}) on {self.socket}.sock"


def caller_of(context) -> Caller:
    peer: Peer | None = parse_peer(context.peer())
    if peer is None or peer.uid < 0:
        # Only root reaches the private socket directly (its directory is 0700).
        return Caller(0, 0, "root", "internal")
    try:
        user = pwd.getpwuid(peer.uid).pw_name
    except KeyError:
        user = str(peer.uid)
    return Caller(peer.uid, peer.pid, user, peer.tag)



def node_views(cfg: ClusterConfig, clients: dict[str, AgentClient], fingerprints: dict, fabric: dict,
               timeout: float = 3.0, liveness: dict | None = None) -> list[pb.NodeView]:
    """Asks every agent for its status at once; an unreachable agent is a view with its error.
    `liveness`: node -> (lease age, step age, forward count) as the coordinator's leases know them."""
    def view(node) -> pb.NodeView:
        lease_age, step_age, count = (liveness or {}).get(node.name, (-1.0, -1.0, 0))
        out = pb.NodeView(name=node.name, rank=node.rank, address=node.address,
                          plan_fingerprint=fingerprints.get(node.name, ""), lease_age_s=lease_age,
                          step_age_s=step_age, forward_count=count)
        if node.name in fabric:
            out.fabric.CopyFrom(fabric[node.name])
        try:
            out.status.CopyFrom(clients[node.name].status(timeout=timeout, wait_for_ready=True))
            out.agent_reachable = True
        except AgentUnavailable as exc:
            # Silent since its last heartbeat, when the coordinator has its lease; at least this call's timeout.
            out.agent_error = exc.meaning(max(lease_age, exc.waited_s or timeout))
        return out
    with ThreadPoolExecutor(max_workers=len(cfg.nodes)) as pool:
        return list(pool.map(view, cfg.nodes))


def incident_pb(incident: Incident | None) -> pb.Incident | None:
    if incident is None:
        return None
    return pb.Incident(at_unix_s=incident.at_unix_s, node=incident.node, kind=incident.kind,
                       message=incident.message)


def cluster_status(cfg: ClusterConfig, snap: Snapshot, views: list[pb.NodeView], running: bool) -> pb.ClusterStatus:
    ranks_running = sum(1 for v in views if v.agent_reachable and v.status.rank.active_state == "active")
    return pb.ClusterStatus(
        phase=snap.phase, phase_detail=snap.detail, phase_since_unix_s=snap.since,
        endpoint=f"http://{cfg.text('HEAD_IP')}:{cfg.integer('PORT')}" if snap.phase == Phase.SERVING else "",
        ranks_running=ranks_running, ranks_total=len(cfg.nodes), serving_since_unix_s=snap.serving_since,
        last_incident=incident_pb(snap.last_incident), nodes=views, coordinator_version=VERSION,
        config_path=cfg.path, restart_attempt=snap.restart_attempt, coordinator_running=running,
        generation=snap.generation, collective=snap.collective)


BUNDLE_CHUNK = 1 << 20
# Not an incident: the line `dsv41ctl events` shows between earlier coordinators' incidents and this one's.
COORDINATOR_STARTED = "coordinator_started"


def bundle_sources(cfg: ClusterConfig, status: pb.ClusterStatus, incidents: list, launched: dict,
                   made_by: str):
    from .bundle import Sources
    try:
        with open(cfg.path, "rb") as f:
            text = f.read(1 << 20)
    except OSError as exc:
        text = f"cannot read {cfg.path}: {exc.strerror}\n".encode()
    return Sources(status, incidents, launched, text, made_by)


class Fixed:
    """One configuration and runtime for the service's lifetime (tests, and tools that embed it)."""

    def __init__(self, cfg: ClusterConfig, runtime: ClusterRuntime, api_key: str | None):
        self.cfg, self.runtime, self.api_key = cfg, runtime, api_key

    def on_incident(self, listener) -> None:
        self.runtime.on_incident(listener)


class ControlService(control_pb2_grpc.ControlServicer):
    """`live`: where the configuration and runtime of the moment are read (the daemon's
    reconfig.Coordinator, whose config apply replaces them; Fixed otherwise)."""

    def __init__(self, cfg: ClusterConfig, runtime: ClusterRuntime | None, log: EventLog | None = None,
                 max_streams: int = MAX_STREAMS, api_key: str | None = None, live=None):
        self._live = live if live is not None else Fixed(cfg, runtime, api_key)
        self._log = log or EventLog("dsv41-coordinator", {"DSV41_NODE": cfg.head.name})
        self._event_lock = threading.Lock()
        self._subscribers: list[queue.Queue] = []
        self._streams = threading.BoundedSemaphore(max_streams)
        self._max_streams = max_streams
        self._live.on_incident(self._publish)

    @property
    def _cfg(self) -> ClusterConfig:
        return self._live.cfg

    @property
    def _runtime(self) -> ClusterRuntime:
        return self._live.runtime

    def _authorize(self, context, method: str, action: bool = True) -> Caller:
        """The caller; an action (`action`) on the read-only socket is refused, and every action is
        a journal event naming the caller's uid."""
        caller = caller_of(context)
        if not action:
            return caller
        fields = dict(caller_uid=caller.uid, caller_user=caller.user, caller_pid=caller.pid, method=method,
                      socket=caller.socket)
        if caller.socket == "status":
            self._log.warning("control_refused", f"refused {method} from {caller.describe()}: the read-only socket "
                              "only reads", **fields)
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"{method} changes the cluster: it needs the control socket (group {CONTROL_GROUP}); "
                          f"the {STATUS_GROUP} group may only read (status, events, logs)")
        self._log.event("control_call", f"{method} requested by {caller.describe()}", "notice", **fields)
        return caller

    def _stream(self, context, method: str):
        """Takes one of MAX_STREAMS; RESOURCE_EXHAUSTED when all are in use. Released when the RPC
        ends for any reason, the caller going away included."""
        if not self._streams.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{method}: {self._max_streams} dsv41ctl streams are open already (events -f, logs -f, "
                          "pack): end one and try again")
        released = threading.Event()

        def release() -> None:
            if not released.is_set():
                released.set()
                self._streams.release()
        context.add_callback(release)
        return release

    def _publish(self, incident: Incident) -> None:
        with self._event_lock:
            subscribers = list(self._subscribers)
        for q in subscribers:
            q.put(incident)

    def _status(self) -> pb.ClusterStatus:
        snap = self._runtime.snapshot()
        views = node_views(self._cfg, self._runtime.clients, snap.fingerprints, snap.fabric,
                           liveness=self._runtime.liveness_views())
        status = cluster_status(self._cfg, snap, views, True)
        if isinstance(self._runtime, GroupedRuntime):
            fill_status(status, self._runtime)
        if hasattr(self._live, "note"):
            status.config_note = self._live.note()
        return status

    def GetStatus(self, request, context):
        return self._status()

    def _act(self, context, method: str, action: str, message: str):
        caller = self._authorize(context, method)
        self._runtime.request(action)
        return pb.ActionReply(ok=True, message=f"{message} (by {caller.user})", status=self._status())

    def Start(self, request, context):
        return self._act(context, "Start", "start", "start requested")

    def Stop(self, request, context):
        return self._act(context, "Stop", "stop", "stop requested")

    def Restart(self, request, context):
        if isinstance(self._runtime, GroupedRuntime):
            return self._act(context, "Restart", "restart", "rolling restart requested: one group at a time, each "
                             "taken out of the gateway and drained first, never the only group serving")
        if not request.drain:
            return self._act(context, "Restart", "restart", "restart requested")
        caller = self._authorize(context, "Restart")
        self._runtime.request("restart", DRAIN_REASON, drain=True)
        timeout = self._cfg.number("DRAIN_TIMEOUT_S")
        what = (f"rank 0 refuses new requests and lets those in flight finish for up to {timeout:g} s "
                "(DRAIN_TIMEOUT_S), then the ranks restart") if timeout > 0 else \
            "DRAIN_TIMEOUT_S=0: the ranks restart without a drain"
        return pb.ActionReply(ok=True, message=f"drained restart requested (by {caller.user}): {what}",
                              status=self._status())

    def Events(self, request, context):
        release = self._stream(context, "Events")
        q: queue.Queue = queue.Queue(maxsize=1024)
        with self._event_lock:
            self._subscribers.append(q)
        try:
            history = self._runtime.incidents()
            shown = history[-(request.last or 50):]
            # The first `earlier` came from the history on disk: a line marks where this coordinator began.
            earlier = max(0, self._runtime.earlier_incidents() - (len(history) - len(shown)))
            yield from (_event(incident) for incident in shown[:earlier])
            if earlier:
                yield self._started_event(earlier)
            yield from (_event(incident) for incident in shown[earlier:])
            while request.follow and context.is_active():
                try:
                    yield _event(q.get(timeout=1.0))
                except queue.Empty:
                    continue
        finally:
            with self._event_lock:
                self._subscribers.remove(q)
            release()

    def _started_event(self, earlier: int) -> apb.Event:
        return apb.Event(at_unix_s=self._runtime.started_unix_s, node=self._cfg.head.name, kind=COORDINATOR_STARTED,
                         priority="info", message=f"dsv41-coordinator started; the {earlier} incident(s) above are "
                         "from before it, kept in its incident history")

    def Logs(self, request, context):
        nodes = [n for n in self._cfg.nodes if not request.node or n.name == request.node]
        if not nodes:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"no node {request.node!r}")
        release = self._stream(context, "Logs")
        lines: queue.Queue = queue.Queue(maxsize=10_000)
        streams: list = []
        streams_lock = threading.Lock()
        ended = threading.Event()
        finished = threading.Semaphore(0)

        def end() -> None:
            # The caller went away or the stream is over: the agents' journal streams and every
            # pump thread stop with it, instead of blocking on a queue nobody reads.
            ended.set()
            with streams_lock:
                for stream in streams:
                    stream.cancel()
        context.add_callback(end)

        def put(line) -> bool:
            while not ended.is_set():
                try:
                    lines.put(line, timeout=0.2)
                    return True
                except queue.Full:
                    continue
            return False

        def pump(node: str) -> None:
            try:
                stream = self._runtime.clients[node].read_journal(request.lines or 50, request.follow)
                with streams_lock:
                    streams.append(stream)
                    if ended.is_set():
                        stream.cancel()
                for line in stream:
                    if not put(line):
                        break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.CANCELLED:
                    put(apb.JournalLine(node=node, priority="err", message=f"cannot read the journal: {exc.details()}"))
            finally:
                finished.release()

        threads = [threading.Thread(target=pump, args=(n.name,), name=f"logs-{n.name}", daemon=True) for n in nodes]
        for thread in threads:
            thread.start()
        done = 0
        try:
            while context.is_active() and done < len(threads):
                try:
                    yield lines.get(timeout=0.2)
                except queue.Empty:
                    while finished.acquire(blocking=False):
                        done += 1
            while context.is_active() and not lines.empty():
                yield lines.get_nowait()
        finally:
            end()
            release()

    def Pack(self, request, context):
        if request.start:
            self._authorize(context, "Pack(start)")
        release = self._stream(context, "Pack")
        try:
            yield from self._pack(request, context)
        finally:
            release()

    def _pack(self, request, context):
        plans = {p.node: p for p in plan_mod.render_cluster(self._cfg)}
        clients = self._runtime.clients
        done: set[str] = set()
        try:
            if request.start:
                self._runtime.start_pack()  # the supervisor drives the agents; progress is only read here
            while context.is_active() and len(done) < len(plans):
                for node, node_plan in plans.items():
                    if node in done:
                        continue
                    state = clients[node].pack_state(node_plan)
                    finished = not incomplete(state) or not state.running
                    if finished:
                        done.add(node)
                    yield pb.PackProgress(node=node, state=state, done=finished)
                if len(done) < len(plans):
                    time.sleep(1.0)
        except AgentUnavailable as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except RuntimeError as exc:  # the supervisor was busy and did not get to it
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    def FabricTest(self, request, context):
        self._authorize(context, "FabricTest")
        ok, message = self._runtime.fabric_test()
        report = self._runtime.snapshot().collective
        return pb.FabricTestReply(ok=ok, message=message, report=report)

    def AutotuneReset(self, request, context):
        self._authorize(context, "AutotuneReset")
        ok, message = self._runtime.autotune_reset()
        return pb.ActionReply(ok=ok, message=message)

    def Bundle(self, request, context):
        from .bundle import BundleWriter
        self._authorize(context, "Bundle")  # every node's logs: not for the read-only socket
        if request.journal_max_bytes > 64 << 20:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "journal_max_bytes: at most 64 MiB")
        snap = self._runtime.snapshot()
        sources = bundle_sources(self._cfg, self._status(), self._runtime.incidents(), dict(snap.fingerprints),
                                 f"the running dsv41-coordinator {VERSION}")
        writer = BundleWriter(self._cfg, self._runtime.clients, [self._live.api_key] if self._live.api_key else [])
        # A bundle can hold tens of MiB of journals: spooled to the coordinator's private /tmp, not held in memory.
        with tempfile.TemporaryFile(prefix="dsv41-bundle.") as spool:
            notes = writer.write(spool, sources, request.journal_max_bytes)
            spool.seek(0)
            while context.is_active():
                data = spool.read(BUNDLE_CHUNK)
                if not data:
                    break
                yield pb.BundleChunk(data=data)
            yield pb.BundleChunk(notes=notes)

    def UnexportShare(self, request, context):
        self._authorize(context, "UnexportShare" + ("(force)" if request.force else "")
                        + ("(unmount)" if request.unmount else ""))
        ok, message = self._runtime.unexport(bool(request.force), bool(request.unmount))
        return pb.ActionReply(ok=ok, message=message, status=self._status())


    def Config(self, request, context):
        action = pb.ConfigRequest.Action.Name(request.action)
        if request.action == pb.ConfigRequest.DIFF:
            caller = self._authorize(context, "Config(DIFF)", action=False)  # reads, but shows the file's values:
            if caller.socket == "status":  # the control socket's group only, as the file itself is
                context.abort(grpc.StatusCode.PERMISSION_DENIED, "config diff shows cluster.env's values: it "
                              f"needs the control socket (group {CONTROL_GROUP})")
            outcome = self._live.diff() if hasattr(self._live, "diff") else None
        else:
            caller = self._authorize(context, f"Config({action})")
            if not hasattr(self._live, "apply"):
                outcome = None
            elif request.action == pb.ConfigRequest.APPLY:
                outcome = self._live.apply(caller.user)
            else:
                outcome = self._live.rollback(caller.user)
        if outcome is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this coordinator cannot change its configuration")
        return config_reply(outcome)


def config_reply(outcome) -> pb.ConfigReply:
    reply = pb.ConfigReply(ok=outcome.ok, message=outcome.message)
    if outcome.diff is not None:
        reply.restarts_ranks = outcome.diff.restarts_ranks
        for c in outcome.diff.changes:
            reply.changes.add(key=c.key, before=c.before or "", after=c.after or "", before_set=c.before is not None,
                              after_set=c.after is not None, effect=str(c.effect))
    return reply


def _event(incident: Incident) -> apb.Event:
    return apb.Event(at_unix_s=incident.at_unix_s, node=incident.node, kind=incident.kind, priority="err",
                     message=incident.message)


def _gid(name: str) -> int | None:
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        return None  # no such group (a source checkout): root only


class ControlServer:
    """The gRPC server on its private socket and the relay that owns the public ones."""

    def __init__(self, server: grpc.Server, relay: Relay):
        self.server = server
        self.relay = relay

    def stop(self, grace: float | None = None) -> threading.Event:
        self.relay.stop()
        return self.server.stop(grace)


def server_options() -> list[tuple[str, int]]:
    return [("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1), ("grpc.max_connection_idle_ms", 600_000),
            ("grpc.max_concurrent_streams", 32)]


def serve(cfg: ClusterConfig, runtime: ClusterRuntime | None, socket_path: str = CONTROL_SOCKET,
          log: EventLog | None = None, api_key: str | None = None, live=None) -> ControlServer:
    """control.sock and status.sock beside it, through the relay; the gRPC server itself on a socket
    in a 0700 directory."""
    directory = os.path.dirname(socket_path) or "."
    os.makedirs(directory, mode=0o755, exist_ok=True)
    private = private_socket(socket_path)
    os.makedirs(os.path.dirname(private), mode=0o700, exist_ok=True)
    os.chmod(os.path.dirname(private), 0o700)
    try:
        os.unlink(private)
    except FileNotFoundError:
        pass
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=MAX_WORKERS, thread_name_prefix="control"),
                         options=server_options(), maximum_concurrent_rpcs=MAX_WORKERS - 4)
    control_pb2_grpc.add_ControlServicer_to_server(ControlService(cfg, runtime, log, api_key=api_key, live=live),
                                                     server)
    server.add_insecure_port(f"unix:{private}")
    log = log or EventLog("dsv41-coordinator", {"DSV41_NODE": cfg.head.name})
    relay = Relay(private, Limits(MAX_CONNECTIONS, MAX_CONNECTIONS_PER_USER),
                  refused=lambda peer, why: log.warning("control_connection_refused", why, source=peer.source_key))
    relay.listen_unix(socket_path, "control", mode=0o660, group=_gid(CONTROL_GROUP))
    relay.listen_unix(status_socket(socket_path), "status", mode=0o660, group=_gid(STATUS_GROUP))
    server.start()
    relay.start()
    return ControlServer(server, relay)
