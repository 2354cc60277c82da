"""Renders, from a validated ClusterConfig, what each node must run.

A pure function: config in, NodePlan out. Ranks of one TP group hang when they disagree, so every
node's plan is identical except the rank, the node's address and the RoCE GID index (which only the
node's agent can read; it is left as a placeholder the agent fills in).
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from dataclasses import asdict, dataclass, field, replace
from typing import Mapping

from dsv41.admission import LONE_WAIT_S

from . import groups
from .config import ClusterConfig, Node
from .guard.settings import cost_model
from .schema import KEYS

# Where the dsv41-adapter package installs the rank's PYTHONPATH entry (sitecustomize.py + adapter/).
ADAPTER_DIR = "/usr/share/dsv41/rank"
CONTAINER_ADAPTER_DIR = "/opt/dsv41/rank"
CONTAINER_NCCL_DIR = "/opt/dsv41/nccl"
STATE_DIR = "/var/lib/dsv41/state"  # DSpark tables copied from the head live here on every node
RANK_CACHE_DIR = "/var/cache/dsv41/rank"  # JIT and autotune caches that should survive a restart
# The container's caches are its own: what a container wrote is never loaded by a host-runtime rank.
CONTAINER_CACHE_DIR = "/var/cache/dsv41/container"
CONTAINER_NAME = "dsv41-rank"
# The client writes the container's id here (the unit's RuntimeDirectory): the node floor finds the
# container's processes by it, without asking dockerd (agent/container.py).
CONTAINER_ID_FILE = "/run/dsv41-rank/container.id"
# The API key (API_KEY_FILE on the head) is put here on the head, 0600; only rank 0 serves HTTP. The rank
# reads the file named by DSV41_API_KEY_FILE: a key in argv would be visible in ps.
API_KEY_NODE_PATH = f"{STATE_DIR}/sglang-api-key"
CONTAINER_API_KEY_PATH = "/opt/dsv41/secrets/sglang-api-key"
DOCKER = "/usr/bin/docker"

# RANK_DEVICE: the GPU path is DeepSeek-V4's kernels; the CPU rehearsal is SGLang's CPU engine with
# a small dense model (docs/cpu-rehearsal.md), where DeepSeek's parsers have nothing to parse.
_GPU_ENGINE_ARGS = ("--attention-backend", "dsv4", "--moe-runner-backend", "flashinfer_mxfp4")
_DEEPSEEK_PARSER_ARGS = ("--tool-call-parser", "deepseekv41", "--reasoning-parser", "deepseek-v41")
_CPU_ENGINE_ARGS = ("--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch")
# Without it SGLang's CPU path imports vllm for RoPE; the hubs are never reached from a rank.
_CPU_ENGINE_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

GID_PLACEHOLDER = "@ROCE_GID_INDEX@"
ENGRAM_LAYERS = (1, 14)
# The recipe exported with no_root_squash,insecure; NFS_EXPORT_OPTIONS restores that when asked to.
EXPORT_OPTIONS = "ro,sync,no_subtree_check,root_squash,secure,fsid=0"
MOUNT_OPTIONS = "nfsvers=4.2,ro,nosuid,nodev,nconnect=8,rsize=1048576,wsize=1048576,hard,timeo=600"
# A rank needs IPC_LOCK (RDMA pins memory) and no other capability of root.
CONTAINER_HARDENING = ("--cap-drop", "ALL", "--cap-add", "IPC_LOCK", "--security-opt", "no-new-privileges")
# Keys that become something else in the rank's environment, or nothing.
_ENV_RENAMES = {"IB_HCA": "NCCL_IB_HCA"}


@dataclass(frozen=True)
class Bind:
    source: str  # path on the node
    target: str  # path inside the rank
    read_only: bool = True


@dataclass(frozen=True)
class RankSpec:
    runtime: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    # Environment entries whose value is a placeholder the node's agent replaces with what it measures.
    agent_fills: Mapping[str, str]
    # Paths made visible to the rank; the container runtime already has them in argv as -v,
    # the host runtime needs them as the unit's BindReadOnlyPaths=.
    binds: tuple[Bind, ...]
    exec_start_pre: tuple[tuple[str, ...], ...]
    exec_stop_post: tuple[tuple[str, ...], ...]
    stop_timeout_s: int
    # The image a container rank runs ("" for the host runtime); also in argv. Not part of the
    # fingerprint's body (to_json), which argv already covers.
    image: str = ""
    # The node's last line (MEMORY_FLOOR_GB), kept by the agent for the unit's run. Not part of
    # the fingerprint either: the ranks need not agree on it, and changing it must not restart
    # them (a running rank keeps the floor it was started with).
    memory_floor_bytes: int = 0
    memory_floor_kill_after_ms: int = 0
    memory_floor_interval_ms: int = 0


@dataclass(frozen=True)
class ExportSpec:
    path: str
    clients: tuple[str, ...]
    options: str
    backend: str
    name: str


@dataclass(frozen=True)
class MountSpec:
    what: str
    where: str
    type: str
    options: str
    server: str
    expected_shards: int


@dataclass(frozen=True)
class Peer:
    name: str
    address: str
    port: int


@dataclass(frozen=True)
class FabricSpec:
    hcas: tuple[str, ...]
    iface: str
    address: str
    mtu: int
    socket_ifaces: tuple[str, ...]
    peers: tuple[Peer, ...]


@dataclass(frozen=True)
class PackSpec:
    source_dir: str  # where the checkpoint is visible on this node
    out_dir: str
    tp: int
    ranks: tuple[int, ...]  # TP ranks this node holds
    layers: tuple[int, ...]
    required: bool  # OFFLOAD_MODE=nvme reads the packs
    run_if_missing: bool  # SKIP_PREPARE=0


@dataclass(frozen=True)
class NodePlan:
    node: str
    rank: int
    address: str
    rank_spec: RankSpec
    export: ExportSpec | None
    mount: MountSpec | None
    fabric: FabricSpec
    pack: PackSpec
    dspark_tables: Mapping[str, str] = field(default_factory=dict)  # rank path -> node path
    fingerprint: str = ""

    def to_json(self) -> dict:
        return {
            "node": self.node,
            "rank": self.rank,
            "address": self.address,
            "runtime": self.rank_spec.runtime,
            "argv": list(self.rank_spec.argv),
            "env": dict(self.rank_spec.env),
            "agent_fills": dict(self.rank_spec.agent_fills),
            "binds": [asdict(b) for b in self.rank_spec.binds],
            "exec_start_pre": [list(c) for c in self.rank_spec.exec_start_pre],
            "exec_stop_post": [list(c) for c in self.rank_spec.exec_stop_post],
            "stop_timeout_s": self.rank_spec.stop_timeout_s,
            "export": asdict(self.export) if self.export else None,
            "mount": asdict(self.mount) if self.mount else None,
            "fabric": asdict(self.fabric),
            "pack": asdict(self.pack),
            "dspark_tables": dict(self.dspark_tables),
            "fingerprint": self.fingerprint,
        }


def render_cluster(cfg: ClusterConfig, *, dspark_tables: bool = False) -> tuple[NodePlan, ...]:
    return tuple(render_node(cfg, node.name, dspark_tables=dspark_tables) for node in cfg.nodes)


def render_node(cfg: ClusterConfig, name: str, *, dspark_tables: bool = False) -> NodePlan:
    """The plan of one node (with several GROUPS, as its group runs it). `dspark_tables` is True only when
    the coordinator has verified that every rank holds identical copies of the configured tables;
    otherwise no rank gets the table flags."""
    cfg = groups.config_of(cfg, name)
    node = cfg.node(name)
    tables = _tables(cfg) if dspark_tables else {}
    spec = _rank_spec(cfg, node, tables)
    plan = NodePlan(
        node=node.name,
        rank=node.rank,
        address=node.address,
        rank_spec=spec,
        export=_export(cfg) if node.share_head and cfg.flag("NFS_SHARE") else None,
        mount=_mount(cfg, node) if not node.share_head and cfg.flag("NFS_SHARE") else None,
        fabric=_fabric(cfg, node),
        pack=_pack(cfg, node),
        dspark_tables=tables,
    )
    return _with_fingerprint(plan)


def model_path_on(cfg: ClusterConfig, node: Node) -> str:
    """Where the checkpoint is on the node itself: the head's MODEL_DIR, a worker's mount or copy."""
    return cfg.text("MODEL_DIR") if node.share_head else cfg.text("COMMON_MODEL")


def sglang_args(cfg: ClusterConfig, node: Node, tables: Mapping[str, str]) -> list[str]:
    head_fraction = cfg.optional_number("HEAD_MEM_FRACTION_STATIC") if node.is_head else None
    fraction = head_fraction or cfg.number("MEM_FRACTION_STATIC")
    args = [
        "--model-path", cfg.text("COMMON_MODEL"),
        "--served-model-name", cfg.text("SERVED_MODEL_NAME"),
        "--trust-remote-code",
        "--load-format", "safetensors",
        "--tp-size", str(cfg.integer("TP_SIZE")),
        "--ep-size", str(cfg.integer("EP_SIZE")),
        *(_CPU_ENGINE_ARGS if cfg.text("RANK_DEVICE") == "cpu" else _GPU_ENGINE_ARGS),
        "--mem-fraction-static", f"{fraction:g}",
        "--chunked-prefill-size", str(cfg.integer("CHUNKED_PREFILL_SIZE")),
        "--context-length", str(cfg.integer("CONTEXT_LENGTH")),
        "--max-running-requests", str(cfg.integer("MAX_RUNNING_REQUESTS")),
        "--random-seed", "0",
        "--enable-cache-report",
        *(() if cfg.text("RANK_DEVICE") == "cpu" else _DEEPSEEK_PARSER_ARGS),
        "--host", "0.0.0.0",
        "--port", str(cfg.integer("PORT")),
    ]
    if cfg.text("SPEC_ALGO") != "NONE":
        args += ["--speculative-algorithm", cfg.text("SPEC_ALGO")]
    if cfg.text("SPEC_ALGO") == "DSPARK":
        args += ["--speculative-dspark-block-size", str(cfg.integer("DSPARK_BLOCK_SIZE"))]
        if (sps := cfg.optional_text("DSPARK_SPS_TABLE")) and sps in tables:
            args += ["--speculative-dspark-sps-table-path", sps]
        if (sts := cfg.optional_text("DSPARK_STS_TABLE")) and sts in tables:
            args += ["--speculative-dspark-confidence-sts-path", sts]
    args += [
        "--nnodes", str(cfg.integer("NNODES")),
        "--node-rank", str(node.rank),
        "--dist-init-addr", f"{cfg.text('HEAD_IP')}:{cfg.integer('DIST_PORT')}",
        "--max-total-tokens", str(cfg.integer("MAX_TOTAL_TOKENS")),
    ]
    return args + list(cfg.words("EXTRA_SGLANG_ARGS"))


def _tables(cfg: ClusterConfig) -> dict[str, str]:
    if cfg.text("SPEC_ALGO") != "DSPARK":
        return {}
    paths = [cfg.optional_text("DSPARK_SPS_TABLE"), cfg.optional_text("DSPARK_STS_TABLE")]
    return {p: posixpath.join(STATE_DIR, posixpath.basename(p)) for p in paths if p}


def _rank_env(cfg: ClusterConfig, node: Node, container: bool) -> dict[str, str]:
    env = {k.name: cfg.raw[k.name] for k in KEYS if k.to_rank_env}
    env.update({_ENV_RENAMES[k]: ",".join(cfg.words(k)) for k in _ENV_RENAMES})
    env.update(cfg.passthrough)
    if uses_roce(cfg):
        env["NCCL_IB_GID_INDEX"] = GID_PLACEHOLDER
    if cfg.text("RANK_DEVICE") == "cpu":
        env.update(_CPU_ENGINE_ENV)
    env["SGLANG_HOST_IP"] = node.address
    env["DSV41_SOURCE"] = cfg.text("COMMON_MODEL")  # arms the adapter's sitecustomize.py
    env.update(admission_env(cfg))
    env["PYTHONPATH"] = CONTAINER_ADAPTER_DIR if container else ADAPTER_DIR
    if nccl_dir := cfg.optional_text("NCCL_HOST_DIR"):
        env["LD_LIBRARY_PATH"] = CONTAINER_NCCL_DIR if container else nccl_dir
    # /root/.cache is CONTAINER_CACHE_DIR: `dsv41ctl autotune reset` clears both runtimes' caches.
    env["SGLANG_CACHE_DIR"] = "/root/.cache/sglang" if container else f"{RANK_CACHE_DIR}/sglang"
    if not container:
        env["XDG_CACHE_HOME"] = RANK_CACHE_DIR
        # byte code goes to the cache, not into package directories such as the adapter's
        env["PYTHONPYCACHEPREFIX"] = f"{RANK_CACHE_DIR}/pycache"
    if cfg.optional_text("API_KEY_FILE") and node.is_head:
        env["DSV41_API_KEY_FILE"] = CONTAINER_API_KEY_PATH if container else API_KEY_NODE_PATH
    return dict(sorted(env.items()))


def admission_env(cfg: ClusterConfig) -> dict[str, str]:
    """The admission gate's settings (the rule: dsv41/admission.py; the rank's gate and the
    stand-in's apply it): the guard's level and cost model, so that the rank holds back what the
    guard would have to abort, and the guard's projection knows it does (guard.settings.cost_model);
    a level of 0 is off."""
    cost = cost_model(cfg, cfg.passthrough)
    if not cost.admission_guard_bytes:
        return {"DSV41_ADMISSION_GUARD_BYTES": "0"}
    # A request alone is held for the guard to abort only where the guard acts.
    lone = LONE_WAIT_S if cfg.text("MEMORY_GUARD") == "act" else 0.0
    return {"DSV41_ADMISSION_GUARD_BYTES": str(cost.admission_guard_bytes),
            "DSV41_ADMISSION_TOKEN_BYTES": str(cost.token_bytes),
            "DSV41_ADMISSION_TRANSIENT_BYTES": repr(cost.transient_bytes),
            "DSV41_ADMISSION_LONE_WAIT_S": repr(lone)}


def uses_roce(cfg: ClusterConfig) -> bool:
    """NCCL runs over RoCE (and so needs the node's GID index) unless IB is disabled or Socket is chosen."""
    return cfg.text("NCCL_NET") == "IB" and not cfg.flag("NCCL_IB_DISABLE")


def _binds(cfg: ClusterConfig, node: Node, tables: Mapping[str, str], container: bool) -> list[Bind]:
    binds = [Bind(model_path_on(cfg, node), cfg.text("COMMON_MODEL"))]
    if cfg.text("OFFLOAD_MODE") == "nvme":
        binds.append(Bind(cfg.text("ENGRAM_DIR"), cfg.text("DSV41_PACKED_DIR")))
    binds += [Bind(node_path, rank_path) for rank_path, node_path in tables.items()]
    if container:
        binds.append(Bind(ADAPTER_DIR, CONTAINER_ADAPTER_DIR))
        if nccl_dir := cfg.optional_text("NCCL_HOST_DIR"):
            binds.append(Bind(nccl_dir, CONTAINER_NCCL_DIR))
        binds.append(Bind(CONTAINER_CACHE_DIR, "/root/.cache", read_only=False))
        if cfg.optional_text("API_KEY_FILE") and node.is_head:
            binds.append(Bind(API_KEY_NODE_PATH, CONTAINER_API_KEY_PATH))
    # A bind onto itself is a no-op for the host runtime; keep the list to what changes the view.
    return [b for b in binds if container or b.source != b.target]


def _rank_spec(cfg: ClusterConfig, node: Node, tables: Mapping[str, str]) -> RankSpec:
    floor = int(cfg.number("MEMORY_FLOOR_GB") * 1_000_000_000)
    return replace(_rank_launch(cfg, node, tables), memory_floor_bytes=floor,
                   memory_floor_kill_after_ms=round(cfg.number("MEMORY_FLOOR_KILL_AFTER_S") * 1000) if floor else 0,
                   memory_floor_interval_ms=cfg.integer("MEMORY_GUARD_INTERVAL_MS") if floor else 0)


# What the model gateway takes from the head rank's runtime (agent/gateway.py runs adapter/gateway.py
# in it): the adapter's import path and the API key's file. Nothing else, so that a change to what
# the ranks run does not change the gateway's unit, which the agent would restart.
GATEWAY_ENV = ("PYTHONPATH", "DSV41_API_KEY_FILE")


def gateway_launch(cfg: ClusterConfig) -> tuple[RankSpec, str]:
    """The head rank's runtime as the gateway runs in it (its Python or image, its adapter and key
    binds and environment only), and its fingerprint, which the agent checks as a rank's."""
    spec = _rank_launch(cfg, cfg.head, {}, only_env=GATEWAY_ENV)
    return spec, hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:16]


