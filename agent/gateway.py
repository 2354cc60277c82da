"""SetGateway: SGLang's model gateway (sglang-router, run by adapter/gateway.py) as the long-running
transient unit dsv41-gateway.service on the head.

The unit is built from the head's RankSpec as the rank jobs are (agent/rankjob.py): the rank's
Python or container image, environment (with the API key's file, DSV41_API_KEY_FILE), GID index
and sandbox, with SGLang's entry replaced by `-m adapter.gateway` and the router's flags; or, with
GATEWAY_PYTHON, that Python (an ALLOWED_PYTHONS entry) on the host with the rank's host view of the
environment. Unlike the jobs it runs beside the rank, has no time limit, is restarted by systemd
when it fails, and carries the fingerprint of its argv and environment in its environment, so that
an agent restarted under it still knows what it runs.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import threading
import time
from dataclasses import replace
from typing import Callable, Sequence

import grpc

from dsv41.v1 import agent_pb2 as pb

from . import rankjob
from .container import CIDFILE
from .pathtrust import PathUse
from .rankjob import SERVICE_IFACE, JobRefused
from .rankspec import (CONTAINER_NAME, DOCKER, USEC, RankLaunch, SpecDenied, SpecInvalid, check_path,
                       under)
from .systemd import UNIT_IFACE, SystemdError

UNIT = "dsv41-gateway.service"
NAME = "dsv41-gateway"  # also its container's name and its runtime directory (the rank's are dsv41-rank)
JOB = rankjob.Job(unit=UNIT, module="adapter.gateway", what="model gateway (sglang-router)", result_prefix="",
                  off_switch="GATEWAY_PYTHON", event="gateway", needs="a Python with sglang_router")
FINGERPRINT_ENV = "DSV41_GATEWAY_FINGERPRINT"
RESTART_USEC = 2 * USEC
START_WAIT_S = 10.0
MAX_ARGS = 256
# Flags that carry a key: the key comes from DSV41_API_KEY_FILE, never argv (ps, /proc/PID/cmdline).
SECRET_FLAGS = ("--api-key", "--control-plane-api-keys")
RUNNING = ("active", "activating", "reloading")  # activating: also between two of systemd's restarts


def check_args(args: Sequence[str]) -> tuple[str, ...]:
    """The router's flags: lines of text, flags first, none that carries a key (nor an abbreviation
    of one, which argparse would take for it)."""
    if len(args) > MAX_ARGS:
        raise SpecInvalid(f"args: at most {MAX_ARGS} entries")
    for arg in args:
        if "\0" in arg or "\n" in arg or len(arg) > 4096:
            raise SpecInvalid("args: each must be one line of at most 4096 characters without NUL")
        name = arg.split("=", 1)[0]
        if len(name) > 2 and name.startswith("--") and any(flag.startswith(name) for flag in SECRET_FLAGS):
            raise SpecInvalid(f"args: {name} is refused: the key comes from DSV41_API_KEY_FILE (the head rank's "
                              "key file), never from argv")
    if args and not args[0].startswith("--"):
        raise SpecInvalid(f"args: sglang_router.launch_router's flags (--name value ...), not {args[0]!r}")
    return tuple(args)


def _host_path(value: str, launch: RankLaunch) -> str:
    """A value the container is shown (a bind target, or under one), as the host sees it."""
    parts = []
    for part in value.split(":"):
        for bind in sorted(launch.binds, key=lambda b: -len(b.target)):
            if part.startswith("/") and under(posixpath.normpath(part), [bind.target]):
                part = bind.source + posixpath.normpath(part)[len(bind.target.rstrip("/")):]
                break
        parts.append(part)
    return ":".join(parts)


def own_python_launch(launch: RankLaunch, python: str, args: Sequence[str], settings) -> RankLaunch:
    """The gateway on the host with GATEWAY_PYTHON: the rank's environment as the host sees it,
    PYTHONPATH the node's adapter directory (what a host rank has); the container's binds and
    clean-up commands are the container's and stay out."""
    python = check_path(python, "python")
    if python not in settings.allowed_pythons:
        allowed = ", ".join(settings.allowed_pythons) or "none (set ALLOWED_PYTHONS in agent.env)"
        raise SpecDenied(f"python {python}: not one of this node's ALLOWED_PYTHONS ({allowed}); add GATEWAY_PYTHON "
                         "to ALLOWED_PYTHONS in the head's /etc/dsv41/agent.env")
    container = launch.runtime == "container"
    env = {k: _host_path(v, launch) if container else v for k, v in launch.env.items()}
    env["PYTHONPATH"] = settings.adapter_dir
    trust = (PathUse(python, "GATEWAY_PYTHON", code=True, must_exist=False),
             PathUse(settings.adapter_dir, "env PYTHONPATH", code=True))
    return replace(launch, runtime="host", argv=(python, "-m", JOB.module, *args), env=env,
                   binds=() if container else launch.binds, exec_start_pre=(), exec_stop_post=(),
                   cache_dir=settings.rank_cache_dir if container else launch.cache_dir, trust=trust, targets=())


