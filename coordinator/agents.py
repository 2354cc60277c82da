"""The coordinator's view of one node agent: a gRPC client with a deadline on every call."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Iterator

import grpc

from dsv41.v1 import agent_pb2 as pb
from dsv41.v1 import agent_pb2_grpc

from . import transport
from .plan import NodePlan, RankSpec


@dataclass(frozen=True)
class Tls:
    ca: bytes
    cert: bytes
    key: bytes


class AgentUnavailable(Exception):
    """The agent could not be reached or refused; the message names the node and says why."""

    def __init__(self, node: str, what: str, error: grpc.RpcError | Exception, explanation: str | None = None,
                 waited_s: float | None = None):
        code = error.code().name if isinstance(error, grpc.RpcError) else type(error).__name__
        details = error.details() if isinstance(error, grpc.RpcError) else str(error)
        details = explanation or details
        super().__init__(f"{node}: {what}: {code}: {details}")
        self.what = what
        self.node = node
        self.code = code
        self.details = details
        self.error = error
        self.explained = explanation is not None  # a diagnosed cause (e.g. the wrong certificate), not a blip
        self.waited_s = waited_s  # the call's own timeout: a node that let it pass was silent that long

    @property
    def unreachable(self) -> bool:
        """The agent could not be reached (worth waiting for), rather than answered or refused."""
        return transport.unreachable(self.code) and not self.explained

    def meaning(self, silent_s: float | None = None) -> str:
        """What this failure says about the node, for an operator (transport.meaning); `silent_s`:
        how long the node has not answered, when the caller knows better than the call's timeout."""
        if self.explained:
            return self.details
        return transport.meaning(self.code, self.details, self.waited_s if silent_s is None else silent_s)

    def after_waiting(self, seconds: float) -> "AgentUnavailable":
        """The same failure, saying how long the caller waited for it to clear."""
        waited = AgentUnavailable(self.node, self.what, self.error,
                                  f"{self.details} (still unreachable after {seconds:g} s)", self.waited_s)
        waited.explained = self.explained  # a longer message, not a diagnosis
        return waited


def rank_spec_pb(plan: NodePlan, generation: str) -> pb.RankSpec:
    spec = plan.rank_spec
    return launch_pb(spec, fingerprint=plan.fingerprint, rank=plan.rank, cluster_generation=generation,
                     fabric_address=plan.address, hcas=list(plan.fabric.hcas),
                     memory_floor_bytes=spec.memory_floor_bytes,
                     memory_floor_kill_after_ms=spec.memory_floor_kill_after_ms,
                     memory_floor_interval_ms=spec.memory_floor_interval_ms)


def launch_pb(spec: RankSpec, **more) -> pb.RankSpec:
    """What runs and how (a rank's, or the gateway's in the head rank's runtime)."""
    return pb.RankSpec(
        runtime=spec.runtime, argv=list(spec.argv), env=dict(spec.env), agent_fills=dict(spec.agent_fills),
        binds=[pb.Bind(source=b.source, target=b.target, read_only=b.read_only) for b in spec.binds],
        exec_start_pre=[pb.Command(argv=list(c)) for c in spec.exec_start_pre],
        exec_stop_post=[pb.Command(argv=list(c)) for c in spec.exec_stop_post],
        stop_timeout_s=spec.stop_timeout_s, **more)


def fabric_spec_pb(plan: NodePlan) -> pb.FabricSpec:
    f = plan.fabric
    return pb.FabricSpec(hcas=list(f.hcas), iface=f.iface, address=f.address, mtu=f.mtu,
                         socket_ifaces=list(f.socket_ifaces),
                         peers=[pb.Peer(name=p.name, address=p.address, port=p.port) for p in f.peers])


def pack_spec_pb(plan: NodePlan) -> pb.PackSpec:
    p = plan.pack
    return pb.PackSpec(source_dir=p.source_dir, out_dir=p.out_dir, tp=p.tp, ranks=list(p.ranks),
                       layers=list(p.layers))


