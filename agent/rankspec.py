"""Validates a requested rank and turns it into systemd unit properties. Pure functions.

Everything the coordinator sends is checked against what a rank legitimately needs and what this
node's agent.env allows: an agent that starts processes as root must not become a remote shell.
"""

from __future__ import annotations

import ipaddress
import posixpath
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from .settings import AgentSettings

RANK_UNIT = "dsv41-rank.service"
CONTAINER_NAME = "dsv41-rank"
DOCKER = "/usr/bin/docker"
USEC = 1_000_000
INFINITY = 2**64 - 1
KNOWN_FILLS = ("roce_gid_index",)

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_FINGERPRINT = re.compile(r"[0-9a-f]{1,64}")
_GENERATION = re.compile(r"[A-Za-z0-9_.:-]{0,64}")
_HCA = re.compile(r"[A-Za-z0-9][A-Za-z0-9_]{0,63}(:[0-9]{1,3})?")
# Environment entries that change how a process loads code or runs a shell: never from the wire.
_ENV_DENIED = {"LD_PRELOAD", "LD_AUDIT", "LD_DEBUG", "LD_DEBUG_OUTPUT", "LD_PROFILE", "LD_BIND_NOW",
               "PYTHONSTARTUP", "PYTHONHOME", "PYTHONINSPECT", "PYTHONUSERBASE", "PYTHONEXECUTABLE",
               "PYTHONBREAKPOINT", "BASH_ENV", "ENV", "IFS", "PATH", "SHELL", "NOTIFY_SOCKET", "PERL5OPT",
               "NODE_OPTIONS", "GCONV_PATH", "HOSTALIASES", "LOCALDOMAIN", "RES_OPTIONS"}
# Paths a rank never needs to see re-mounted, and whose exposure would hand out the node.
_BIND_DENIED_PREFIXES = ("/etc", "/proc", "/sys", "/dev", "/boot", "/run", "/var/run", "/root/.ssh")
_BIND_DENIED_EXACT = {"/", "/usr", "/bin", "/sbin", "/lib", "/lib64", "/var", "/home", "/root", "/var/lib",
                      "/usr/bin", "/usr/lib", "/usr/sbin", "/usr/share"}
_DOCKER_FLAG_VALUES = {
    "--name": lambda v: v == CONTAINER_NAME,
    "--network": lambda v: v == "host",
    "--ipc": lambda v: v == "host",
    "--gpus": lambda v: v == "all",
    "--device": lambda v: v == "/dev/infiniband:/dev/infiniband",
    "--cap-add": lambda v: v == "IPC_LOCK",
    "--ulimit": lambda v: v in ("memlock=-1:-1", "stack=67108864"),
    "--stop-timeout": lambda v: v.isdigit() and 1 <= int(v) <= 3600,
}


class SpecInvalid(ValueError):
    """INVALID_ARGUMENT: the request is malformed."""


class SpecDenied(PermissionError):
    """PERMISSION_DENIED: well-formed, but this node's agent.env does not allow it."""


@dataclass(frozen=True)
class Bind:
    source: str
    target: str
    read_only: bool = True


@dataclass(frozen=True)
class FloorSpec:
    """The node's last line for this rank (agent/floor.py)."""
    floor_bytes: int          # 0: none
    kill_after_s: float = 1.0
    interval_s: float = 0.02


NO_FLOOR = FloorSpec(0)
FLOOR_FIELDS = ("DSV41_MEMORY_FLOOR_BYTES", "DSV41_MEMORY_FLOOR_KILL_MS", "DSV41_MEMORY_FLOOR_INTERVAL_MS")


@dataclass(frozen=True)
class RankLaunch:
    runtime: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    fills: Mapping[str, str]
    binds: tuple[Bind, ...]
    exec_start_pre: tuple[tuple[str, ...], ...]
    exec_stop_post: tuple[tuple[str, ...], ...]
    stop_timeout_s: int
    memory_max: int
    memory_high: int
    fingerprint: str
    rank: int
    generation: str
    fabric_address: str
    hcas: tuple[str, ...] = field(default=())
    floor: FloorSpec = NO_FLOOR


def _text(value: str, what: str, limit: int = 65536) -> str:
    if "\0" in value or "\n" in value or len(value) > limit:
        raise SpecInvalid(f"{what}: must be one line of at most {limit} characters without NUL")
    return value


