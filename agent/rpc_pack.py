"""RPCs for the packed Engram shards: their state (milliseconds: headers and sizes) and the pack job.

The job runs as the transient unit dsv41-pack.service (Type=notify), so it outlives an agent
restart and its progress is the unit's STATUS= line. One TP rank per node, as on DGX Spark.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

import grpc

import dsv41
import agent
from agent.pack.state import pack_state
from dsv41.v1 import agent_pb2 as pb

from .pathtrust import PathTrust, PathUse
from .rankspec import SpecDenied, SpecInvalid, check_under_roots
from .systemd import UNIT_IFACE, SystemdError

PACK_UNIT = "dsv41-pack.service"
SERVICE_IFACE = "org.freedesktop.systemd1.Service"
LAYERS = (1, 14)
# The pack job reads the checkpoint and writes one directory: no network, no devices, no
# capabilities (its files are root's), nothing it could hand on. No PrivateTmp=: the recipe's
# model and packs may be under /var/tmp.
PACK_SANDBOX: tuple[tuple[str, str, object], ...] = (
    ("NoNewPrivileges", "b", True),
    ("ProtectSystem", "s", "strict"),
    ("ProtectHome", "s", "read-only"),
    ("PrivateDevices", "b", True),
    ("PrivateNetwork", "b", True),
    ("PrivateIPC", "b", True),
    ("ProtectKernelTunables", "b", True),
    ("ProtectKernelModules", "b", True),
    ("ProtectKernelLogs", "b", True),
    ("ProtectControlGroups", "b", True),
    ("ProtectClock", "b", True),
    ("ProtectHostname", "b", True),
    ("ProtectProc", "s", "invisible"),
    ("RestrictSUIDSGID", "b", True),
    ("RestrictRealtime", "b", True),
    ("RestrictNamespaces", "t", 0),
    ("LockPersonality", "b", True),
    ("MemoryDenyWriteExecute", "b", True),
    ("RemoveIPC", "b", True),
    ("RestrictAddressFamilies", "(bas)", (True, ["AF_UNIX"])),  # sd_notify only
    ("SystemCallArchitectures", "as", ["native"]),
    ("SystemCallFilter", "(bas)", (True, ["@system-service"])),
    ("SystemCallErrorNumber", "i", 1),  # EPERM
    ("CapabilityBoundingSet", "t", 0),
    ("UMask", "u", 0o022),
)


def _module_path() -> str:
    """Where this agent's packages (agent, dsv41) are importable from, for the job's PYTHONPATH."""
    dirs = [os.path.dirname(os.path.dirname(os.path.abspath(m.__file__))) for m in (agent, dsv41)]
    return os.pathsep.join(dict.fromkeys(dirs))


class PackRpcs:
    """GetPackState and StartPack: the packed shards' state and the job that writes them."""

    def __init__(self, settings, systemd, events, rank, path_trust: Callable[[], PathTrust], host_root: str):
        """rank: whose status says whether it runs (it reads the shards); path_trust: checks paths as
        PID 1 sees them; host_root: where PID 1's file system is seen from (the agent's unit has
        PrivateTmp=, the pack job does not)."""
        self._settings = settings
        self._systemd = systemd
        self._events = events
        self._rank = rank
        self._path_trust = path_trust
        self._host_root = host_root

    def _check_pack_spec(self, spec: pb.PackSpec, context) -> None:
        try:
            check_under_roots(spec.source_dir, "source_dir", self._settings)
            check_under_roots(spec.out_dir, "out_dir", self._settings)
        except SpecInvalid as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except SpecDenied as exc:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        if not 1 <= spec.tp <= 64:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"tp {spec.tp}: must be 1..64")
        if len(spec.ranks) != 1 or not 0 <= spec.ranks[0] < spec.tp:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "ranks: exactly one TP rank per node, in 0..tp-1")
        if not spec.layers or any(layer not in LAYERS for layer in spec.layers) or len(set(spec.layers)) != len(spec.layers):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "layers: a subset of the Engram layers 1, 14")

    def _pack_unit(self) -> tuple[bool, str]:
        try:
            props = self._systemd.properties(PACK_UNIT, (UNIT_IFACE, SERVICE_IFACE))
        except SystemdError:
            return False, ""
        if not props:
            return False, ""
        return props.get("ActiveState") in ("active", "activating"), str(props.get("StatusText", ""))

    def _on_host(self, path: str) -> str:
        return os.path.join(self._host_root, path.lstrip("/"))

    def _state(self, spec: pb.PackSpec) -> pb.PackState:
        running, text = self._pack_unit()
        layers = []
        for rank in spec.ranks:
            # As PID 1 (and the pack job) sees it: the agent's own /var/tmp is private.
            for state in pack_state(self._on_host(spec.out_dir), rank, spec.tp, tuple(spec.layers)):
                layers.append(pb.PackLayerState(layer=state.layer, rank=rank, state=state.status.value,
                                                state_kind=pb.PackLayerState.State.Value(state.status.name),
                                                detail=state.detail, done_bytes=state.done_bytes,
                                                total_bytes=state.total_bytes, row_lo=state.row_lo,
                                                row_hi=state.row_hi, total_rows=state.total_rows))
        return pb.PackState(layers=layers, running=running, status_text=text)

    def GetPackState(self, request, context):
        self._check_pack_spec(request, context)
        return self._state(request)

    def StartPack(self, request, context):
        spec = request.spec
        self._check_pack_spec(spec, context)
        if self._rank.status().running:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "the rank is running and reads these files: stop it before packing")
        running, _ = self._pack_unit()
        if running:
            return self._state(spec)
        # What the job reads is what the rank will serve; what it writes, the rank reads.
        problems = self._path_trust().problems([PathUse(spec.source_dir, "source_dir"),
                                               PathUse(spec.out_dir, "out_dir", must_exist=False)])
        if problems:
            self._events.warning("request_denied", f"refused a pack job: {'; '.join(problems)}")
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "; ".join(problems))
        self._systemd.reset_failed(PACK_UNIT)
        argv = [sys.executable, "-B", "-m", "agent.pack", "--model", spec.source_dir, "--out", spec.out_dir,
                "--rank", str(spec.ranks[0]), "--tp", str(spec.tp), "--layers", ",".join(map(str, spec.layers))]
        props = [("Description", "s", f"dsv41 Engram pack, rank {spec.ranks[0]} of {spec.tp}"),
                 ("Type", "s", "notify"), ("NotifyAccess", "s", "main"),
                 ("ExecStart", "a(sasb)", [(argv[0], argv, False)]),
                 ("Environment", "as", [f"PYTHONPATH={_module_path()}"]),
                 ("WorkingDirectory", "s", "/"), ("SyslogIdentifier", "s", "dsv41-pack"),
                 ("LogExtraFields", "aay", [f"DSV41_NODE={self._settings.node}".encode(), b"DSV41_UNIT=dsv41-pack"]),
                 ("IOSchedulingClass", "i", 3),  # idle: a pack must not starve a serving node's disk
                 ("ReadWritePaths", "as", [spec.out_dir]), *PACK_SANDBOX]
        os.makedirs(self._on_host(spec.out_dir), mode=0o755, exist_ok=True)
        try:
            job = self._systemd.start_transient(PACK_UNIT, props, 120.0)
        except SystemdError as exc:
            context.abort(grpc.StatusCode.INTERNAL, f"StartTransientUnit {PACK_UNIT}: {exc}")
        if job.result != "done":
            _, text = self._pack_unit()
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"the pack job did not start ({job.result}): {text or 'see journalctl -u dsv41-pack'}")
        self._events.info("pack_started", f"started {PACK_UNIT} for rank {spec.ranks[0]} of {spec.tp}",
                          unit=PACK_UNIT, rank=spec.ranks[0], tp=spec.tp)
        return self._state(spec)