def _rank_launch(cfg: ClusterConfig, node: Node, tables: Mapping[str, str],
                 only_env: tuple[str, ...] | None = None) -> RankSpec:
    container = cfg.text("RANK_RUNTIME") == "container"
    env = _rank_env(cfg, node, container)
    binds = _binds(cfg, node, tables, container)
    args = sglang_args(cfg, node, tables)
    stop = cfg.integer("RANK_STOP_TIMEOUT_S")
    fills = {"NCCL_IB_GID_INDEX": "roce_gid_index"} if uses_roce(cfg) else {}
    if only_env is not None:
        env = {k: v for k, v in env.items() if k in only_env}
        fills = {k: v for k, v in fills.items() if k in only_env}
        needed = {v for k, v in env.items() if k != "PYTHONPATH"} | {env.get("PYTHONPATH", "")}
        binds = [b for b in binds if b.target in needed]
        args = []  # the agent runs the gateway's module in place of SGLang and its flags
    if not container:
        if cfg.text("RANK_ENGINE") == "sim":
            argv = [cfg.text("SIM_RANK_COMMAND"), *args]
        else:
            argv = [cfg.text("RANK_PYTHON"), "-m", "sglang.launch_server", *args]
        return RankSpec("host", tuple(argv), env, fills, tuple(binds), (), (), stop)
    image = cfg.optional_text("IMAGE") or cfg.text("BASE_IMAGE")
    docker = [DOCKER, "run", "--rm", "--name", CONTAINER_NAME, "--cidfile", CONTAINER_ID_FILE,
              "--network", "host", "--ipc", "host", "--gpus", "all", "--device", "/dev/infiniband:/dev/infiniband",
              *CONTAINER_HARDENING,
              "--ulimit", "memlock=-1:-1", "--ulimit", "stack=67108864", "--stop-timeout", str(stop)]
    for bind in binds:
        docker += ["-v", f"{bind.source}:{bind.target}:{'ro' if bind.read_only else 'rw'}"]
    # `-e NAME` without a value takes it from the unit's environment: values stay out of argv.
    for key in env:
        docker += ["-e", key]
    argv = [*docker, image, "python3", "-m", "sglang.launch_server", *args]
    remove = (DOCKER, "rm", "--force", CONTAINER_NAME)
    return RankSpec("container", tuple(argv), env, fills, tuple(binds),
                    (remove,), (remove,), stop, image)