def _own_container(launch: RankLaunch) -> RankLaunch:
    """The rank's docker run under the gateway's own container name and cidfile, and clean-up
    commands that remove the gateway's container, never the rank's."""
    renames = {CONTAINER_NAME: NAME, CIDFILE: f"/run/{NAME}/container.id"}
    argv = tuple(renames.get(a, a) if i and launch.argv[i - 1] in ("--name", "--cidfile") else a
                 for i, a in enumerate(launch.argv))
    cleanup = (DOCKER, "rm", "--force", NAME)
    return replace(launch, argv=argv, exec_start_pre=tuple(cleanup for _ in launch.exec_start_pre),
                   exec_stop_post=tuple(cleanup for _ in launch.exec_stop_post))


def gateway_launch(launch: RankLaunch, python: str, args: Sequence[str], settings) -> RankLaunch:
    """The head rank's launch turned into the gateway's (JobRefused: the rank's runtime has no
    Python to run it in and no GATEWAY_PYTHON is given)."""
    if python:
        return own_python_launch(launch, python, args, settings)
    if launch.runtime == "container":
        launch = _own_container(launch)
    return replace(launch, argv=rankjob.job_argv(JOB, launch, args))


def fingerprint(argv: Sequence[str], environment: Sequence[str]) -> str:
    """Of what the unit runs: its argv and environment (the fingerprint's own entry left out)."""
    env = sorted(e for e in environment if not e.startswith(FINGERPRINT_ENV + "="))
    return hashlib.sha256(json.dumps([list(argv), env]).encode()).hexdigest()[:16]


def fingerprint_of(props: dict | None) -> str:
    """The fingerprint a running unit was started with (its Environment property)."""
    for entry in (props or {}).get("Environment", []):
        if str(entry).startswith(FINGERPRINT_ENV + "="):
            return str(entry).split("=", 1)[1]
    return ""


def gateway_properties(run: RankLaunch, facts: dict[str, str], node: str, working_directory: str,
                       stop_timeout_s: int) -> tuple[list[tuple[str, str, object]], str]:
    """(the unit's properties, its fingerprint): a rank job's, long-running and restarted on failure."""
    props = rankjob.job_unit_properties(JOB, run, facts, node, working_directory, None)
    values = {key: value for key, _, value in props}
    (_, argv, _), = values["ExecStart"]
    fp = fingerprint(argv, values["Environment"])
    own = {
        "Description": ("s", f"dsv41 model gateway (sglang-router, {run.runtime}), rank {run.rank}'s runtime"),
        "Environment": ("as", sorted([*values["Environment"], f"{FINGERPRINT_ENV}={fp}"])),
        "TimeoutStopUSec": ("t", stop_timeout_s * USEC),
        "RuntimeDirectory": ("as", [NAME]),
    }
    props = [(key, *own[key]) if key in own else (key, sig, value) for key, sig, value in props]
    props += [("Restart", "s", "on-failure"), ("RestartUSec", "t", RESTART_USEC)]
    return props, fp


def state_pb(props: dict | None, message: str) -> pb.GatewayState:
    props = props or {}
    return pb.GatewayState(active_state=str(props.get("ActiveState", "inactive")),
                           main_pid=int(props.get("MainPID", 0)),
                           invocation_id=bytes(props.get("InvocationID", b"")).hex(),
                           fingerprint=fingerprint_of(props), message=message)


