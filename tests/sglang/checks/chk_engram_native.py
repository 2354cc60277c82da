"""The native Engram reader as the rank builds and uses it: torch's cpp_extension, PackedTable.

argv: packed directory (packs of the real pack job for ranks 0..2 of TP 3), scratch directory, the
layout JSON ({"1": rows, "14": rows}).

- build: a fresh build directory builds the library once and logs it once; a second load in the
  process and a load by another process reuse it; a build directory holding cpp_extension's lock
  file of a build that died still builds; a source that does not compile and a missing compiler
  (CXX) fall back with one line each.
- PackedTable on the CPU over every rank's pack: lookups of several shapes, prefetch/take and
  stage/take_staged through the native reader are the Python path's bit for bit, and both are the
  packed rows dequantised.
- a failed native host function is raised by the next lookup on a Python thread.
- on a CUDA device (when there is one): the same lookups on the GPU, and a prefetch captured in a
  CUDA graph and replayed with new ids, for both readers.

Prints one JSON object of facts as its last stdout line.
"""

import ctypes
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit  # noqa: E402

import torch  # noqa: E402

from adapter.engram import native  # noqa: E402
from adapter.engram.settings import StoreSettings  # noqa: E402
from adapter.engram.store import RowStore  # noqa: E402
from adapter.engram_torch import PackedTable, bit_equal, dequantize  # noqa: E402
from dsv41 import engram_format as fmt  # noqa: E402

TP = 3
LAYERS = (1, 14)


def build_facts(scratch):
    facts = {}
    lines = []
    root = scratch / "ext"
    started = time.monotonic()
    lib = native.load(root, log=lines.append)
    facts["first"] = {"ok": lib is not None, "lines": list(lines), "seconds": time.monotonic() - started}
    again = native.load(root, log=lines.append)
    facts["second_same_object"] = again is lib
    facts["lines_after_second"] = len(lines)
    so = Path(lib.path)
    facts["library_under_root"] = so.parent.parent == root and so.parent.name.startswith("dsv41_engram_reader-")
    mtime = so.stat().st_mtime_ns
    code = ("import sys; sys.path.insert(0, sys.argv[2]); from adapter.engram import native; "
            "lines = []; lib = native.load(sys.argv[1], log=lines.append); print(lib is not None); print(lines[0])")
    done = subprocess.run([sys.executable, "-c", code, str(root), str(Path(__file__).resolve().parents[3])],
                          capture_output=True, text=True, timeout=300)
    facts["other_process"] = {"rc": done.returncode, "out": done.stdout.strip().splitlines(),
                              "rebuilt": so.stat().st_mtime_ns != mtime, "err": done.stderr[-2000:]}

    # cpp_extension's own lock file, left by a build that was killed: without the flock in
    # native._build, the next build would wait for it for ever.
    stale_root = scratch / "stale"
    key = native.build_key(native.SOURCE.read_text(), torch.__version__)
    stale = stale_root / f"{native.NAME}-{key}"
    stale.mkdir(parents=True)
    (stale / "lock").write_text("")
    lines = []
    facts["stale_lock_built"] = native.load(stale_root, log=lines.append) is not None
    facts["stale_lock_lines"] = lines

    lines = []
    broken = native.load(scratch / "broken", source=native.SOURCE.read_text() + "\nthis is not C++;\n",
                         log=lines.append)
    facts["broken"] = {"none": broken is None, "lines": lines}
    native.load(scratch / "broken", source=native.SOURCE.read_text() + "\nthis is not C++;\n", log=lines.append)
    facts["broken_lines_after_second"] = len(lines)

    lines = []
    saved = os.environ.get("CXX")
    os.environ["CXX"] = str(scratch / "no-such-compiler")
    try:
        missing = native.load(scratch / "nocxx", log=lines.append)
    finally:
        if saved is None:
            del os.environ["CXX"]
        else:
            os.environ["CXX"] = saved
    facts["no_compiler"] = {"none": missing is None, "lines": lines}
    return lib, facts


def packed_rows(path, header, ids):
    """The packed bytes of ``ids`` straight from the file (zeros for foreign rows)."""
    data = Path(path).read_bytes()
    out = torch.zeros(len(ids), fmt.ROW_BYTES, dtype=torch.uint8)
    for k, i in enumerate(ids):
        if header.row_lo <= i < header.row_hi:
            at = fmt.HEADER_BYTES + (i - header.row_lo) * fmt.ROW_BYTES
            out[k] = torch.frombuffer(bytearray(data[at:at + fmt.ROW_BYTES]), dtype=torch.uint8)
    return out


def same(a, b):
    return bool(bit_equal(a, b).all()) and tuple(a.shape) == tuple(b.shape)


