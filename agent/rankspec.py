"""Validates a requested rank and turns it into systemd unit properties. Pure functions.

The agent starts processes as root, so a request, even one signed with the coordinator's key,
must not be able to make it run anything but a rank. Everything is an allow-list:

- the host runtime runs a fixed entry: `<ALLOWED_PYTHONS entry> -m sglang.launch_server FLAGS`,
  or an ALLOWED_EXECUTABLES entry point (the stand-in engine) with FLAGS;
- the container runtime runs `docker run` with the flags a rank needs, always with
  `--cap-drop ALL --cap-add IPC_LOCK --security-opt no-new-privileges`, an ALLOWED_IMAGES image
  (by digest) and `python3 -m sglang.launch_server FLAGS`;
- environment names are the cluster config's passthrough prefixes and the few names the plan
  renders; PYTHONPATH is fixed, library and plugin paths must be code only root can have written,
  caches live in the agent's cache directory, and every other path a host rank is told about
  lies under ALLOWED_PATHS, a bind target, the adapter or the state directory;
- bind sources lie under ALLOWED_PATHS (or the adapter or state directory), read-only; the
  container's cache is the one read-write bind.

What the rules cannot decide without the file system (who owns a directory, whether a target
exists) is returned as PathUse records and target paths for the agent to check before the start.
"""

from __future__ import annotations

import ipaddress
import posixpath
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from dsv41.adapterversion import adapter_version_field

from .container import CIDFILE, CIDFILE_DIR
from .pathtrust import PathUse
from .settings import AgentSettings

RANK_UNIT = "dsv41-rank.service"
CONTAINER_NAME = "dsv41-rank"
DOCKER = "/usr/bin/docker"
USEC = 1_000_000
INFINITY = 2**64 - 1
KNOWN_FILLS = ("roce_gid_index",)
SGLANG_ENTRY = ("-m", "sglang.launch_server")
CONTAINER_COMMAND = ("python3", "-m", "sglang.launch_server")
CONTAINER_ADAPTER_DIR = "/opt/dsv41/rank"
CONTAINER_CACHE = "/root/.cache"
# Always present in the container's docker run, and exactly so: a rank needs IPC_LOCK (RDMA
# registers pinned memory) and nothing else of root's capabilities.
REQUIRED_DOCKER_FLAGS = (("--cap-drop", "ALL"), ("--cap-add", "IPC_LOCK"), ("--security-opt", "no-new-privileges"))

# The cluster config's passthrough prefixes (coordinator/schema.py PASSTHROUGH_PREFIXES) and the
# names the plan renders; nothing else reaches a rank's environment.
ENV_PREFIXES = ("NCCL_", "DSV41_", "SGLANG_", "PYTORCH_", "CUDA_", "TORCH_", "GLOO_", "TP_")
ENV_NAMES = frozenset({"PYTHONPATH", "LD_LIBRARY_PATH", "XDG_CACHE_HOME", "PYTHONPYCACHEPREFIX", "OFFLOAD_MODE",
                       "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"})
# Names whose value is code the rank loads (a library directory, a plugin, an injected library).
CODE_ENV = frozenset({"LD_LIBRARY_PATH", "NCCL_NET_PLUGIN", "NCCL_TUNER_PLUGIN", "NCCL_PROFILER_PLUGIN",
                      "NCCL_ENV_PLUGIN", "NCCL_CONF_FILE", "CUDA_INJECTION64_PATH"})
# Names whose value is a cache the rank writes and later loads (byte code, JIT kernels).
CACHE_ENV = frozenset({"XDG_CACHE_HOME", "PYTHONPYCACHEPREFIX", "SGLANG_CACHE_DIR", "CUDA_CACHE_PATH",
                       "TORCHINDUCTOR_CACHE_DIR", "TORCH_EXTENSIONS_DIR", "TORCH_HOME", "PYTORCH_KERNEL_CACHE_PATH"})

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_FINGERPRINT = re.compile(r"[0-9a-f]{1,64}")
_GENERATION = re.compile(r"[A-Za-z0-9_.:-]{0,64}")
_HCA = re.compile(r"[A-Za-z0-9][A-Za-z0-9_]{0,63}(:[0-9]{1,3})?")
_PATH_TOKEN = re.compile(r"[:,;=\s]")
# Paths a rank never needs to see re-mounted, and whose exposure would hand out the node.
_BIND_DENIED_PREFIXES = ("/etc", "/proc", "/sys", "/dev", "/boot", "/run", "/var/run", "/root/.ssh")
_BIND_DENIED_EXACT = {"/", "/usr", "/bin", "/sbin", "/lib", "/lib64", "/var", "/home", "/root", "/var/lib",
                      "/usr/bin", "/usr/lib", "/usr/sbin", "/usr/share"}
