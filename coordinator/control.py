"""The coordinator's control service for dsv41ctl, on a unix socket (0660 root:dsv41)."""

from __future__ import annotations

import grp
import os
import queue
import tempfile
import threading
import time
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor

import grpc

from dsv41.v1 import agent_pb2 as apb
from dsv41.v1 import control_pb2 as pb
from dsv41.v1 import control_pb2_grpc
from dsv41.version import VERSION

from . import plan as plan_mod
from .agents import AgentClient, AgentUnavailable
from .packstate import incomplete
from .config import ClusterConfig
from .runtime import ClusterRuntime, Incident, Snapshot
from .sockets import CONTROL_GROUP, CONTROL_SOCKET



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
            out.agent_error = f"{exc.code}: {exc.details}"
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
        endpoint=f"http://{cfg['HEAD_IP']}:{cfg['PORT']}" if snap.phase == "serving" else "",
        ranks_running=ranks_running, ranks_total=len(cfg.nodes), serving_since_unix_s=snap.serving_since,
        last_incident=incident_pb(snap.last_incident), nodes=views, coordinator_version=VERSION,
        config_path=cfg.path, restart_attempt=snap.restart_attempt, coordinator_running=running,
        generation=snap.generation)


BUNDLE_CHUNK = 1 << 20


def bundle_sources(cfg: ClusterConfig, status: pb.ClusterStatus, incidents: list, launched: dict,
                   made_by: str):
    from .bundle import Sources
    try:
        with open(cfg.path, "rb") as f:
            text = f.read(1 << 20)
    except OSError as exc:
        text = f"cannot read {cfg.path}: {exc.strerror}\n".encode()
    return Sources(status, incidents, launched, text, made_by)


class ControlService(control_pb2_grpc.ControlServicer):
    def __init__(self, cfg: ClusterConfig, runtime: ClusterRuntime, api_key: str | None = None):
        self._cfg = cfg
        self._runtime = runtime
        self._api_key = api_key  # removed from every file of a bundle
        self._event_lock = threading.Lock()
        self._subscribers: list[queue.Queue] = []
        runtime.on_incident(self._publish)

    def _publish(self, incident: Incident) -> None:
        with self._event_lock:
            subscribers = list(self._subscribers)
        for q in subscribers:
            q.put(incident)

    def _status(self) -> pb.ClusterStatus:
        snap = self._runtime.snapshot()
        views = node_views(self._cfg, self._runtime.clients, snap.fingerprints, snap.fabric,
                           liveness=self._runtime.liveness_views())
        return cluster_status(self._cfg, snap, views, True)

    def GetStatus(self, request, context):
        return self._status()

    def _act(self, action: str, message: str):
        self._runtime.request(action)
        return pb.ActionReply(ok=True, message=message, status=self._status())

    def Start(self, request, context):
        return self._act("start", "start requested")

    def Stop(self, request, context):
        return self._act("stop", "stop requested")

    def Restart(self, request, context):
        return self._act("restart", "restart requested")

    def Events(self, request, context):
        q: queue.Queue = queue.Queue()
        with self._event_lock:
            self._subscribers.append(q)
        try:
            history = self._runtime.incidents()
            for incident in history[-(request.last or 50):]:
                yield _event(incident)
            while request.follow and context.is_active():
                try:
                    yield _event(q.get(timeout=1.0))
                except queue.Empty:
                    continue
        finally:
            with self._event_lock:
                self._subscribers.remove(q)

    def Logs(self, request, context):
        nodes = [n for n in self._cfg.nodes if not request.node or n.name == request.node]
        if not nodes:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"no node {request.node!r}")
        lines: queue.Queue = queue.Queue(maxsize=10_000)
        streams = []
        finished = threading.Semaphore(0)

        def pump(node: str) -> None:
            try:
                stream = self._runtime.clients[node].read_journal(request.lines or 50, request.follow)
                streams.append(stream)
                for line in stream:
                    lines.put(line)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.CANCELLED:
                    lines.put(apb.JournalLine(node=node, priority="err",
                                              message=f"cannot read the journal: {exc.details()}"))
            finally:
                finished.release()

        threads = [threading.Thread(target=pump, args=(n.name,), daemon=True) for n in nodes]
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
            while not lines.empty():
                yield lines.get_nowait()
        finally:
            for stream in streams:
                stream.cancel()

    def Pack(self, request, context):
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

    def AutotuneReset(self, request, context):
        ok, message = self._runtime.autotune_reset()
        return pb.ActionReply(ok=ok, message=message)

    def Bundle(self, request, context):
        from .bundle import BundleWriter
        if request.journal_max_bytes > 64 << 20:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "journal_max_bytes: at most 64 MiB")
        snap = self._runtime.snapshot()
        sources = bundle_sources(self._cfg, self._status(), self._runtime.incidents(), dict(snap.fingerprints),
                                 f"the running dsv41-coordinator {VERSION}")
        writer = BundleWriter(self._cfg, self._runtime.clients, [self._api_key] if self._api_key else [])
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
        ok, message = self._runtime.unexport(bool(request.force), bool(request.unmount))
        return pb.ActionReply(ok=ok, message=message, status=self._status())


def _event(incident: Incident) -> apb.Event:
    return apb.Event(at_unix_s=incident.at_unix_s, node=incident.node, kind=incident.kind, priority="err",
                     message=incident.message)


def serve(cfg: ClusterConfig, runtime: ClusterRuntime, socket_path: str = CONTROL_SOCKET,
          api_key: str | None = None) -> grpc.Server:
    os.makedirs(os.path.dirname(socket_path), mode=0o755, exist_ok=True)
    try:
        os.unlink(socket_path)
    except FileNotFoundError:
        pass
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="control"))
    control_pb2_grpc.add_ControlServicer_to_server(ControlService(cfg, runtime, api_key), server)
    old = os.umask(0o117)  # the socket is born 0660: no window where others could connect
    try:
        server.add_insecure_port(f"unix:{socket_path}")
    finally:
        os.umask(old)
    try:
        os.chown(socket_path, 0, grp.getgrnam(CONTROL_GROUP).gr_gid)
    except (KeyError, PermissionError):
        pass  # no dsv41 group (source checkout): root only
    os.chmod(socket_path, 0o660)
    server.start()
    return server