def table_facts(lib, packed_dir, rows):
    variants = {"4 threads": StoreSettings(io_threads=4, stats_seconds=0),
                "cache and scales": StoreSettings(io_threads=8, stats_seconds=0, resident_scales=True,
                                                  cache_gib=300 * fmt.ROW_BYTES / 2**30, cache_ways=2)}
    checked, failures, readers = 0, [], set()
    g = torch.Generator().manual_seed(11)
    for name, s in variants.items():
        for layer in LAYERS:
            n = rows[str(layer)]
            for rank in range(TP):
                kw = dict(layer=layer, rank=rank, tp=TP, total_rows=n, settings=s)
                tables = {"python": PackedTable(RowStore.open_rank(packed_dir, **kw)),
                          "native": PackedTable(RowStore.open_rank(packed_dir, native=lib, **kw))}
                readers |= {t.reader for t in tables.values()}
                header = tables["native"].store.header
                path = tables["native"].store.path
                shapes = [torch.randint(-2, n + 2, (576,), generator=g),
                          torch.randint(0, n, (30, 24), generator=g),
                          torch.randint(0, n, (768, 24), generator=g),
                          torch.arange(header.row_lo, header.row_hi).repeat(2)[: 24 * 10].view(10, 24),
                          torch.zeros(0, 24, dtype=torch.int64)]
                for ids in shapes:
                    want = dequantize(packed_rows(path, header, ids.reshape(-1).tolist())).view(*ids.shape, 256)
                    got = {}
                    for reader, t in tables.items():
                        got[f"{reader} lookup"] = t.lookup(ids)
                        got[f"{reader} prefetch"] = t.take(t.prefetch(ids, None))
                        flat = ids.reshape(-1, ids.shape[-1]) if ids.dim() > 1 else ids.view(-1, 1)
                        got[f"{reader} staged"] = t.take_staged(t.stage(flat, torch.device("cpu"), None),
                                                                tuple(ids.shape))
                    for what, value in got.items():
                        checked += 1
                        if not same(value, want):
                            failures.append(f"{name} layer {layer} rank {rank} {tuple(ids.shape)}: {what}")
                for t in tables.values():
                    t.close()
    return {"checked": checked, "failures": failures, "readers": sorted(readers)}


def failure_facts(lib, packed_dir, scratch, rows):
    """A host function that fails (the file cut under it) is raised at the next lookup."""
    cut = scratch / "cut"
    cut.mkdir()
    name = fmt.file_name(1, 0, TP)
    shutil.copy(Path(packed_dir) / name, cut / name)
    table = PackedTable(RowStore.open_rank(cut, layer=1, rank=0, tp=TP, total_rows=rows["1"],
                                           settings=StoreSettings(io_threads=4, stats_seconds=0), native=lib))
    ids = torch.tensor([3, 4, 5], dtype=torch.int64)
    before = same(table.lookup(ids), dequantize(packed_rows(cut / name, table.store.header, [3, 4, 5])))
    os.truncate(cut / name, fmt.HEADER_BYTES)
    out = torch.empty(3, fmt.ROW_BYTES, dtype=torch.uint8)
    native_reader = table.native
    base = native_reader.launches(ids.data_ptr(), out.data_ptr(), 3)
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(native_reader.host_fn)(native_reader.launch_arg(base, 3))
    try:
        table.lookup(ids)
        raised = None
    except RuntimeError as e:
        raised = str(e)
    table.close()
    return {"before": before, "raised": raised}


def cuda_facts(lib, packed_dir, rows):
    if not torch.cuda.is_available():
        return {"available": False}
    device = torch.device("cuda", torch.cuda.current_device())
    s = StoreSettings(io_threads=16, stats_seconds=0)
    facts = {"available": True, "failures": []}
    side = torch.cuda.Stream(device)
    for layer in LAYERS:
        n = rows[str(layer)]
        kw = dict(layer=layer, rank=1, tp=TP, total_rows=n, settings=s)
        tables = {"python": PackedTable(RowStore.open_rank(packed_dir, **kw)),
                  "native": PackedTable(RowStore.open_rank(packed_dir, native=lib, **kw))}
        header, path = tables["native"].store.header, tables["native"].store.path
        ids = torch.randint(0, n, (24, 24), device=device)
        want = dequantize(packed_rows(path, header, ids.reshape(-1).tolist())).view(24, 24, 256).to(device)
        for reader, t in tables.items():
            if not same(t.lookup(ids), want):
                facts["failures"].append(f"layer {layer} {reader} lookup")
            if not same(t.take(t.prefetch(ids, side)), want):
                facts["failures"].append(f"layer {layer} {reader} prefetch")
            static = ids.clone()
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                t.take(t.prefetch(static, side))
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = t.take(t.prefetch(static, side))
            fresh = torch.randint(0, n, (24, 24), device=device)
            static.copy_(fresh)
            graph.replay()
            torch.cuda.synchronize(device)
            again = dequantize(packed_rows(path, header, fresh.reshape(-1).tolist())).view(24, 24, 256).to(device)
            if not same(out, again):
                facts["failures"].append(f"layer {layer} {reader} graph replay")
        for t in tables.values():
            t.close()
    return facts


def main():
    packed_dir, scratch, layout = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(Path(sys.argv[3]).read_text())
    rows = {k: sum(v) for k, v in layout.items()}
    lib, facts = build_facts(scratch)
    facts["tables"] = table_facts(lib, packed_dir, rows)
    facts["failure"] = failure_facts(lib, packed_dir, scratch, rows)
    facts["cuda"] = cuda_facts(lib, packed_dir, rows)
    emit(facts)


if __name__ == "__main__":
    main()