_DOCKER_FLAG_VALUES = {
    "--name": lambda v: v == CONTAINER_NAME,
    "--cidfile": lambda v: v == CIDFILE,
    "--network": lambda v: v == "host",
    "--ipc": lambda v: v == "host",
    "--gpus": lambda v: v == "all",
    "--device": lambda v: v == "/dev/infiniband:/dev/infiniband",
    "--cap-add": lambda v: v == "IPC_LOCK",
    "--cap-drop": lambda v: v == "ALL",
    "--security-opt": lambda v: v == "no-new-privileges",
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
    # For the agent to check on the node before the start (agent/pathtrust.py):
    trust: tuple[PathUse, ...] = field(default=())  # paths only root may have written
    # Host paths outside ALLOWED_PATHS the rank is shown (bind targets, paths in its flags and
    # environment): nothing of the node's may be there.
    targets: tuple[str, ...] = field(default=())
    cache_dir: str = ""  # the one directory the rank may write (its unit's ReadWritePaths=, HOME)
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


def under(path: str, roots: Iterable[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def check_under_roots(path: str, what: str, settings: AgentSettings) -> str:
    """`path` lies under ALLOWED_PATHS; SpecDenied names the roots and the fix otherwise."""
    norm = check_path(path, what)
    if not under(norm, settings.allowed_paths):
        roots = ", ".join(settings.allowed_paths) or "none"
        raise SpecDenied(f"{what} {norm}: not under this node's ALLOWED_PATHS ({roots}); add the directory that "
                         "holds it to ALLOWED_PATHS in /etc/dsv41/agent.env")
    return norm


# ------------------------------------------------------------------ environment

def check_env(env: Mapping[str, str], settings: AgentSettings, runtime: str) -> dict[str, str]:
    """Names and shapes; what the paths in the values may be is checked with the binds."""
    if len(env) > 512:
        raise SpecInvalid("env: at most 512 entries")
    out = {}
    for name, value in env.items():
        if not _ENV_NAME.fullmatch(name):
            raise SpecInvalid(f"env {name!r}: names are letters, digits and _ (not starting with a digit)")
        _text(value, f"env {name}")
        if name not in ENV_NAMES and not name.startswith(ENV_PREFIXES):
            raise SpecDenied(f"env {name}: not allowed for a rank; allowed are names starting with "
                             f"{', '.join(ENV_PREFIXES)} and {', '.join(sorted(ENV_NAMES))}")
        adapter = settings.adapter_dir if runtime == "host" else CONTAINER_ADAPTER_DIR
        if name == "PYTHONPATH" and value != adapter:
            raise SpecDenied(f"env PYTHONPATH: must be this node's adapter directory {adapter}")
        if name == "LD_LIBRARY_PATH":
            for part in value.split(":"):
                check_path(part, "env LD_LIBRARY_PATH entry")
        out[name] = value
    return out


def path_tokens(value: str) -> list[str]:
    """The absolute paths in an environment value or argument (`a:/x`, `--f=/y`, `/z,/w`),
    normalized; SpecInvalid for one with '..' (through a link it need not mean the parent)."""
    out = []
    for token in _PATH_TOKEN.split(value):
        if not token.startswith("/"):
            continue
        if ".." in token.split("/"):
            raise SpecInvalid(f"path {token!r}: must not contain '..'")
        out.append("/" + posixpath.normpath(token).lstrip("/"))
    return out


def _host_env_paths(env: Mapping[str, str], settings: AgentSettings, targets: Sequence[str],
                    readable: Sequence[str], absent: list[tuple[str, str]]) -> list[PathUse]:
    """What to check about the paths in the environment; paths under none of the rank's roots go
    to `absent`: the agent then requires that nothing exists there."""
    uses = []
    cache = settings.rank_cache_dir
    for name, value in env.items():
        if name == "PYTHONPATH":
            uses.append(PathUse(value, "env PYTHONPATH", code=True))
            continue
        for path in path_tokens(value):
            what = f"env {name}"
            if name in CACHE_ENV:
                if not under(path, [cache]):
                    raise SpecDenied(f"{what} {path}: a cache must be under {cache} (a cache holds code the rank "
                                     "loads again)")
                uses.append(PathUse(cache, f"{what} (cache directory)", code=True))
            elif name in CODE_ENV:
                for forbidden in (settings.state_dir, settings.cache_dir, "/tmp", "/dev/shm", "/var/tmp"):
                    if under(path, [forbidden]):
                        raise SpecDenied(f"{what} {path}: code is never loaded from {forbidden}")
                check_under_roots(path, what, settings)
                uses.append(PathUse(path, what, code=True))
            elif under(path, targets):
                continue  # a bind target: its source is checked
            elif under(path, [cache]):
                uses.append(PathUse(cache, f"{what} (cache directory)", code=True))
            elif under(path, readable):
                uses.append(PathUse(path, what, must_exist=False))
            else:
                check_bind_path(path, what)  # never a system directory
                absent.append((path, what))  # and only where nothing exists: it shows the rank nothing
    return uses


# ------------------------------------------------------------------ binds

def _readable_roots(settings: AgentSettings) -> tuple[str, ...]:
    """Where bind sources and the paths a host rank is shown may lie."""
    return (*settings.allowed_paths, settings.adapter_dir, posixpath.join(settings.state_dir, "state"))


def _check_source(source: str, read_only: bool, runtime: str, settings: AgentSettings, code: bool) -> PathUse:
    what = "bind source"
    if not read_only:
        cache = settings.container_cache_dir if runtime == "container" else None
        if source != cache:
            raise SpecDenied(f"{what} {source}: read-write binds are refused; the only one is the container's cache "
                             f"{settings.container_cache_dir}")
        return PathUse(source, "the container's cache", code=True)
    if under(source, [settings.adapter_dir]):
        return PathUse(source, what, code=True)
    if under(source, [posixpath.join(settings.state_dir, "state")]):
        if code:
            raise SpecDenied(f"{what} {source}: the agent's state directory holds files the coordinator sent; "
                             "code is never loaded from it")
        return PathUse(source, what)
    check_under_roots(source, what, settings)
    return PathUse(source, what, code=code)


def _check_host_target(target: str) -> str:
    norm = check_bind_path(target, "bind target")
    if norm == "/":
        raise SpecDenied("bind target /: refused")
    return norm


# ------------------------------------------------------------------ argv

def _flags(args: Sequence[str], what: str) -> None:
    if args and not args[0].startswith("--"):
        raise SpecDenied(f"argv: {what} takes the rank's flags (--name value ...), not {args[0]!r}")


def _check_host_entry(argv: Sequence[str], settings: AgentSettings) -> tuple[str, int]:
    """(executable, index of the first flag) for the host runtime's fixed entry."""
    exe = check_path(argv[0], "argv[0]")
    if exe in settings.allowed_pythons:
        if tuple(argv[1:3]) != SGLANG_ENTRY:
            raise SpecDenied(f"argv: {exe} is an allowed Python: it runs only `{exe} -m sglang.launch_server FLAGS`, "
                             f"not {' '.join(argv[1:3])!r}")
        _flags(argv[3:], "sglang.launch_server")
        return exe, 3
    if exe in settings.allowed_executables:
        _flags(argv[1:], exe)
        return exe, 1
    allowed = ", ".join([*settings.allowed_pythons, *settings.allowed_executables]) or \
        "none (set ALLOWED_PYTHONS or ALLOWED_EXECUTABLES in agent.env)"
    raise SpecDenied(f"executable {exe}: not allowed on this node; allowed: {allowed}")


def _check_docker(argv: Sequence[str], env: Mapping[str, str], settings: AgentSettings
                  ) -> tuple[list[tuple[str, str, bool]], int]:
    """The -v binds (source, target, read_only) and the index of the rank's first flag."""
    if list(argv[:2]) != [DOCKER, "run"]:
        raise SpecInvalid(f"argv: the container runtime runs `{DOCKER} run ...`")
    i, forwarded, given, volumes = 2, set(), [], []
    while i < len(argv) and argv[i].startswith("-"):
        flag = argv[i]
        if flag == "--rm":
            given.append((flag, ""))
            i += 1
            continue
        if i + 1 >= len(argv):
            raise SpecInvalid(f"argv: {flag} needs a value")
        value = argv[i + 1]
        if flag == "-v":
            parts = value.split(":")
            if len(parts) != 3 or parts[2] not in ("ro", "rw"):
                raise SpecInvalid(f"argv: -v {value!r}: must be SOURCE:TARGET:ro|rw")
            volumes.append((check_path(parts[0], "bind source"), check_bind_path(parts[1], "bind target"),
                            parts[2] == "ro"))
        elif flag == "-e":
            if value not in env:
                raise SpecInvalid(f"argv: -e {value}: forwards a variable that env does not define")
            forwarded.add(value)
        elif flag not in _DOCKER_FLAG_VALUES:
            raise SpecDenied(f"argv: docker flag {flag} is not one a rank needs")
        elif not _DOCKER_FLAG_VALUES[flag](value):
            raise SpecDenied(f"argv: {flag} {value}: not allowed for a rank")
        given.append((flag, value))
        i += 2
    # --cidfile is not required: an agent upgraded before the coordinator (the packages upgrade
    # independently) must still start the ranks its plans describe; the floor then signals only the
    # docker client.
    if ("--rm", "") not in given or "--name" not in dict(given):
        raise SpecInvalid(f"argv: the rank container must be run with --rm --name {CONTAINER_NAME}")
    missing = [f"{f} {v}" for f, v in REQUIRED_DOCKER_FLAGS if (f, v) not in given]
    if missing:
        raise SpecDenied(f"argv: the rank container must run with {', '.join(missing)} (a rank needs no other "
                         "capability of root)")
    if i >= len(argv):
        raise SpecInvalid("argv: no image after the docker flags")
    image = argv[i]
    if image not in settings.allowed_images:
        allowed = ", ".join(settings.allowed_images) or "none (set ALLOWED_IMAGES in agent.env)"
        raise SpecDenied(f"image {image}: not allowed on this node; allowed (by digest): {allowed}")
    command = tuple(argv[i + 1:i + 1 + len(CONTAINER_COMMAND)])
    if command != CONTAINER_COMMAND:
        raise SpecDenied(f"argv: the container runs `{' '.join(CONTAINER_COMMAND)} FLAGS`, not {' '.join(command)!r}")
    first = i + 1 + len(CONTAINER_COMMAND)
    _flags(argv[first:], "sglang.launch_server")
    if missing_env := sorted(set(env) - forwarded):
        raise SpecInvalid(f"argv: env entries not forwarded into the container with -e: {', '.join(missing_env)}")
    return volumes, first


# ------------------------------------------------------------------ the request

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
    requested = [(check_path(s, "bind source"), check_path(t, "bind target"), bool(ro)) for s, t, ro in binds]
    if runtime == "host":
        trust, targets, checked_binds = _check_host_launch(argv, env, requested, settings)
        cache_dir = settings.rank_cache_dir
    else:
        trust, targets, checked_binds = _check_container_launch(argv, env, requested, settings)
        cache_dir = settings.container_cache_dir
    pre, post = tuple(tuple(c) for c in exec_start_pre), tuple(tuple(c) for c in exec_stop_post)
    _check_unit_fields(runtime, pre, post, stop_timeout_s, memory_max, memory_high)
    _check_identity(fingerprint, rank, generation, fabric_address, bool(fills), hcas)
    floor = check_floor(memory_floor, floor_kill_after_ms, floor_interval_ms)
    return RankLaunch(runtime, argv, env, dict(fills), checked_binds, pre, post, stop_timeout_s, memory_max,
                      memory_high, fingerprint, rank, generation, fabric_address, tuple(hcas), tuple(trust),
                      tuple(dict.fromkeys(targets)), cache_dir, floor)


Checked = tuple[list[PathUse], list[str], tuple[Bind, ...]]  # paths to trust, targets that must not exist, binds


def _check_host_launch(argv: tuple[str, ...], env: Mapping[str, str], requested: list[tuple[str, str, bool]],
                       settings: AgentSettings) -> Checked:
    trust: list[PathUse] = []
    targets: list[str] = []
    exe, first = _check_host_entry(argv, settings)
    # A missing one fails the start (status 203); only who may create it matters here.
    trust.append(PathUse(exe, "executable", code=True, must_exist=False))
    code_dirs = set(path_tokens(env.get("LD_LIBRARY_PATH", "")))
    checked = []
    for source, target, ro in requested:
        if not ro:
            raise SpecDenied(f"bind {source}:{target}: read-write binds are refused for the host runtime")
        trust.append(_check_source(source, True, "host", settings, code=target in code_dirs))
        target = _check_host_target(target)
        if not under(target, settings.allowed_paths):
            targets.append(target)
        checked.append(Bind(source, target, True))
    bind_targets = [b.target for b in checked]
    readable = _readable_roots(settings)
    absent: list[tuple[str, str]] = []
    trust += _host_env_paths(env, settings, bind_targets, readable, absent)
    targets += [path for path, _ in absent]
    for arg in argv[first:]:
        for path in path_tokens(arg):
            if under(path, bind_targets):
                continue
            if under(path, [settings.rank_cache_dir]):
                trust.append(PathUse(settings.rank_cache_dir, "argv (cache directory)", code=True))
            elif under(path, readable):
                trust.append(PathUse(path, f"argv {arg}", must_exist=False))
            else:
                targets.append(check_bind_path(path, f"argv {arg}"))  # nothing may exist there
    return trust, targets, tuple(checked)


def _check_container_launch(argv: tuple[str, ...], env: Mapping[str, str], requested: list[tuple[str, str, bool]],
                            settings: AgentSettings) -> Checked:
    trust: list[PathUse] = []
    volumes, _ = _check_docker(argv, env, settings)
    code_targets = {CONTAINER_ADAPTER_DIR, *path_tokens(env.get("LD_LIBRARY_PATH", ""))}
    for source, target, ro in volumes:
        if not ro and target != CONTAINER_CACHE:
            raise SpecDenied(f"-v {source}:{target}:rw: the only read-write bind is the cache at {CONTAINER_CACHE}")
        trust.append(_check_source(source, ro, "container", settings, code=target in code_targets))
    for path in path_tokens(env.get("LD_LIBRARY_PATH", "")):
        if not any(ro and target == path for _, target, ro in volumes):
            raise SpecDenied(f"env LD_LIBRARY_PATH entry {path}: must be a read-only bind target of the container")
    if "PYTHONPATH" in env and not any(t == CONTAINER_ADAPTER_DIR and ro and s == settings.adapter_dir
                                       for s, t, ro in volumes):
        raise SpecDenied(f"env PYTHONPATH={CONTAINER_ADAPTER_DIR}: needs -v {settings.adapter_dir}:"
                         f"{CONTAINER_ADAPTER_DIR}:ro")
    return trust, [], tuple(Bind(s, t, ro) for s, t, ro in requested)


def _check_unit_fields(runtime: str, pre: tuple[tuple[str, ...], ...], post: tuple[tuple[str, ...], ...],
                       stop_timeout_s: int, memory_max: int, memory_high: int) -> None:
    cleanup = (DOCKER, "rm", "--force", CONTAINER_NAME)
    for what, commands in (("exec_start_pre", pre), ("exec_stop_post", post)):
        if any(c != cleanup for c in commands) or (commands and runtime != "container"):
            raise SpecDenied(f"{what}: only `{' '.join(cleanup)}` is allowed, and only for the container runtime")
    if not 1 <= stop_timeout_s <= 3600:
        raise SpecInvalid(f"stop_timeout_s {stop_timeout_s}: must be 1..3600")
    for name, value in (("memory_max_bytes", memory_max), ("memory_high_bytes", memory_high)):
        if value and value < 64 << 20:
            raise SpecInvalid(f"{name} {value}: must be 0 (no limit) or at least 64 MiB")


def _check_identity(fingerprint: str, rank: int, generation: str, fabric_address: str, fills: bool,
                    hcas: Sequence[str]) -> None:
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


# Sandboxing of the rank unit, as far as the engine allows: SGLang needs the GPU and RDMA devices
# (no PrivateDevices=, and no ProtectClock=, which implies a device allow-list), JIT compilers (no
# MemoryDenyWriteExecute=), netlink (ibverbs) and IPC_LOCK; it writes only its cache (HOME points
# there). No PrivateTmp=: the recipe's model is under /var/tmp.
SANDBOX: tuple[tuple[str, str, object], ...] = (
    ("NoNewPrivileges", "b", True),
    ("ProtectSystem", "s", "strict"),
    ("ProtectHome", "s", "read-only"),
    ("ProtectKernelTunables", "b", True),
    ("ProtectKernelModules", "b", True),
    ("ProtectKernelLogs", "b", True),
    ("ProtectControlGroups", "b", True),
    ("ProtectHostname", "b", True),
    ("ProtectProc", "s", "invisible"),
    ("RestrictSUIDSGID", "b", True),
    ("RestrictRealtime", "b", True),
    ("RestrictNamespaces", "t", 0),  # none: a rank creates no namespaces (docker's are dockerd's)
    ("LockPersonality", "b", True),
    ("RemoveIPC", "b", True),
    ("RestrictAddressFamilies", "(bas)", (True, ["AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"])),
    ("SystemCallArchitectures", "as", ["native"]),
    # A deny-list of system call groups nothing in a rank uses (@debug stays: CUDA may share memory
    # between processes through pidfd_getfd).
    ("SystemCallFilter", "(bas)", (False, ["@clock", "@cpu-emulation", "@module", "@mount", "@obsolete",
                                          "@raw-io", "@reboot", "@swap"])),
    ("SystemCallErrorNumber", "i", 1),  # EPERM
    ("CapabilityBoundingSet", "t", (1 << 14) | (1 << 23)),  # CAP_IPC_LOCK, CAP_SYS_NICE
    ("UMask", "u", 0o027),
)


def unit_properties(launch: RankLaunch, env: Mapping[str, str], node: str, working_directory: str,
                    adapter_version: str = "") -> list[tuple[str, str, object]]:
    """(name, D-Bus signature, value) for StartTransientUnit; the systemd client wraps them in variants.
    adapter_version: the installed adapter's, which this run loads (recorded with the unit, outside
    the plan's fingerprint)."""
    def cmd(argv: Sequence[str], ignore_failure: bool) -> tuple[str, list[str], bool]:
        return (argv[0], list(argv), ignore_failure)

    extra = [f"DSV41_NODE={node}", f"DSV41_RANK={launch.rank}", f"DSV41_FINGERPRINT={launch.fingerprint}",
             f"DSV41_GENERATION={launch.generation}", "DSV41_UNIT=dsv41-rank",
             *adapter_version_field(adapter_version)]
    env = dict(env)
    if launch.runtime == "host" and launch.cache_dir:
        # `python -m` puts the working directory first on sys.path; and whatever writes to ~ writes
        # to the cache, the one directory the unit may write.
        env.setdefault("PYTHONSAFEPATH", "1")
        env.setdefault("HOME", launch.cache_dir)
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
        *SANDBOX,
    ]
    if launch.cache_dir:
        props.append(("ReadWritePaths", "as", [launch.cache_dir]))
    if launch.runtime == "container":
        # Where the client writes --cidfile: created for each start, removed at stop (docker refuses
        # a cidfile that exists).
        props.append(("RuntimeDirectory", "as", [CIDFILE_DIR]))
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
