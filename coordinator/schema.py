"""Every key cluster.env may hold: its type, default and meaning.

The table is the documentation: `dsv41ctl config keys` prints it. Defaults are the values of the
recipe's example configuration, where each was measured; keys the agents make unnecessary are
listed in UNUSED with the reason, so an existing file keeps loading. The keys the rank's adapters
read are declared once, with the adapter, in dsv41/rankadapters.py; their entries here (parser,
default, help) are derived from those declarations.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv41 import rankadapters
from dsv41.ranksettings import Kind, Setting

from . import values as v

KV_PAGE_TOKENS = 256
MAX_CONTEXT = rankadapters.MAX_CONTEXT
MAX_NODES = 8
PASSTHROUGH_PREFIXES = ("NCCL_", "DSV41_", "SGLANG_", "PYTORCH_", "CUDA_", "TORCH_", "GLOO_", "TP_")


@dataclass(frozen=True)
class Key:
    name: str
    parse: v.Parser
    default: str | None  # None: required; "": optional and empty
    doc: str
    to_rank_env: bool = False  # passed to the rank's environment as written


def _k(name: str, parse: v.Parser, default: str | None, doc: str, env: bool = False) -> Key:
    return Key(name, parse, default, doc, env)


def _parser(setting: Setting) -> v.Parser:
    """The cluster.env parser of a rank-side setting: the same type and allowed values as the rank's."""
    if setting.kind is Kind.INTEGER:
        return v.integer(int(setting.low), int(setting.high))
    if setting.kind is Kind.REAL:
        return v.real(setting.low, setting.high, lo_open=setting.low_open, hi_open=setting.high_open)
    if setting.kind is Kind.CHOICE:
        return v.choice(*setting.choices)
    simple = {Kind.FLAG: v.flag, Kind.PATH: v.abspath, Kind.VERIFY_CAP: v.verify_cap,
              Kind.REASONING_EFFORT: v.reasoning_effort}
    if setting.kind not in simple:
        raise ValueError(f"{setting.name}: a {setting.kind.value} setting has no cluster.env key")
    return simple[setting.kind]


def _rank_keys() -> tuple[Key, ...]:
    """The cluster.env keys the adapters read, from their declarations, passed to the rank as written."""
    return tuple(Key(s.name, _parser(s), s.default, s.help, to_rank_env=True)
                 for s in rankadapters.settings().values() if s.in_cluster_env)


_NCCL_SUBSYS = ("INIT", "COLL", "P2P", "SHM", "NET", "GRAPH", "TUNING", "ENV", "ALLOC", "CALL", "PROXY",
                "NVLS", "BOOTSTRAP", "REG", "PROFILE", "RAS", "ALL")