class GatewayRpcs:
    """SetGateway over the node's rank spec checks (rpc_rank.RankRpcs); one change at a time."""

    def __init__(self, settings, systemd, events, rank_rpcs, monotonic: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self._settings = settings
        self._systemd = systemd
        self._events = events
        self._rank_rpcs = rank_rpcs
        self._monotonic = monotonic
        self._sleep = sleep
        self._lock = threading.Lock()

    def SetGateway(self, request, context):
        with self._lock:
            if not request.run:
                return self._stop()
            props, fp = self._properties(request, context)
            return self._ensure(props, fp, context)

    def _properties(self, request, context) -> tuple[list[tuple[str, str, object]], str]:
        if not 1 <= request.stop_timeout_s <= 3600:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"stop_timeout_s {request.stop_timeout_s}: must be "
                          "1..3600 (the gateway's --shutdown-grace-period-secs and a margin)")
        launch = self._rank_rpcs.checked_launch(request.rank, context)
        facts = self._rank_rpcs.node_facts(launch, context)
        try:
            run = gateway_launch(launch, request.python, check_args(list(request.args)), self._settings)
        except SpecInvalid as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except SpecDenied as exc:
            self._events.warning("gateway_request_denied", f"refused a gateway request: {exc}", unit=UNIT)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except JobRefused as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        if request.python and (problems := self._rank_rpcs.launch_problems(run)):
            self._events.warning("gateway_request_denied", f"refused a gateway request: {'; '.join(problems)}",
                                 unit=UNIT)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "; ".join(problems))
        return gateway_properties(run, facts, self._settings.node, self._settings.rank_cache_dir,
                                  request.stop_timeout_s)

    def _read(self) -> dict | None:
        return self._systemd.properties(UNIT, (UNIT_IFACE, SERVICE_IFACE))

    def _ensure(self, props: list, fp: str, context) -> pb.GatewayState:
        current = self._read()
        state = (current or {}).get("ActiveState", "inactive")
        if state in RUNNING and fingerprint_of(current) == fp:
            self._events.info("gateway_kept", f"{UNIT} already runs fingerprint {fp} ({state}, pid "
                              f"{int(current.get('MainPID', 0))})", unit=UNIT, fingerprint=fp, active_state=state)
            return state_pb(current, "kept")
        message = "restarted" if state in RUNNING else "started"
        if state in (*RUNNING, "deactivating"):
            self._stop_unit(current)
        self._systemd.reset_failed(UNIT)
        try:
            job = self._systemd.start_transient(UNIT, props, 30.0)
        except SystemdError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE if exc.name == "org.freedesktop.systemd1.UnitExists"
                          else grpc.StatusCode.INTERNAL, f"StartTransientUnit {UNIT}: {exc}")
        now = self._settle()
        after = (now or {}).get("ActiveState", "inactive")
        fields = dict(unit=UNIT, fingerprint=fp, previous_fingerprint=fingerprint_of(current) or None,
                      active_state=after, pid=int((now or {}).get("MainPID", 0)), job_result=job.result)
        if after == "active":
            self._events.info("gateway_started", f"{message} {UNIT} (fingerprint {fp}, pid {fields['pid']})",
                              what=message, **fields)
        else:
            self._events.warning("gateway_start_failed", f"{UNIT} is {after} after its start (job {job.result}): "
                                 f"journalctl -u {NAME}", what=message, **fields)
        return state_pb(now, message)

    def _settle(self) -> dict | None:
        """The unit's properties once it is active or failed, or after START_WAIT_S."""
        deadline = self._monotonic() + START_WAIT_S
        while True:
            props = self._read()
            if not props or props.get("ActiveState") in ("active", "failed") or self._monotonic() >= deadline:
                return props
            self._sleep(0.25)

    def _stop_unit(self, current: dict) -> None:
        timeout_s = int(current.get("TimeoutStopUSec", 90 * USEC)) / USEC
        self._systemd.stop(UNIT, timeout_s + 15.0)
        self._systemd.reset_failed(UNIT)

    def _stop(self) -> pb.GatewayState:
        current = self._read()
        state = (current or {}).get("ActiveState", "inactive")
        if current is not None and state != "inactive":
            self._stop_unit(current)
        after = self._read()
        self._events.info("gateway_stopped", f"{UNIT} stopped (was {state})", unit=UNIT, previous_state=state,
                          fingerprint=fingerprint_of(current) or None,
                          active_state=(after or {}).get("ActiveState", "inactive"))
        return state_pb(after, "stopped")
