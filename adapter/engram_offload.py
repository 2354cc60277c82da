"""engram_offload: the Engram tables served from this rank's packed NVMe shards (OFFLOAD_MODE=nvme).

On GB10 host RAM is GPU memory and the two tables are ~189 GiB of FP8, so no rank may hold its
third of them. SGLang 0.5.23 (sglang.srt.layers.engram) knows device tables, host tables and peer
shards only; with this adapter, on every rank:

- EngramEmbedding.__init__ runs under the meta device: SGLang's own constructor (row split,
  attributes, loaders) without a byte of table, and the table parameters are then removed.
  DeepseekV4ForCausalLM.load_weights never sees the checkpoint's `*.engram.embed.weight/scale`
  tensors (SGLang's mmap loader then never reads them).
- EngramEmbedding.finish_load opens this rank's `engram-l{L}-r{R}of{TP}.bin` in DSV41_PACKED_DIR
  through the row store (adapter/engram: DSV41_IO_THREADS, DSV41_CACHE_GIB/_WAYS,
  DSV41_RESIDENT_SCALES), read by the native reader (adapter/engram/native.py, built at the first
  finish_load of the process with torch's cpp_extension and cached under TORCH_EXTENSIONS_DIR),
  or, when it cannot be built, by the Python path (logged once). The ranks then exchange what they found over the TP group's CPU group:
  when any rank's file is missing or its header disagrees with the rank, every rank refuses to
  start, naming the file and the fix (`dsv41ctl pack --start`); the adapter is fail_closed, since
  without it SGLang would allocate the table. The module's owned range becomes the header's (the
  recipe's and dsv41's floor split; SGLang's shard_range splits on hash columns at TP 3), which is
  exact for any partition the ranks agree on, and the exchange checks that they do.
- EngramEmbedding._owned_rows reads the owned rows (zeros elsewhere); SGLang's _lookup still does
  the TP all-reduce. See adapter/engram_torch.py for how a lookup stays CUDA-graph safe.
- With DSV41_ENGRAM_PREFETCH=1 rows are fetched ahead: EngramRowStager.from_model returns a stager
  that reads an extend batch's rows (hashed on the scheduler by SGLang's own window code) into
  pinned memory and copies them on a side stream while the previous forward runs, and
  Engram.embed_rows takes them; for other batches (decode, verify) the rows of every Engram layer
  are fetched on a side stream right after EngramHasher.forward has the ids, so the fetch for
  layer 14 hides behind layers 1-13 and the one for layer 1 behind layer 0.
  DSV41_ENGRAM_PREFETCH_CHECK=1 also runs the synchronous lookup and logs rows that differ.
- Every DSV41_STATS_SECONDS one statistics line per rank.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from adapter.engram.settings import StoreSettings
from adapter.engram.stats import RankStats
from adapter.patching import AFTER, AROUND, BEFORE, ON_IMPORT, AdapterSpec, Patch, Refused
from dsv41 import engram_format as fmt
from dsv41 import rankadapters
from dsv41.adapterlog import PREFIX, AdapterLog
from dsv41.ranksettings import SettingError

NAME = "engram_offload"
ENGRAM_MODULE = "sglang.srt.layers.engram"
STAGING_MODULE = "sglang.srt.layers.engram_staging"
MODEL_MODULE = "sglang.srt.models.deepseek_v4"
FIX = fmt.REPACK_HINT  # "re-pack with `dsv41ctl pack --start`"
# SGLang's own Engram layouts; each would allocate a table of its own.
CONFLICTS = rankadapters.ENGRAM_CONFLICTS
ENV_KEYS = rankadapters.BY_NAME[NAME].keys  # every variable build() reads, declared in dsv41
TABLE_SUFFIXES = (".engram.embed.weight", ".engram.embed.scale")
READ_FAILED = f"{NAME}: reading Engram rows failed: "
# The Python path's host functions run on the CUDA driver's thread and need the GIL: with the
# default switch interval (5 ms) a scheduler thread busy in Python holds a read back by up to that
# long (bench/engram_lookup measures the prefetch with such a thread at both intervals). The
# native reader's need no GIL and leave the interval alone.
SWITCH_INTERVAL_S = 0.0005


@dataclass(frozen=True)
class OffloadSettings:
    packed_dir: str
    prefetch: bool
    check: bool
    store: StoreSettings


def settings_from_env(env: Mapping[str, str]) -> OffloadSettings | None:
    """None unless OFFLOAD_MODE=nvme (unset or host: SGLang keeps its own table); SettingError for
    a value the adapter cannot use."""
    mode = rankadapters.OFFLOAD_MODE.read(env)
    if mode != "nvme":
        return None
    packed_dir = rankadapters.DSV41_PACKED_DIR.read(env)
    prefetch = rankadapters.DSV41_ENGRAM_PREFETCH.read(env)
    check = rankadapters.DSV41_ENGRAM_PREFETCH_CHECK.read(env)
    try:
        store = StoreSettings.from_env(env)
    except ValueError as e:
        raise SettingError(str(e)) from None
    for conflict in CONFLICTS:
        if conflict.read(env):
            key = conflict.name
            raise SettingError(f"{key}=1 makes SGLang hold the Engram tables itself, which OFFLOAD_MODE=nvme "
                               f"serves from the packed shards: unset {key}")
    return OffloadSettings(packed_dir, prefetch, check, store)


def store_settings_per_table(settings: StoreSettings, layers: int, ranks_per_host: int) -> StoreSettings:
    """DSV41_CACHE_GIB is per host: split over the Engram layers and the ranks sharing the host.
    The stores log nothing themselves: the rank's statistics line covers them (RankStats)."""
    share = settings.cache_gib / (max(1, layers) * max(1, ranks_per_host))
    return dataclasses.replace(settings, cache_gib=share, stats_seconds=0)