def check_path(path: str, what: str) -> str:
    _text(path, what, 4096)
    if not path.startswith("/"):
        raise SpecInvalid(f"{what} {path!r}: must be an absolute path")
    if ".." in path.split("/"):
        raise SpecInvalid(f"{what} {path!r}: must not contain '..'")
    return posixpath.normpath(path)


def check_bind_path(path: str, what: str) -> str:
    norm = check_path(path, what)
    if norm in _BIND_DENIED_EXACT or any(norm == p or norm.startswith(p + "/") for p in _BIND_DENIED_PREFIXES):
        raise SpecDenied(f"{what} {norm!r}: a rank may not mount this path (system directories, /etc, /proc, "
                         "/sys, /dev, /run and / itself are refused)")
    return norm


def check_env(env: Mapping[str, str], settings: AgentSettings, runtime: str) -> dict[str, str]:
    if len(env) > 512:
        raise SpecInvalid("env: at most 512 entries")
    out = {}
    for name, value in env.items():
        if not _ENV_NAME.fullmatch(name):
            raise SpecInvalid(f"env {name!r}: names are letters, digits and _ (not starting with a digit)")
        _text(value, f"env {name}")
        if name in _ENV_DENIED or (name.startswith("LD_") and name != "LD_LIBRARY_PATH"):
            raise SpecDenied(f"env {name}: not allowed for a rank (it changes how programs load or run)")
        if name == "LD_LIBRARY_PATH":
            for part in value.split(":"):
                check_path(part, "env LD_LIBRARY_PATH entry")
        if name == "PYTHONPATH" and runtime == "host" and value != settings.adapter_dir:
            raise SpecDenied(f"env PYTHONPATH: must be this node's adapter directory {settings.adapter_dir}")
        out[name] = value
    return out


def _check_docker(argv: Sequence[str], env: Mapping[str, str], settings: AgentSettings) -> None:
    if list(argv[:2]) != [DOCKER, "run"]:
        raise SpecInvalid(f"argv: the container runtime runs `{DOCKER} run ...`")
    i, forwarded = 2, set()
    while i < len(argv) and argv[i].startswith("-"):
        flag = argv[i]
        if flag == "--rm":
            i += 1
            continue
        if i + 1 >= len(argv):
            raise SpecInvalid(f"argv: {flag} needs a value")
        value = argv[i + 1]
        if flag == "-v":
            parts = value.split(":")
            if len(parts) != 3 or parts[2] not in ("ro", "rw"):
                raise SpecInvalid(f"argv: -v {value!r}: must be SOURCE:TARGET:ro|rw")
            check_bind_path(parts[0], "bind source")
            check_bind_path(parts[1], "bind target")
        elif flag == "-e":
            if value not in env:
                raise SpecInvalid(f"argv: -e {value}: forwards a variable that env does not define")
            forwarded.add(value)
        elif flag not in _DOCKER_FLAG_VALUES:
            raise SpecDenied(f"argv: docker flag {flag} is not one a rank needs")
        elif not _DOCKER_FLAG_VALUES[flag](value):
            raise SpecDenied(f"argv: {flag} {value}: not allowed for a rank")
        i += 2
    if "--rm" not in argv[2:i] or "--name" not in argv[2:i]:
        raise SpecInvalid(f"argv: the rank container must be run with --rm --name {CONTAINER_NAME}")
    if i >= len(argv):
        raise SpecInvalid("argv: no image after the docker flags")
    image = argv[i]
    if image not in settings.allowed_images:
        allowed = ", ".join(settings.allowed_images) or "none (set ALLOWED_IMAGES in agent.env)"
        raise SpecDenied(f"image {image}: not allowed on this node; allowed: {allowed}")
    if missing := sorted(set(env) - forwarded):
        raise SpecInvalid(f"argv: env entries not forwarded into the container with -e: {', '.join(missing)}")