KEYS: tuple[Key, ...] = (
    # cluster
    _k("HOME", v.optional(v.abspath), "",
       "what $HOME in this file expands to; define it first when paths live under a user's home (the "
       "coordinator runs as root, whose environment has no user's HOME)"),
    _k("HEAD_IP", v.ipv4, None, "head node's address on the fabric; --dist-init-addr and its RoCE GID use it"),
    _k("HEAD_HOST", v.hostname, "spark1", "head node's name (workers are named by WORKERk_HOST)"),
    _k("AGENT_PORT", v.integer(1, 65535), "7441", "TCP port every node's dsv41-agent listens on"),
    # fabric
    _k("FABRIC_IFACE", v.ifname, None, "netdev carrying the node's fabric address (HEAD_IP / WORKERk_IP)"),
    _k("FABRIC_MTU", v.integer(576, 9216), "9000", "MTU the fabric netdevs are expected to have"),
    _k("FABRIC_SETTLE_S", v.real(0.0, 120.0), "5",
       "a change of a node's fabric while its rank runs (link state, MTU, IPv4 address, the RoCE v2 GID index; "
       "its agent reports each at once) is recorded as one fabric_changed incident once no further change came "
       "for this long (one `netplan apply` is a link flap and an address re-added), then the group restarts "
       "after a drain"),
    _k("GLOO_SOCKET_IFNAME", v.listing(v.ifname, what="interface names"), None,
       "interface(s) for Gloo's TCP bootstrap", env=True),
    _k("NCCL_SOCKET_IFNAME", v.listing(v.ifname, what="interface names"), None,
       "interface(s) for NCCL's TCP bootstrap", env=True),
    _k("IB_HCA", v.listing(v.hca, what="RDMA devices"), None,
       "RDMA devices NCCL may use (becomes NCCL_IB_HCA); on DGX Spark list both devices of the QSFP port"),
    _k("NCCL_NET", v.choice("IB", "Socket"), "IB", "NCCL data plane: IB (RoCE) or Socket", env=True),
    _k("NCCL_IB_DISABLE", v.flag, "0", "1 disables NCCL's IB/RoCE transport", env=True),
    _k("NCCL_P2P_DISABLE", v.flag, "1", "NCCL peer-to-peer transport off (one GPU per node)", env=True),
    _k("NCCL_SHM_DISABLE", v.flag, "1", "NCCL shared-memory transport off (one GPU per node)", env=True),
    _k("NCCL_DEBUG", v.choice("VERSION", "WARN", "INFO", "TRACE"), "WARN", "NCCL log level", env=True),
    _k("NCCL_BUFFSIZE", v.integer(65536, 1 << 30), "1048576",
       "NCCL Simple-protocol buffer bytes per connection (pinned host RAM = GPU memory on GB10)", env=True),
    _k("NCCL_LL128_BUFFSIZE", v.integer(-2, 1 << 30), "262144", "NCCL LL128 buffer bytes (-2: NCCL's default)",
       env=True),
    _k("NCCL_PROTO", v.nccl_set("LL", "LL128", "Simple"), "^LL128", "NCCL protocols allowed", env=True),
    _k("NCCL_MAX_NCHANNELS", v.integer(1, 64), "8", "NCCL channel cap", env=True),
    _k("NCCL_DEBUG_SUBSYS", v.nccl_set(*_NCCL_SUBSYS), "INIT,ENV", "NCCL subsystems logged", env=True),
    _k("NCCL_HOST_DIR", v.optional(v.abspath), "",
       "host directory with a NCCL build (libnccl.so*); mounted read-only into the rank and put on LD_LIBRARY_PATH"),
    # model / image
    _k("MODEL_DIR", v.abspath, None, "checkpoint directory on the head (exported to the workers)"),
    _k("COMMON_MODEL", v.abspath, None,
       "model path every rank uses (--model-path); workers mount the head's export here"),
    _k("EXPECTED_SHARDS", v.integer(1, 100000), "48", "number of model-*-of-N.safetensors shards"),
    _k("SERVED_MODEL_NAME", v.name, "deepseek-v4.1-flash", "model name the API serves"),
    _k("BASE_IMAGE", v.image_by_digest, None, "SGLang image, pinned by @sha256 digest"),
    _k("IMAGE", v.optional(v.image_ref), "",
       "image the container runtime runs (a local build on BASE_IMAGE, by its ID sha256:<64 hex>); empty runs "
       "BASE_IMAGE. Agents run images by digest only: a tag is accepted here with a warning and refused by them. "
       "Preflight refuses to launch when nodes hold different image IDs"),
    _k("PORT", v.integer(1, 65535), "8888", "rank 0's HTTP API port"),
    # the gateway in front of the groups (GROUPS with two or more)
    _k("GATEWAY_PORT", v.integer(1, 65535), "30000",
       "port of the model gateway (sglang-router) on the head with two or more GROUPS: clients use "
       "http://HEAD_IP:GATEWAY_PORT; each group's rank 0 is a worker behind it while the group serves"),
    _k("GATEWAY_METRICS_LISTEN", v.listen, "127.0.0.1:29000",
       "address the gateway serves its own Prometheus metrics on (smg_*; the gateway cannot turn them off)"),
    _k("GATEWAY_PYTHON", v.optional(v.abspath), "",
       "a Python with sglang-router 0.3.2 to run the gateway on the head; empty: the head rank's own runtime (the "
       "SGLang image ships sglang-router; with RANK_RUNTIME=host, RANK_PYTHON must have it); the head's agent.env must "
       "list it in ALLOWED_PYTHONS (tools/router-venv.sh makes one)"),
    # rank runtime
    _k("RANK_RUNTIME", v.choice("container", "host"), "container",
       "container: docker run of the image; host: a Python environment on the node with sglang"),
    _k("RANK_PYTHON", v.abspath, "/usr/bin/python3", "python of the host runtime"),
    _k("RANK_ENGINE", v.choice("sglang", "sim"), "sglang",
       "sim: the stand-in engine dsv41-sim-rank for tests and the demo (no GPU, no model)"),
    _k("RANK_DEVICE", v.choice("gpu", "cpu"), "gpu",
       "gpu: DeepSeek-V4.1-Flash on each node's GPU (dsv4 attention, MXFP4 MoE, DeepSeek's tool-call and "
       "reasoning parsers); cpu: a CPU rehearsal of the cluster with SGLang's CPU engine and a small dense model "
       "(--device cpu, torch_native attention, SGLANG_USE_CPU_ENGINE=1, no hub access): needs SPEC_ALGO=NONE, "
       "OFFLOAD_MODE=host and RANK_RUNTIME=host (docs/cpu-rehearsal.md)"),
    _k("SIM_RANK_COMMAND", v.abspath, "/usr/bin/dsv41-sim-rank", "the stand-in engine's executable"),
    _k("RANK_STOP_TIMEOUT_S", v.integer(5, 3600), "120",
       "drain budget: how long a rank may take to stop after SIGTERM before it is killed"),
    # coordinator
    _k("PKI_DIR", v.abspath, "/etc/dsv41/pki",
       "cluster CA and the coordinator's certificate (ca.crt, coordinator.crt, coordinator.key; `dsv41ctl pki init`)"),
    _k("INSECURE_NO_TLS", v.flag, "0", "1 talks to agents without TLS: for isolated test networks only"),
    _k("RANK_MEMORY_GIB", v.real(0.0, 1024.0), "100",
       "memory a rank needs; preflight refuses to launch on a node with less available"),
    _k("PREFLIGHT_TIMEOUT_S", v.integer(1, 3600), "30", "preflight step deadline"),
    _k("PREFLIGHT_TFLOPS_MIN", v.real(0.0, 100000.0), "0",
       "floor of a short bf16 matrix product's TFLOPS on each node's GPU, run in the rank's runtime in preflight; "
       "0: not run. The recipes use 60 on GB10: a GPU latched in its slow state falls below it"),
    _k("PREFLIGHT_TFLOPS_TIMEOUT_S", v.integer(10, 600), "120",
       "how long the matrix-product check may take on a node (the rank's runtime starting, CUDA's start, the products)"),
    _k("SHARE_TIMEOUT_S", v.integer(1, 3600), "180", "share step deadline (export, mounts healthy)"),
    _k("FABRIC_TIMEOUT_S", v.integer(1, 3600), "60", "fabric step deadline"),
    # the collective bandwidth gate (coordinator/bringup/collective.py)
    _k("COLLECTIVE_GATE", v.flag, "1",
       "1: before launch every node runs a short all-reduce in the rank's runtime and the bring-up fails on a "
       "pair or group below its floor (a link can be up with no errors and run at a fraction of its speed); "
       "0: skipped, with a warning at each bring-up"),
    _k("COLLECTIVE_PAIR_MIN_GBPS", v.real(0.0, 10000.0), "3.5",
       "floor of each pair of nodes' all-reduce bus bandwidth, GB/s (the recipe's fabric gate: a healthy "
       "Spark pair measures about 4.6)"),
    _k("COLLECTIVE_GROUP_MIN_GBPS", v.real(0.0, 10000.0), "2.5",
       "floor of the whole group's all-reduce bus bandwidth, GB/s (the recipe's fabric gate)"),
    _k("COLLECTIVE_BYTES", v.integer(4, 1 << 32), "67108864",
       "message size of each all-reduce, bytes: large enough that bandwidth, not latency, decides the time"),
    _k("COLLECTIVE_ITERATIONS", v.integer(1, 1000), "10", "timed all-reduces per figure (3 warm-ups before)"),
    _k("COLLECTIVE_BACKEND", v.choice("auto", "nccl", "gloo"), "auto",
       "the job's torch.distributed backend; auto: gloo for CPU ranks (RANK_DEVICE=cpu), NCCL otherwise, as "
       "the rank itself"),
    _k("COLLECTIVE_TIMEOUT_S", v.integer(10, 600), "120",
       "collective step deadline (every node's job, its rendezvous included)"),
    _k("PACK_TIMEOUT_S", v.integer(1, 86400), "14400", "pack step deadline (packing ~68 GiB per node)"),
    _k("LAUNCH_TIMEOUT_S", v.integer(1, 3600), "120", "launch step deadline (every rank unit active)"),
    _k("HEALTH_TIMEOUT_S", v.integer(1, 7200), "1800", "rank 0 /health deadline (a boot takes 12-13 minutes)"),
    _k("SMOKE_TIMEOUT_S", v.integer(1, 3600), "300", "smoke step deadline"),
    _k("ROLLOUT_CONFIRM_S", v.real(0, 86400), "300",
       "after a configuration change restarts the ranks, a rank exit within this many seconds of serving "
       "brings the configuration before it back (as a failed bring-up does); 0: only a failed bring-up does"),
    _k("RESTART_MAX_ATTEMPTS", v.integer(0, 100), "3", "restarts after a rank failure before giving up"),
    _k("RESTART_BACKOFF_S", v.real(0.0, 3600.0), "30", "delay before the first restart; doubles each attempt"),
    _k("MEMORY_RECOVERY_TIMEOUT_S", v.integer(1, 3600), "120",
       "how long a restart waits for the previous ranks' memory to come back"),
    # liveness
    _k("NODE_LEASE_S", v.real(1.0, 600.0), "6",
       "a node not heard from this long while the cluster starts or serves is lost (its agent sends a "
       "heartbeat every quarter of it; an agent restart takes about 2 s)"),
    _k("NODE_WAIT_TIMEOUT_S", v.integer(0, 86400 * 7), "0",
       "how long the phase `waiting` waits for a node that cannot be reached before failing; 0: until it "
       "answers again"),
    _k("DRAIN_TIMEOUT_S", v.real(0.0, 7200.0), "600",
       "before a restart that can wait (`dsv41ctl restart --drain`, a configuration change that restarts the "
       "ranks) rank 0 refuses new requests and lets those in flight finish for up to this long, then the rest "
       "are cut; 0: no drain. A GB10 decodes one request at about 16 tokens/s (63 ms a step), so 600 s lets "
       "an answer of about 9,500 tokens finish, long reasoning included; urgent restarts never drain"),
    _k("HANG_TIMEOUT_S", v.real(1.0, 7200.0), "60",
       "a rank that takes no forward step this long while requests are in flight (or a canary is "
       "unanswered) is hung; the longest legitimate step, a 768-token chunk at 256k context, takes about 2 s"),
    _k("HANG_FIRST_STEP_TIMEOUT_S", v.real(1.0, 7200.0), "1800",
       "the same allowance for a rank's first forward step after it starts (JIT compiles, autotuning)"),
    _k("CANARY_INTERVAL_S", v.real(1.0, 3600.0), "30",
       "an idle serving cluster gets a one-token canary this often, so a hang shows without traffic"),
    # weights
    _k("NFS_SHARE", v.flag, "1", "1: workers mount the head's export at COMMON_MODEL; 0: every node has its own copy"),
    _k("NFS_BACKEND", v.choice("kernel", "ganesha"), "kernel", "NFS server on the head: kernel nfsd or nfs-ganesha"),
    _k("NFS_EXPORT_NAME", v.name, "dsv41-native", "name of the export (nfs-ganesha pseudo path /NAME)"),
    _k("NFS_CLIENTS", v.optional(v.listing(v.ipv4_or_network, what="IPv4 addresses or networks")), "",
       "clients allowed to mount the export: one export entry each"),
    _k("NFS_EXPORT_OPTIONS", v.export_options, "ro,sync,no_subtree_check,root_squash,secure,fsid=0",
       "exports(5) options of the weights' export: root on a client is squashed and clients use reserved ports; "
       "the recipe's ro,sync,no_subtree_check,no_root_squash,insecure,fsid=0 only when written here"),
    # parallelism
    _k("NNODES", v.integer(2, MAX_NODES), None, "number of nodes (head + workers), of every group"),
    _k("TP_SIZE", v.integer(1, 64), None, "tensor-parallel size of one group; a multiple of its number of nodes"),
    _k("GROUPS", v.optional(v.groups), "",
       "the TP groups, each serving the whole model behind the gateway: space-separated groups, each a "
       "comma-separated list of node names with the group's head first (spark1,spark2,spark3 "
       "spark4,spark5,spark6); every node in exactly one group, all groups of one size. The first group's head "
       "is HEAD_HOST. Empty: one group of every node, no gateway"),
    _k("EP_SIZE", v.integer(1, 64), "1", "expert-parallel size; divides TP_SIZE"),
    _k("DIST_PORT", v.integer(1, 65535), "20000", "torch.distributed rendezvous port on the head"),
    # serving
    _k("CONTEXT_LENGTH", v.integer(1, MAX_CONTEXT), None, "per-request context limit (model max 1,048,576)"),
    _k("MEM_FRACTION_STATIC", v.real(0.0, 1.0, lo_open=True, hi_open=True), None, "workers' --mem-fraction-static"),
    _k("HEAD_MEM_FRACTION_STATIC", v.optional(v.real(0.0, 1.0, lo_open=True, hi_open=True)), "",
       "head's --mem-fraction-static; empty: MEM_FRACTION_STATIC"),
    _k("MAX_RUNNING_REQUESTS", v.integer(1, 4096), "4", "--max-running-requests"),
    _k("CHUNKED_PREFILL_SIZE", v.chunk_size(KV_PAGE_TOKENS), "768", "--chunked-prefill-size (multiple of 256)"),
    _k("MAX_TOTAL_TOKENS", v.integer(1, 1 << 26), None, "KV pool size (--max-total-tokens); >= CONTEXT_LENGTH"),
    _k("SPEC_ALGO", v.choice("DSPARK", "EAGLE", "NONE"), "DSPARK", "speculative decoding (DeepSeek-V4: DSPARK or EAGLE)"),
    _k("DSPARK_BLOCK_SIZE", v.integer(1, 16), "5", "DSpark draft block (verify window = block + 1)"),
    _k("DSPARK_SPS_TABLE", v.optional(v.abspath), "",
       "SPS cost table as the rank sees it; copied from the head to every node, passed only when all match"),
    _k("DSPARK_STS_TABLE", v.optional(v.abspath), "", "STS calibration table; same rules as DSPARK_SPS_TABLE"),
    # engram
    _k("ENGRAM_DIR", v.abspath, None, "node-local NVMe directory holding the packed Engram shards (same path on every node)"),
    _k("SKIP_PREPARE", v.flag, "1", "1: bring-up never runs the pack job (an absent pack fails with the fix); "
       "0: bring-up packs what is missing"),
    _k("SKIP_VERIFY", v.flag, "1", "0: hash the checkpoint against its index before launch (cached receipts)"),
    _k("SKIP_SMOKE", v.flag, "0", "1: declare serving after /health without a completion"),
    _k("SMOKE_QUICK", v.flag, "1", "1: smoke is 19+23=42 only; 0: adds JSON schema, tool call and a full batch"),
    # kernels
    _k("EXTRA_SGLANG_ARGS", v.shell_words, "", "more SGLang flags, split like a shell would"),
    _k("SGLANG_FLASHINFER_MOE_FUSED_FINALIZE", v.flag, "0",
       "FlashInfer fused MoE finalize (atomic bf16 adds: nondeterministic greedy output)", env=True),
    _k("PYTORCH_CUDA_ALLOC_CONF", v.alloc_conf, "expandable_segments:False",
       "PyTorch allocator options; expandable_segments:True is refused (NaN logits)", env=True),
    # the adapters in the rank (dsv41/rankadapters.py)
    *_rank_keys(),
    # memory guard
    _k("MEMORY_GUARD", v.choice("act", "observe", "off"), "act",
       "memory guard: act (abort the runaway prefill, abort_all, stop the ranks), observe (journal what it "
       "would do, do nothing) or off"),
    _k("MEMORY_GUARD_GB", v.real(0.0, 1024.0), "1.5",
       "available memory (GB = 10^9 bytes) the guard keeps on every node: it acts before a node is predicted "
       "to go below this (the recipe aborted below 1.5 GB)"),
    _k("MEMORY_GUARD_INTERVAL_MS", v.integer(20, 1000), "20", "how often every agent samples memory for the guard"),
    _k("MEMORY_GUARD_LEAD_S", v.real(0.05, 60.0), "1",
       "time an abort needs to take effect (the HTTP call plus up to one prefill chunk): the guard acts when the "
       "crossing is predicted within this"),
    _k("MEMORY_GUARD_ENVELOPE_S", v.real(0.05, 60.0), "1",
       "span over which the guard takes a low (at least one prefill chunk): it projects a fall (the lows of a "
       "chunked prefill's sawtooth, and the slope of one that has lasted this long) this much further than the lead"),
    _k("MEMORY_GUARD_WINDOW_SAMPLES", v.integer(4, 1000), "10", "samples in the line whose slope the guard projects"),
    _k("MEMORY_GUARD_CONFIRM_SAMPLES", v.integer(1, 100), "2",
       "consecutive samples that must predict a crossing before the guard acts (it looks that many sampling "
       "intervals further ahead, so neither the confirmation nor the wait for the next sample makes it late)"),
    _k("MEMORY_GUARD_HYSTERESIS_GB", v.real(0.0, 1024.0), "0.25",
       "re-arm only once every node is this far above the guard again; escalate only after memory fell this much "
       "more since the last action"),
    _k("MEMORY_GUARD_ADMISSION", v.flag, "0",
       "1: every rank's scheduler holds a new request's first prefill step back while that step would take its node "
       "below MEMORY_GUARD_GB by the guard's cost model (what arrives between two of the guard's looks is not in any "
       "listing): until memory comes back when other requests are in flight, else for the guard to abort it, at most "
       "5 s (not held with MEMORY_GUARD=observe); the ranks agree with one all-reduce per scheduling pass that "
       "admits a request. Needs MEMORY_GUARD act or observe; 0: off"),
    _k("MEMORY_GUARD_STOP_AFTER_S", v.real(0.05, 600.0), "1",
       "after abort_all, memory still falling this long (or running out within the lead): stop the ranks cleanly"),
    _k("MEMORY_GUARD_TOKEN_BYTES", v.optional(v.integer(0, 1 << 30)), "",
       "what a prompt token costs each rank while its request lives (its KV in SGLang's pool, taken the first time "
       "the pool's slots are used and reused by later KV alone), bytes: the guard charges memory to the "
       "requests by it, aborts the fewest that keep the projected lowest point above the guard and a queued prompt "
       "that cannot fit before it starts. Empty: DSV41_SIM_BYTES_PER_TOKEN (16384) with RANK_ENGINE=sim, else 12000 "
       "(the head, rebuilt from the example configuration's notes); 0 with MEMORY_GUARD_TRANSIENT_BYTES=0: no cost "
       "model, the guard acts on the trend alone"),
    _k("MEMORY_GUARD_TRANSIENT_BYTES", v.optional(v.real(0.0, 1e6)), "",
       "a prefill chunk's indexer buffers, bytes per (chunk token x prefix token): with the prefill_empty_cache hook a "
       "prompt costs its last chunk's, without it the allocator keeps every chunk's. Empty: DSV41_SIM_TRANSIENT_BYTES "
       "(4) with RANK_ENGINE=sim, else 20 (the head, from the notes)"),
    _k("MEMORY_FLOOR_GB", v.real(0.0, 1024.0), "0.8",
       "every node's last line, below the coordinator's guard: when its available memory (GB = 10^9 bytes) goes below "
       "this, from the moment the rank unit starts (model load included) and whether or not the coordinator runs, "
       "the node's agent stops its rank (SIGTERM, then SIGKILL if memory keeps falling) and reports memory_floor; "
       "0: off"),
    _k("MEMORY_FLOOR_KILL_AFTER_S", v.real(0.1, 60.0), "1",
       "after the floor's SIGTERM, SIGKILL once memory keeps falling, or at the latest after this long"),
    # GPU slow state (decided from the agents' NVML figures at every status poll: METRICS_POLL_S with metrics
    # on, else GPU_POLL_S)
    _k("GPU_SLOW_S", v.real(1.0, 86400.0), "120",
       "a GPU slow this long without a break (thermal or hardware slowdown among its throttle reasons, or busy "
       "below GPU_EXPECTED_SM_MHZ) is a gpu_slow incident with its figures and the known remedy (once per "
       "episode; no restart: one does not clear it), and dsv41_gpu_slow is 1 while it lasts"),
    _k("GPU_POLL_S", v.real(1.0, 600.0), "15",
       "how often the coordinator asks every agent for its GPU figures for the slow state when METRICS_LISTEN "
       "is empty (with metrics on, their poll every METRICS_POLL_S serves)"),
    _k("GPU_BUSY_RATIO", v.real(0.0, 1.0, lo_open=True), "0.5",
       "a GPU counts as busy for GPU_EXPECTED_SM_MHZ when its NVML utilisation is at least this (0..1)"),
    _k("GPU_EXPECTED_SM_MHZ", v.optional(v.integer(1, 10000)), "",
       "the SM clock a busy GPU runs at when well (a GB10 latched in its slow state runs lower until its AC power "
       "is removed); empty: the clock is not checked, only the throttle reasons are"),
    # metrics and alerts
    _k("METRICS_LISTEN", v.optional(v.listen), "0.0.0.0:9441",
       "address the coordinator serves Prometheus metrics on (http://ADDRESS:PORT/metrics); empty: no metrics"),
    _k("METRICS_POLL_S", v.real(0.5, 300.0), "5",
       "how often the coordinator asks every agent for its status for the node metrics (memory, PSI, mount, "
       "packs, agent up)"),
    _k("INCIDENT_HOOK", v.optional(v.abspath), "",
       "executable run once per incident (rank exit, failed step, forced unexport, ...) with DSV41_INCIDENT_KIND, "
       "_NODE, _MESSAGE, _AT (ISO 8601 UTC) and _AT_UNIX_S in its environment and the same as JSON on stdin; it "
       "must be owned by root and writable by nobody else; empty: none"),
    _k("INCIDENT_HOOK_TIMEOUT_S", v.real(0.1, 600.0), "10",
       "how long one run of INCIDENT_HOOK may take before it is killed (its process group); a failure is logged, "
       "never retried"),
    # security
    _k("API_KEY_FILE", v.optional(v.abspath), "",
       "file on the head holding SGLang's API key (one line, mode 0600, owned by root); empty: no key. The key "
       "reaches rank 0 as a 0600 file, never in argv or the journal, and the health/smoke checks send it"),
)