def drop_engram_tables(weights: Iterable[tuple[str, Any]], dropped: list[str]) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors without the Engram tables (their names go to ``dropped``); with
    SGLang's mmap loader a tensor that is never touched is never read."""
    for name, tensor in weights:
        if name.endswith(TABLE_SUFFIXES):
            dropped.append(name)
            continue
        yield name, tensor


@dataclass(frozen=True)
class Found:
    """What one rank found for one layer at finish_load (exchanged over the TP group)."""

    rank: int
    problem: str | None
    row_lo: int = 0
    row_hi: int = 0
    total_rows: int = 0


def refusal(layer: int, tp: int, found: list[Found]) -> str | None:
    """Why the ranks cannot serve ``layer`` from their packs, or None when every rank can and
    their ranges partition the table exactly."""
    # Each store error ends with the fix; the refusal names it once, at the end.
    problems = [f"rank {f.rank}: {f.problem.removesuffix('; ' + FIX)}" for f in found if f.problem]
    if not problems:
        totals = sorted({f.total_rows for f in found})
        if len(totals) != 1:
            problems = ["the ranks' shards hold tables of different sizes: "
                        + ", ".join(f"rank {f.rank} {f.total_rows} rows" for f in found)]
        else:
            problems = [_fault_text(fault, found)
                        for fault in fmt.coverage_faults([(f.row_lo, f.row_hi) for f in found], totals[0])]
    if not problems:
        return None
    return f"{NAME}: the packed Engram shards cannot serve layer {layer} at tp {tp}: {'; '.join(problems)}; {FIX}"


def _fault_text(fault: fmt.Fault, found: list[Found]) -> str:
    owners = " and ".join(f"rank {found[i].rank} [{found[i].row_lo}, {found[i].row_hi})" for i in fault.ranges)
    if fault.kind == "gap":
        return f"rows [{fault.lo}, {fault.hi}) are owned by no rank (next to {owners or 'nothing'})"
    if fault.kind == "overlap":
        return f"rows [{fault.lo}, {fault.hi}) are owned twice, by {owners}"
    return f"rows [{fault.lo}, {fault.hi}) lie past the end of the table ({owners})"