def check_launch(*, runtime: str, argv: Sequence[str], env: Mapping[str, str], fills: Mapping[str, str],
                 binds: Iterable[tuple[str, str, bool]], exec_start_pre: Iterable[Sequence[str]],
                 exec_stop_post: Iterable[Sequence[str]], stop_timeout_s: int, memory_max: int,
                 memory_high: int, fingerprint: str, rank: int, generation: str, fabric_address: str,
                 hcas: Sequence[str], settings: AgentSettings, memory_floor: int = 0, floor_kill_after_ms: int = 0,
                 floor_interval_ms: int = 0) -> RankLaunch:
    """Validates one StartRank request; raises SpecInvalid or SpecDenied with the reason."""
    if runtime not in ("container", "host"):
        raise SpecInvalid(f"runtime {runtime!r}: must be container or host")
    if runtime not in settings.allowed_runtimes:
        raise SpecDenied(f"runtime {runtime}: not allowed on this node (agent.env ALLOWED_RUNTIMES="
                         f"{','.join(settings.allowed_runtimes)})")
    if not argv or len(argv) > 4096:
        raise SpecInvalid("argv: must have 1 to 4096 entries")
    argv = tuple(_text(a, "argv entry") for a in argv)
    env = check_env(env, settings, runtime)
    for key, fact in fills.items():
        if key not in env:
            raise SpecInvalid(f"agent_fills {key}: not in env")
        if fact not in KNOWN_FILLS:
            raise SpecInvalid(f"agent_fills {key}={fact}: unknown fact; known: {', '.join(KNOWN_FILLS)}")
    checked_binds = tuple(Bind(check_bind_path(s, "bind source"), check_bind_path(t, "bind target"), bool(ro))
                          for s, t, ro in binds)
    if runtime == "host":
        exe = check_path(argv[0], "argv[0]")
        if exe not in settings.allowed_executables:
            allowed = ", ".join(settings.allowed_executables) or "none (set ALLOWED_EXECUTABLES in agent.env)"
            raise SpecDenied(f"executable {exe}: not allowed on this node; allowed: {allowed}")
    else:
        _check_docker(argv, env, settings)
    cleanup = (DOCKER, "rm", "--force", CONTAINER_NAME)
    pre, post = tuple(tuple(c) for c in exec_start_pre), tuple(tuple(c) for c in exec_stop_post)
    for what, commands in (("exec_start_pre", pre), ("exec_stop_post", post)):
        if any(c != cleanup for c in commands) or (commands and runtime != "container"):
            raise SpecDenied(f"{what}: only `{' '.join(cleanup)}` is allowed, and only for the container runtime")
    if not 1 <= stop_timeout_s <= 3600:
        raise SpecInvalid(f"stop_timeout_s {stop_timeout_s}: must be 1..3600")
    for name, value in (("memory_max_bytes", memory_max), ("memory_high_bytes", memory_high)):
        if value and value < 64 << 20:
            raise SpecInvalid(f"{name} {value}: must be 0 (no limit) or at least 64 MiB")
    if not _FINGERPRINT.fullmatch(fingerprint):
        raise SpecInvalid("fingerprint: must be 1-64 lowercase hex digits")
    if not 0 <= rank < 64:
        raise SpecInvalid(f"rank {rank}: must be 0..63")
    if not _GENERATION.fullmatch(generation):
        raise SpecInvalid("cluster_generation: at most 64 of letters, digits, _ . : -")
    if fabric_address:
        try:
            ipaddress.IPv4Address(fabric_address)
        except ValueError:
            raise SpecInvalid(f"fabric_address {fabric_address!r}: must be an IPv4 address") from None
    elif fills:
        raise SpecInvalid("fabric_address: required when the agent must fill in the RoCE GID index")
    for hca in hcas:
        if not _HCA.fullmatch(hca):
            raise SpecInvalid(f"hcas {hca!r}: must be an RDMA device name")
    floor = check_floor(memory_floor, floor_kill_after_ms, floor_interval_ms)
    return RankLaunch(runtime, argv, env, dict(fills), checked_binds, pre, post, stop_timeout_s, memory_max,
                      memory_high, fingerprint, rank, generation, fabric_address, tuple(hcas), floor)


def check_floor(floor_bytes: int, kill_after_ms: int, interval_ms: int) -> FloorSpec:
    """RankSpec's memory_floor_* fields; 0 for the kill deadline or the interval: 1000 and 20 ms."""
    if not floor_bytes:
        if kill_after_ms or interval_ms:
            raise SpecInvalid("memory_floor_kill_after_ms and memory_floor_interval_ms apply only with "
                              "memory_floor_bytes > 0")
        return NO_FLOOR
    if not 64 << 20 <= floor_bytes <= 1 << 40:
        raise SpecInvalid(f"memory_floor_bytes {floor_bytes}: must be 0 (no floor) or 64 MiB .. 1 TiB")
    kill_after_ms = kill_after_ms or 1000
    interval_ms = interval_ms or 20
    if not 100 <= kill_after_ms <= 60_000:
        raise SpecInvalid(f"memory_floor_kill_after_ms {kill_after_ms}: must be 100 .. 60000")
    if not 10 <= interval_ms <= 1000:
        raise SpecInvalid(f"memory_floor_interval_ms {interval_ms}: must be 10 .. 1000")
    return FloorSpec(floor_bytes, kill_after_ms / 1000, interval_ms / 1000)