class AgentClient:
    def __init__(self, node: str, target: str, tls: Tls | None = None, call_timeout_s: float = 10.0,
                 server_name: str | None = None):
        self.node = node
        self.target = target
        self._timeout = call_timeout_s
        self._tls = tls
        self._server_name = server_name or node
        options = [("grpc.max_receive_message_length", 8 << 20), ("grpc.keepalive_time_ms", 10_000),
                   ("grpc.keepalive_timeout_ms", 5_000),
                   # A LAN peer that was down (an agent restarting, a node booting) is tried again
                   # within a second, not after gRPC's backoff of up to 120 s: the node's lease
                   # (NODE_LEASE_S) must not lapse while its agent restarts.
                   ("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
                   ("grpc.max_reconnect_backoff_ms", 1_000)]
        if tls is None:
            self._channel = grpc.insecure_channel(target, options=options)
        else:
            creds = grpc.ssl_channel_credentials(tls.ca, tls.key, tls.cert)
            # The agent's certificate must name this node (its DNS SAN): gRPC checks the name against
            # this override, so another node's agent at this address is refused in the handshake.
            options.append(("grpc.ssl_target_name_override", self._server_name))
            self._channel = grpc.secure_channel(target, creds, options=options)
        self._stub = agent_pb2_grpc.AgentStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def _call(self, what: str, method, request, timeout: float | None = None, wait_for_ready: bool = False):
        timeout = timeout or self._timeout
        try:
            return method(request, timeout=timeout, wait_for_ready=wait_for_ready)
        except grpc.RpcError as exc:
            raise AgentUnavailable(self.node, what, exc, self._tls_problem(exc), timeout) from None

    def _tls_problem(self, exc: grpc.RpcError) -> str | None:
        """A clear reason when the TLS handshake failed over the agent's certificate (wrong node, other CA)."""
        if self._tls is None or exc.code() != grpc.StatusCode.UNAVAILABLE:
            return None
        details = exc.details() or ""
        if not any(word in details for word in ("Peer name", "andshake", "certificate", "SSL", "ssl")):
            return None
        from . import pki  # the certificate code only when a handshake failed
        host, _, port = self.target.rpartition(":")
        problem = pki.peer_certificate_problem(host.strip("[]"), int(port), self._tls.ca, self._tls.cert,
                                               self._tls.key, self._server_name)
        return f"{problem} ({details})" if problem else None

    def status(self, timeout: float | None = None, wait_for_ready: bool = False) -> pb.NodeStatus:
        """wait_for_ready: wait, within the timeout, for a channel that is reconnecting (an agent
        that just restarted) instead of failing at once."""
        return self._call("GetStatus", self._stub.GetStatus, pb.GetStatusRequest(), timeout, wait_for_ready)

    def start_rank(self, plan: NodePlan, generation: str, replace: bool, timeout_s: int) -> pb.StartRankResponse:
        request = pb.StartRankRequest(spec=rank_spec_pb(plan, generation), replace=replace, start_timeout_s=timeout_s)
        return self._call("StartRank", self._stub.StartRank, request, timeout_s + 10)

    def stop_rank(self, deadline_s: int) -> pb.StopRankResponse:
        return self._call("StopRank", self._stub.StopRank, pb.StopRankRequest(deadline_s=deadline_s),
                          deadline_s + 45)

    def run_collective_test(self, spec: pb.CollectiveTestSpec, timeout: float) -> pb.CollectiveTestResult:
        return self._call("RunCollectiveTest", self._stub.RunCollectiveTest, spec, timeout)

    def run_matmul_check(self, spec: pb.MatmulCheckSpec, timeout: float) -> pb.MatmulCheckResult:
        return self._call("RunMatmulCheck", self._stub.RunMatmulCheck, spec, timeout)

    def set_gateway(self, spec: pb.GatewaySpec, timeout: float = 30.0) -> pb.GatewayState:
        """The head's gateway unit started, kept, restarted or stopped (a stop waits up to the unit's
        TimeoutStopSec: give a timeout above spec.stop_timeout_s then)."""
        return self._call("SetGateway", self._stub.SetGateway, spec, timeout)

    def check_fabric(self, plan: NodePlan, timeout: float) -> pb.FabricReport:
        return self._call("CheckFabric", self._stub.CheckFabric, fabric_spec_pb(plan), timeout)

    def ensure_export(self, plan: NodePlan, timeout: float) -> pb.ExportState:
        e = plan.export
        spec = pb.ExportSpec(path=e.path, clients=list(e.clients), options=e.options, backend=e.backend, name=e.name)
        return self._call("EnsureExport", self._stub.EnsureExport, spec, timeout)

    def ensure_mount(self, plan: NodePlan, timeout: float) -> pb.MountState:
        m = plan.mount
        spec = pb.MountSpec(what=m.what, where=m.where, type=m.type, options=m.options, server=m.server,
                            expected_shards=m.expected_shards)
        return self._call("EnsureMount", self._stub.EnsureMount, spec, timeout)

    def get_mount(self, timeout: float | None = None) -> pb.MountState:
        return self._call("GetMount", self._stub.GetMount, pb.GetMountRequest(), timeout)

    def remove_mount(self, timeout: float | None = None) -> pb.MountState:
        return self._call("RemoveMount", self._stub.RemoveMount, pb.RemoveMountRequest(), timeout or 60)

    def remove_export(self, force: bool, mounted_by: list[str], timeout: float | None = None) -> pb.ExportState:
        request = pb.RemoveExportRequest(force=force, mounted_by=list(mounted_by))
        return self._call("RemoveExport", self._stub.RemoveExport, request, timeout or 60)

    def pack_state(self, plan: NodePlan, timeout: float | None = None) -> pb.PackState:
        return self._call("GetPackState", self._stub.GetPackState, pack_spec_pb(plan), timeout)

    def start_pack(self, plan: NodePlan) -> pb.PackState:
        return self._call("StartPack", self._stub.StartPack, pb.StartPackRequest(spec=pack_spec_pb(plan)))

    def put_file(self, name: str, content: bytes, mode: int = 0o644) -> pb.FileDigest:
        return self._call("PutFile", self._stub.PutFile, pb.PutFileRequest(path=name, content=content, mode=mode))

    def remove_file(self, name: str) -> pb.FileDigest:
        return self._call("RemoveFile", self._stub.RemoveFile, pb.RemoveFileRequest(path=name))

    def file_digest(self, name: str) -> pb.FileDigest:
        return self._call("GetFileDigest", self._stub.GetFileDigest, pb.FileDigestRequest(path=name))

    def clear_caches(self, which: str) -> pb.ClearCachesResponse:
        return self._call("ClearCaches", self._stub.ClearCaches, pb.ClearCachesRequest(which=which), 60)

    def read_journal(self, lines: int, follow: bool, units: tuple[str, ...] = ()) -> Iterator[pb.JournalLine]:
        return self._stub.ReadJournal(pb.ReadJournalRequest(lines=lines, follow=follow, units=list(units)),
                                      timeout=None if follow else 30)

    def recent_journal(self, lines: int, units: tuple[str, ...], timeout: float = 30) -> list[pb.JournalLine]:
        """The last `lines` lines of these units (AgentUnavailable when they cannot be read)."""
        try:
            return list(self.read_journal(lines, False, units))
        except grpc.RpcError as exc:
            raise AgentUnavailable(self.node, "ReadJournal", exc, self._tls_problem(exc)) from None

    def collect_diagnostics(self, journal_max_bytes: int, timeout: float) -> Iterator[pb.DiagnosticChunk]:
        """The node's files for dsv41ctl bundle, in chunks (AgentUnavailable when the stream fails)."""
        request = pb.CollectDiagnosticsRequest(journal_max_bytes=journal_max_bytes)
        try:
            yield from self._stub.CollectDiagnostics(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise AgentUnavailable(self.node, "CollectDiagnostics", exc, self._tls_problem(exc)) from None

    def watch_rank(self, on_event: Callable[[pb.RankEvent], None], on_lost: Callable[[str], None],
                   stop: threading.Event, heartbeat_ms: int = 0) -> threading.Thread:
        """Follows the rank unit's state in a thread (with heartbeat_ms, also a heartbeat that often:
        the node's lease); re-subscribes when the stream breaks."""
        def run() -> None:
            while not stop.is_set():
                stream = self._stub.WatchRank(pb.WatchRankRequest(heartbeat_ms=heartbeat_ms), wait_for_ready=True)
                try:
                    for event in stream:
                        if stop.is_set():
                            break
                        on_event(event)
                except grpc.RpcError as exc:
                    if stop.is_set():
                        break
                    on_lost(transport.meaning(exc.code().name, exc.details() or ""))
                finally:
                    stream.cancel()
                stop.wait(1.0)
        thread = threading.Thread(target=run, name=f"watch-{self.node}", daemon=True)
        thread.start()
        return thread

    def watch_memory(self, interval_ms: int, psi_trigger: bool = True, min_change_bytes: int = 0,
                     heartbeat_ms: int = 0, replay_samples: int = 0, follow_samples: int = 0):
        return self._stub.WatchMemory(pb.WatchMemoryRequest(
            interval_ms=interval_ms, psi_trigger=psi_trigger, min_change_bytes=min_change_bytes,
            heartbeat_ms=heartbeat_ms, replay_samples=replay_samples, follow_samples=follow_samples))