def build(env: Mapping[str, str], log: AdapterLog) -> AdapterSpec | None:
    try:
        settings = settings_from_env(env)
    except SettingError as e:
        return refusing(str(e))
    if settings is None:
        return None
    offload = EngramOffload(settings, log)
    s = settings.store
    detail = (f"tables from {settings.packed_dir}, {s.io_threads} I/O threads, cache {s.cache_gib:g} GiB per host, "
              f"resident scales {'on' if s.resident_scales else 'off'}, prefetch "
              f"{'on' if settings.prefetch else 'off'}{' (checked)' if settings.check else ''}")
    return AdapterSpec(name=NAME, detail=detail, patches=offload.patches(), state=offload, fail_closed=True)


def refusing(reason: str) -> AdapterSpec:
    """A spec that stops the process where SGLang would build the tables: OFFLOAD_MODE asked for
    the packed shards, and without the adapter SGLang would allocate the tables instead."""

    def refuse(_module: Any) -> None:
        raise Refused(f"{NAME}: {reason}")

    return AdapterSpec(name=NAME, detail=f"refuses: {reason}", fail_closed=True,
                       patches=(Patch(ENGRAM_MODULE, "", ON_IMPORT, refuse),))


class EngramOffload:
    """The hooks; one per process. State lives here and on the EngramEmbedding modules."""

    def __init__(self, settings: OffloadSettings, log: AdapterLog,
                 clock: Callable[[], float] = time.monotonic,
                 stop: Callable[[int], None] = os._exit) -> None:
        self.settings = settings
        self._log = log
        self._clock = clock
        self._stop = stop
        self._lock = threading.Lock()
        self._embeds: dict[int, Any] = {}  # Engram.layer_hash_index -> EngramEmbedding
        self._pending: dict[int, Any] = {}  # layer_hash_index -> engram_torch.Pending
        self._side: dict[Any, Any] = {}  # device -> prefetch stream
        self.dropped: list[str] = []  # checkpoint tensors the loader never saw
        self._warned_loader = False
        self.stats: RankStats | None = None
        # Lookups served by a prefetch or by staged rows, rows the prefetch check compared and found
        # different (statistics, and what the tests read).
        self.prefetched = 0
        self.staged = 0
        self.checked_rows = 0
        self.mismatched_rows = 0

    def patches(self) -> tuple[Patch, ...]:
        patches = [
            Patch(ENGRAM_MODULE, "EngramEmbedding.__init__", AROUND, self.around_embedding_init,
                  params=("self", "num_embeddings", "dim", "layer_id", "column_bounds")),
            Patch(ENGRAM_MODULE, "EngramEmbedding.finish_load", AROUND, self.around_finish_load,
                  params=("self", "label")),
            Patch(ENGRAM_MODULE, "EngramEmbedding._owned_rows", AROUND, self.around_owned_rows,
                  params=("self", "indices")),
            Patch(ENGRAM_MODULE, "Engram.__init__", AFTER, self.after_engram_init,
                  params=("self", "config", "layer_id", "layout")),
            Patch(ENGRAM_MODULE, "Engram.embed_rows", AROUND, self.around_embed_rows,
                  params=("self", "hash_ids", "forward_batch", "cp_all_tokens")),
            Patch(MODEL_MODULE, "DeepseekV4ForCausalLM.load_weights", BEFORE, self.before_load_weights,
                  params=("self", "weights")),
        ]
        if self.settings.prefetch:
            patches += [
                Patch(ENGRAM_MODULE, "EngramHasher.forward", AFTER, self.after_hash,
                      params=("self", "input_ids", "forward_batch")),
                Patch(STAGING_MODULE, "EngramRowStager.from_model", AROUND, self.around_stager,
                      params=("cls", "model", "hasher", "device")),
            ]
        return tuple(patches)

    # ----- construction and loading -----

    def around_embedding_init(self, original: Callable[..., None], module: Any, num_embeddings: int, dim: int,
                              layer_id: int, *args: Any, **kwargs: Any) -> None:
        import torch

        if dim != fmt.WEIGHT_BYTES or layer_id not in fmt.LAYERS:
            raise Refused(f"{NAME}: an Engram table for layer {layer_id} with rows of {dim} values; the packed "
                          f"shards hold layers {', '.join(map(str, fmt.LAYERS))} with rows of {fmt.WEIGHT_BYTES}")
        with torch.device("meta"):
            original(module, num_embeddings, dim, layer_id, *args, **kwargs)
        # SGLang's parameters were made on the meta device (no memory); without them nothing loads
        # into the table and nothing can read it by mistake.
        for name in ("weight", "scale"):
            if name in module._parameters:
                delattr(module, name)
        module.dsv41_layer = layer_id
        module.dsv41_rows = num_embeddings
        module.dsv41_table = None

    def before_load_weights(self, model: Any, weights: Iterable[tuple[str, Any]], *args: Any,
                            **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        self._warn_eager_loader()
        return (model, drop_engram_tables(weights, self.dropped), *args), kwargs

    def _warn_eager_loader(self) -> None:
        if self._warned_loader:
            return
        self._warned_loader = True
        try:
            from sglang.srt.runtime_context import get_model

            model = get_model()
            eager = [flag for flag in ("weight_loader_disable_mmap", "weight_loader_prefetch_checkpoints")
                     if getattr(model, flag, False)]
        except Exception:  # noqa: BLE001 - only a warning; no published context in offline use
            return
        if eager:
            names = ", ".join("--" + f.replace("_", "-") for f in eager)
            self._log.line(f"{NAME}: {names} reads every checkpoint file, the Engram tables' included "
                           f"(~189 GiB); the tables themselves are still not loaded")

    def around_finish_load(self, original: Callable[..., None], module: Any, label: str) -> None:
        import torch

        from adapter.engram.native import NativeError
        from adapter.engram.store import RowStore, StoreError
        from adapter.engram_torch import PackedTable
        from sglang.srt.runtime_context import get_parallel

        if module.dsv41_table is not None:
            return  # SGLang's own finish_load (peer shards, host tables) has nothing to do here
        parallel = get_parallel()
        rank, tp = int(parallel.tp_rank), int(parallel.tp_size)
        layer, total = module.dsv41_layer, module.dsv41_rows
        nnodes = _parallel_value(parallel, "nnodes", 1)
        settings = store_settings_per_table(self.settings.store, len(fmt.LAYERS), max(1, tp // max(1, nnodes)))
        store, found = None, None
        library = self._native_library()

        def open_store(native: Any) -> RowStore:
            return RowStore.open_rank(self.settings.packed_dir, layer=layer, rank=rank, tp=tp, total_rows=total,
                                      settings=settings, clock=self._clock, native=native)

        try:
            try:
                store = open_store(library)
            except NativeError as e:  # a reader the library cannot start (threads, memory)
                self._log.line(f"{NAME}: rank {rank}/{tp} {label}: native reader not started ({e}); "
                               "the Python path reads this layer")
                store = open_store(None)
            h = store.header
            found = Found(rank, None, h.row_lo, h.row_hi, h.total_rows)
        except (StoreError, OSError, ValueError) as e:
            found = Found(rank, str(e))
        everyone = _all_gather(parallel, tp, found)
        why = refusal(layer, tp, everyone)
        if why is not None:
            if store is not None:
                store.close()
            raise Refused(why)
        table = PackedTable(store, on_read=self._after_read, on_error=self._read_failed,
                            exit_line=f"{PREFIX}{READ_FAILED}StoreError: ")
        if torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
            table.buffers("sync", device, 1)
            if self.settings.prefetch:
                table.buffers("prefetch", device, 1)
            if table.native is None and sys.getswitchinterval() > SWITCH_INTERVAL_S:
                self._log.line(f"{NAME}: interpreter switch interval {sys.getswitchinterval() * 1000:g} ms -> "
                               f"{SWITCH_INTERVAL_S * 1000:g} ms (the row reads run on the CUDA driver's thread "
                               "and wait for the GIL)")
                sys.setswitchinterval(SWITCH_INTERVAL_S)
        module.row_start, module.rows = store.header.row_lo, store.header.rows
        module.dsv41_table = table
        with self._lock:
            if self.stats is None:
                self.stats = RankStats(f"{NAME}: rank {rank}/{tp}", self.settings.store.stats_seconds, self._clock,
                                       self._log.line, cache_enabled=settings.cache_bytes > 0)
            self.stats.add(layer, store.stats)
            self.stats.start_timer()
        skipped = f"; the loader skipped {len(self.dropped)} checkpoint tensors" if self.dropped else ""
        reader = (f"native reader, {store.native.threads} threads" if store.native is not None
                  else f"Python path, {settings.io_threads} threads")
        self._log.line(f"{NAME}: rank {rank}/{tp} {label}: rows [{store.header.row_lo}, {store.header.row_hi}) of "
                       f"{total} from {store.path} ({reader}){skipped}")

    def _native_library(self) -> Any:
        """The native reader's library, built once per process; None (logged once) without it."""
        from adapter.engram import native

        return native.load(log=lambda message: self._log.line(f"{NAME}: {message}"))

    def _table(self, module: Any) -> Any:
        table = getattr(module, "dsv41_table", None)
        if table is None:
            raise Refused(f"{NAME}: Engram layer {getattr(module, 'dsv41_layer', '?')} looked up before "
                          "finish_load opened its packed shard")
        return table

    def _after_read(self) -> None:
        stats = self.stats
        if stats is not None:
            stats.maybe_report()

    def _read_failed(self, error: BaseException) -> None:
        # On the CUDA driver's thread inside a stream: the forward would go on with unread rows.
        # (The native reader logs the same line and exits by itself: PackedTable's exit_line.)
        self._log.line(f"{READ_FAILED}{type(error).__name__}: {error}; the rank stops")
        self._stop(1)

    # ----- lookups -----

    def around_owned_rows(self, original: Callable[..., Any], module: Any, indices: Any) -> Any:
        table = self._table(module)
        pending = self._claim(module, indices)
        if pending is None:
            return table.lookup(indices)
        out = table.take(pending)
        self.prefetched += 1
        if self.settings.check:
            table.check(out, table.lookup(indices))
            self._report_check(table)
        return out

    def _claim(self, module: Any, indices: Any) -> Any:
        with self._lock:
            index = next((k for k, e in self._embeds.items() if e is module), None)
            pending = self._pending.pop(index, None) if index is not None else None
        if pending is None:
            return None
        if pending.matches(indices):
            return pending
        # Other ids than those prefetched (a gathered or copied tensor): the side stream must still be
        # joined (a CUDA graph capture needs every fork joined), and the lookup reads synchronously.
        module.dsv41_table.join(pending)
        return None

    def after_engram_init(self, _result: Any, engram: Any, *_args: Any, **_kwargs: Any) -> None:
        with self._lock:
            self._embeds[int(engram.layer_hash_index)] = engram.embed

    def after_hash(self, hash_ids: Any, _hasher: Any, _input_ids: Any, forward_batch: Any = None, *_args: Any,
                   **_kwargs: Any) -> None:
        from adapter.engram_torch import StagedRows

        if getattr(hash_ids, "ndim", 0) != 3 or hash_ids.shape[0] == 0:
            return None
        if isinstance(getattr(forward_batch, "engram_staged_rows", None), StagedRows):
            return None  # the scheduler staged this batch's rows already
        side = self._side_stream(hash_ids.device)
        pending = {}
        for index in range(hash_ids.shape[1]):
            embed = self._embeds.get(index)
            table = getattr(embed, "dsv41_table", None)
            if table is not None:
                pending[index] = table.prefetch(hash_ids[:, index], side)
        with self._lock:
            stale = [(self._embeds[k], p) for k, p in self._pending.items()]
            self._pending = pending
        for embed, p in stale:  # never looked up (an idle batch): joined so no fork is left open
            embed.dsv41_table.join(p)
        return None

    def _side_stream(self, device: Any) -> Any:
        if device.type != "cuda":
            return None
        import torch

        with self._lock:
            if device not in self._side:
                self._side[device] = torch.cuda.Stream(device)
            return self._side[device]

    def around_embed_rows(self, original: Callable[..., Any], engram: Any, hash_ids: Any, forward_batch: Any,
                          cp_all_tokens: bool = False, *args: Any, **kwargs: Any) -> Any:
        from adapter.engram_torch import StagedRows

        staged = getattr(forward_batch, "engram_staged_rows", None)
        if not isinstance(staged, StagedRows):
            return original(engram, hash_ids, forward_batch, cp_all_tokens, *args, **kwargs)
        embed = engram.embed
        table = self._table(embed)
        values = table.take_staged(staged[engram.layer_hash_index], tuple(hash_ids.shape))
        if embed.tp_size > 1:
            values = embed._reduce_owned_rows(values)
        self.staged += 1
        if self.settings.check:
            table.check(values, embed(hash_ids, forward_batch, cp_all_tokens=cp_all_tokens))
            self._report_check(table)
        return values

    def around_stager(self, original: Callable[..., Any], cls: Any, model: Any, hasher: Any, device: Any) -> Any:
        from sglang.srt.layers.engram import Engram
        from sglang.srt.runtime_context import get_parallel

        engrams = sorted((m for m in model.modules() if isinstance(m, Engram)), key=lambda m: m.layer_hash_index)
        tables = [getattr(m.embed, "dsv41_table", None) for m in engrams]
        if not engrams or any(t is None for t in tables):
            return original(cls, model, hasher, device)
        parallel = get_parallel()
        if _parallel_value(parallel, "attn_cp_size", 1) > 1 or _parallel_value(parallel, "attn_dp_size", 1) > 1:
            self._log.line(f"{NAME}: extend batches are not staged ahead with attention CP or DP; their rows are "
                           "fetched after the hasher")
            return None
        for m in engrams:
            # The breakable prefill graph then runs the lookup eagerly between its segments.
            m.embed.staged_by_scheduler = True
        return PackedStager(hasher, tables, device, cls._windows)

    def _report_check(self, table: Any) -> None:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return  # counted on the device; read at the next lookup outside a graph
        checked, mismatched = table.check_counts()
        self.checked_rows += checked
        self.mismatched_rows += mismatched
        if mismatched:
            self._log.line(f"{NAME}: prefetch check: layer {table.layer}: {mismatched} of {checked} rows differ "
                           "from the synchronous lookup")


class PackedStager:
    """SGLang's EngramRowStager for packed shards: the same host-side windows and hashing
    (EngramRowStager._windows, EngramHasher.hash_windows), rows from the shards."""

    def __init__(self, hasher: Any, tables: list[Any], device: Any, windows: Callable[[Any, Any], Any]) -> None:
        import torch

        self.hasher = hasher  # read by SGLang's _windows
        self.tables = tables
        self.device = torch.device(device)
        self._windows = windows
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def stage(self, batch: Any) -> Any:
        from adapter.engram_torch import StagedRows

        if not batch.forward_mode.is_extend_without_speculative():
            return None
        windows = self._windows(self, batch)
        if windows is None:
            return None
        ids, _ = self.hasher.hash_windows(*windows)
        return StagedRows(table.stage(ids[:, k], self.device, self.copy_stream) for k, table in enumerate(self.tables))


def _parallel_value(parallel: Any, name: str, default: int) -> int:
    try:
        value = getattr(parallel, name)
    except Exception:  # noqa: BLE001 - an unpublished leaf: the default layout
        return default
    return default if value is None else int(value)


def _all_gather(parallel: Any, tp: int, found: Found) -> list[Found]:
    """Every rank's Found, in rank order (the TP group's CPU group; nothing to ask at tp 1)."""
    if tp == 1:
        return [found]
    import torch.distributed as dist

    out: list[Any] = [None] * tp
    dist.all_gather_object(out, dataclasses.asdict(found), group=parallel.tp_group.cpu_group)
    return sorted((Found(**f) for f in out), key=lambda f: f.rank)