def fill_env(launch: RankLaunch, facts: Mapping[str, str]) -> dict[str, str]:
    """The environment with the placeholders replaced by what this node measured."""
    env = dict(launch.env)
    for key, fact in launch.fills.items():
        env[key] = facts[fact]
    return env


def unit_properties(launch: RankLaunch, env: Mapping[str, str], node: str,
                    working_directory: str) -> list[tuple[str, str, object]]:
    """(name, D-Bus signature, value) for StartTransientUnit; the systemd client wraps them in variants."""
    def cmd(argv: Sequence[str], ignore_failure: bool) -> tuple[str, list[str], bool]:
        return (argv[0], list(argv), ignore_failure)

    extra = [f"DSV41_NODE={node}", f"DSV41_RANK={launch.rank}", f"DSV41_FINGERPRINT={launch.fingerprint}",
             f"DSV41_GENERATION={launch.generation}", "DSV41_UNIT=dsv41-rank"]
    if launch.floor.floor_bytes:
        # With the unit, so that an agent restarted while the rank runs keeps guarding it.
        extra += [f"{FLOOR_FIELDS[0]}={launch.floor.floor_bytes}",
                  f"{FLOOR_FIELDS[1]}={round(launch.floor.kill_after_s * 1000)}",
                  f"{FLOOR_FIELDS[2]}={round(launch.floor.interval_s * 1000)}"]
    props: list[tuple[str, str, object]] = [
        ("Description", "s", f"dsv41 SGLang rank {launch.rank} ({launch.runtime}, plan {launch.fingerprint})"),
        ("Type", "s", "exec"),
        ("ExecStart", "a(sasb)", [cmd(launch.argv, False)]),
        ("Environment", "as", [f"{k}={v}" for k, v in sorted(env.items())]),
        ("WorkingDirectory", "s", working_directory),
        # Rank 0 drains on SIGTERM; its scheduler children have no handler and would die mid-request.
        ("KillMode", "s", "mixed"),
        ("TimeoutStopUSec", "t", launch.stop_timeout_s * USEC),
        ("LimitMEMLOCK", "t", INFINITY),
        ("LimitMEMLOCKSoft", "t", INFINITY),
        ("SyslogIdentifier", "s", "dsv41-rank"),
        ("LogExtraFields", "aay", [e.encode() for e in extra]),
    ]
    if launch.exec_start_pre:
        props.append(("ExecStartPre", "a(sasb)", [cmd(c, True) for c in launch.exec_start_pre]))
    if launch.exec_stop_post:
        props.append(("ExecStopPost", "a(sasb)", [cmd(c, True) for c in launch.exec_stop_post]))
    if launch.runtime == "host":
        ro = [(b.source, b.target, False, 0) for b in launch.binds if b.read_only]
        rw = [(b.source, b.target, False, 0) for b in launch.binds if not b.read_only]
        if ro:
            props.append(("BindReadOnlyPaths", "a(ssbt)", ro))
        if rw:
            props.append(("BindPaths", "a(ssbt)", rw))
    if launch.memory_max:
        props.append(("MemoryMax", "t", launch.memory_max))
    if launch.memory_high:
        props.append(("MemoryHigh", "t", launch.memory_high))
    return props


def floor_from_fields(fields: Iterable[bytes]) -> FloorSpec:
    """The floor a rank unit was started with (its LogExtraFields); NO_FLOOR when it has none."""
    values = {}
    for item in fields:
        key, _, value = bytes(item).decode(errors="replace").partition("=")
        if key in FLOOR_FIELDS:
            values[key] = value
    try:
        floor = int(values.get(FLOOR_FIELDS[0], "0"))
        kill_ms = int(values.get(FLOOR_FIELDS[1], "1000"))
        interval_ms = int(values.get(FLOOR_FIELDS[2], "20"))
    except ValueError:
        return NO_FLOOR
    return FloorSpec(floor, kill_ms / 1000, interval_ms / 1000) if floor > 0 else NO_FLOOR


def fingerprint_from_fields(fields: Iterable[bytes]) -> str:
    for item in fields:
        text = bytes(item).decode(errors="replace")
        if text.startswith("DSV41_FINGERPRINT="):
            return text.split("=", 1)[1]
    return ""