BY_NAME = {key.name: key for key in KEYS}

# Per-worker keys, k = 1 .. NNODES-1.
WORKER_KEYS = {
    "WORKER{k}_IP": (v.ipv4, "worker k's fabric address"),
    "WORKER{k}_HOST": (v.hostname, "worker k's name"),
    "NFS_SERVER_IP_{k}": (v.ipv4, "the head's address on worker k's link; worker k mounts the export from it"),
}

UNUSED = {
    "WORKER_USER": "the agents replace ssh: nothing logs into the workers",
    "SSH_IDENTITY": "the agents replace ssh: nothing logs into the workers",
    "NFS_VOLUME": "workers mount the export as a systemd mount unit at COMMON_MODEL, not a docker volume",
    "WORKER_DIR": "workers keep their state under /var/lib/dsv41",
    "WORKER_ENGRAM_DIR": "every node uses ENGRAM_DIR",
    "HEAD_CTN": "the rank container is always named dsv41-rank",
    "WORKER_CTN": "the rank container is always named dsv41-rank",
    "STATE_DIR": "state lives under /var/lib/dsv41 on every node",
    "LOG_DIR": "logs go to the journal (journalctl -u dsv41-rank)",
    "SERVE_LOG": "logs go to the journal (journalctl -u dsv41-rank)",
    "SHM_SIZE": "the rank shares the host's IPC namespace (--ipc host)",
    "REMOTE_TIMEOUT": "every agent call has its own deadline",
}