def _export(cfg: ClusterConfig) -> ExportSpec:
    return ExportSpec(cfg.text("MODEL_DIR"), cfg.optional_words("NFS_CLIENTS") or (), cfg.text("NFS_EXPORT_OPTIONS"),
                      cfg.text("NFS_BACKEND"), cfg.text("NFS_EXPORT_NAME"))


def _mount(cfg: ClusterConfig, node: Node) -> MountSpec:
    # With fsid=0 the kernel export is the NFSv4 root; nfs-ganesha publishes it at its pseudo path.
    path = "/" if cfg.text("NFS_BACKEND") == "kernel" else "/" + cfg.text("NFS_EXPORT_NAME")
    return MountSpec(f"{node.nfs_server}:{path}", cfg.text("COMMON_MODEL"), "nfs4", MOUNT_OPTIONS,
                     str(node.nfs_server), cfg.integer("EXPECTED_SHARDS"))


def _fabric(cfg: ClusterConfig, node: Node) -> FabricSpec:
    sockets = tuple(dict.fromkeys([*cfg.words("GLOO_SOCKET_IFNAME"), *cfg.words("NCCL_SOCKET_IFNAME")]))
    peers = [Peer(n.name, n.address, cfg.integer("AGENT_PORT")) for n in cfg.nodes if n.name != node.name]
    if node.nfs_server and cfg.flag("NFS_SHARE"):
        peers.append(Peer(f"{cfg.head.name} (NFS)", node.nfs_server, 2049))
    # Without RoCE (NCCL_NET=Socket or IB disabled) the HCAs are not used, so they are not checked.
    hcas = cfg.words("IB_HCA") if uses_roce(cfg) else ()
    return FabricSpec(hcas, cfg.text("FABRIC_IFACE"), node.address, cfg.integer("FABRIC_MTU"),
                      sockets, tuple(peers))


def _pack(cfg: ClusterConfig, node: Node) -> PackSpec:
    tp, nnodes = cfg.integer("TP_SIZE"), cfg.integer("NNODES")
    per_node = tp // nnodes
    ranks = tuple(range(node.rank * per_node, (node.rank + 1) * per_node))
    return PackSpec(model_path_on(cfg, node), cfg.text("ENGRAM_DIR"), tp, ranks, ENGRAM_LAYERS,
                    cfg.text("OFFLOAD_MODE") == "nvme", not cfg.flag("SKIP_PREPARE"))


def _with_fingerprint(plan: NodePlan) -> NodePlan:
    body = plan.to_json()
    body.pop("fingerprint")
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
    return NodePlan(**{**plan.__dict__, "fingerprint": digest})
