"""SGLang's real Engram modules at TP 3 (three processes, gloo, CPU torch), with the engram_offload
adapter installed (armed) or without it (plain: SGLang's own table, loaded from the checkpoint).

argv: model directory (a small real-format checkpoint with config.json), packed directory (packs of
the real pack job for ranks 0..2 of TP 3), output directory, layout JSON (the hash moduli of layers
1 and 14, whose sums are the tables' row counts).

Each rank publishes real ServerArgs for TP 3, builds SGLang's parallel state, a real EngramHasher
(over a small word-level tokenizer), the real Engram layers 1 and 14 and loads them: plain through
SGLang's own weight loaders from the checkpoint, armed through the adapter (which drops the table
tensors from the checkpoint stream and opens the packs at finish_load). Then every rank runs:

- table: lookups of every row of both tables (and repeats) through EngramEmbedding.forward;
- verify: a DSpark verify batch (4 requests x 6 tokens) hashed by EngramHasher.forward, looked up
  through Engram.embed_rows (armed: the rows prefetched after the hasher), and again with a copy of
  the ids (armed: the synchronous path);
- extend: two 768-token-or-less extend batches of two requests (the second continues a prefix),
  hashed on the device path by EngramHasher.forward and, armed, staged ahead by the stager that
  EngramRowStager.from_model returns (SGLang's host-side windows and hashing);
- armed only: refusals at finish_load for a missing shard, another rank's shard under this rank's
  name, and a pack of a table of another size; a real-size EngramEmbedding constructed without
  memory.

Every result tensor is written as raw bfloat16 bytes to OUT/<rank>/<name>.bin; rank 0 prints the
JSON summary (with every rank's facts) as its last stdout line.
"""

import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit, installer, marked  # noqa: E402
from rankenv import end_rank  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

LAYERS = (1, 14)
NGRAM, HEADS, DIM = 4, 8, 256
VERIFY_REQS, VERIFY_BLOCK = 4, 6


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]"] + [w for i in range(40) for w in (f"word{i}", f"Word{i}")]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")


def build(moduli):
    from sglang.srt.layers.engram import Engram, EngramHasher, EngramLayout, build_compressed_token_map

    tok = tokenizer()
    _, compressed = build_compressed_token_map(tok)
    primes = tuple(tuple(tuple(moduli[str(layer)][s * HEADS:(s + 1) * HEADS]) for s in range(NGRAM - 1))
                   for layer in LAYERS)
    layout = EngramLayout(max_ngram_size=NGRAM, layer_ids=LAYERS,
                          num_embeddings=tuple(sum(moduli[str(layer)]) for layer in LAYERS),
                          primes=primes, n_heads=HEADS, head_dim=DIM)
    hasher = EngramHasher(layout, tok, 0, compressed)
    hasher.init_history(8, "cpu")
    config = SimpleNamespace(rms_norm_eps=1e-6, hidden_size=16, hc_mult=2)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(Engram(config, layer, layout, None, prefix=f"layers.{layer}.engram")
                                       for layer in LAYERS)
    return layout, hasher, model, len(tok)


def load_plain(model, model_dir):
    """SGLang's own loading of the table tensors: each rank copies its shard_range rows."""
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator

    by_name = {}
    for engram, layer in zip(model.layers, LAYERS):
        by_name[f"layers.{layer}.engram.embed.weight"] = engram.embed.weight
        by_name[f"layers.{layer}.engram.embed.scale"] = engram.embed.scale
    files = sorted(str(p) for p in Path(model_dir).glob("*.safetensors"))
    for name, tensor in safetensors_weights_iterator(files):
        if name in by_name:
            param = by_name[name]
            param.weight_loader(param, tensor)


def reference_tables(model_dir):
    """Every row of both tables dequantised straight from the checkpoint (the real safetensors)."""
    import safetensors

    tensors = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safetensors.safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    out = {}
    for layer in LAYERS:
        w = tensors[f"layers.{layer}.engram.embed.weight"].float().unflatten(-1, (8, 32))
        s = tensors[f"layers.{layer}.engram.embed.scale"].float().unsqueeze(-1)
        out[layer] = (w * s).flatten(-2).to(torch.bfloat16)
    return out, {name: str(t.dtype) for name, t in tensors.items() if ".engram.embed." in name}


def save(out_dir, name, tensor):
    (out_dir / f"{name}.bin").write_bytes(tensor.contiguous().view(torch.int16).numpy().tobytes())


def verify_batch(hasher, step):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    g = torch.Generator().manual_seed(100 + step)
    tokens = VERIFY_REQS * VERIFY_BLOCK
    input_ids = torch.randint(2, 82, (tokens,), generator=g)
    starts = torch.tensor([5, 40, 700, 3])
    positions = (starts.repeat_interleave(VERIFY_BLOCK) + torch.arange(VERIFY_BLOCK).repeat(VERIFY_REQS))
    fb = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, req_pool_indices=torch.arange(VERIFY_REQS),
                         positions=positions, spec_info=SimpleNamespace(draft_token_num=VERIFY_BLOCK),
                         out_cache_loc=None, extend_seq_lens_cpu=None, engram_history=None,
                         engram_staged_rows=None)
    return input_ids, fb


def extend_batches():
    """(requests, prefix, extend) of two batches: A's first 500 tokens; then A's last 268 and B's 500."""
    g = torch.Generator().manual_seed(7)
    fills = {"A": torch.randint(2, 82, (768,), generator=g).tolist(), "B": torch.randint(2, 82, (500,), generator=g).tolist()}
    slots = {"A": 5, "B": 6}
    return fills, slots, [[("A", 0, 500)], [("A", 500, 268), ("B", 0, 500)]]


def extend_forward_batch(fills, slots, parts):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    ids, positions, lens = [], [], []
    for name, prefix, extend in parts:
        ids += fills[name][prefix:prefix + extend]
        positions += list(range(prefix, prefix + extend))
        lens.append(extend)
    lens_t = torch.tensor(lens)
    fb = SimpleNamespace(forward_mode=ForwardMode.EXTEND, req_pool_indices=torch.tensor([slots[n] for n, _, _ in parts]),
                         positions=torch.tensor(positions), extend_seq_lens=lens_t,
                         extend_start_loc=torch.cumsum(lens_t, 0) - lens_t, extend_seq_lens_cpu=lens,
                         engram_history=None, out_cache_loc=None, engram_staged_rows=None)
    batch = SimpleNamespace(forward_mode=ForwardMode.EXTEND, encoder_swa_reset=None,
                            reqs=[SimpleNamespace(full_untruncated_fill_ids=fills[n][:p + e]) for n, p, e in parts],
                            prefix_lens=[p for _, p, _ in parts], extend_lens=[e for _, _, e in parts])
    return torch.tensor(ids), fb, batch


def refusals(rank, layout, packed_dir, world):
    """finish_load of fresh modules while one rank's files are wrong: every rank must refuse."""
    from sglang.srt.layers.engram import EngramEmbedding

    def attempt(layer, rows=None):
        index = LAYERS.index(layer)
        n = layout.num_embeddings[index] if rows is None else rows
        bounds = layout.column_bounds(index)
        if rows is not None:
            bounds = bounds[:-1] + (n,)
        embed = EngramEmbedding(n, DIM, layer, column_bounds=bounds)
        try:
            embed.finish_load(f"layer {layer}")
        except SystemExit as e:
            return str(e.code)
        return None

    packed = Path(packed_dir)
    out = {}
    l14 = packed / "engram-l14-r1of3.bin"
    if rank == 1:
        l14.rename(packed / "away.bin")
    dist.barrier(group=world)
    out["missing"] = attempt(14)
    dist.barrier(group=world)
    if rank == 1:
        (packed / "away.bin").rename(l14)
    l1 = packed / "engram-l1-r2of3.bin"
    if rank == 2:
        l1.rename(packed / "own.bin")
        shutil.copyfile(packed / "engram-l1-r0of3.bin", l1)
    dist.barrier(group=world)
    out["foreign"] = attempt(1)
    dist.barrier(group=world)
    if rank == 2:
        (packed / "own.bin").replace(l1)
    dist.barrier(group=world)
    out["stale"] = attempt(1, rows=layout.num_embeddings[0] + 3)
    dist.barrier(group=world)
    return out


def vm_size_kib():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1])
    return 0


def worker(rank, port, model_dir, packed_dir, out_root, moduli, armed):
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(["--model-path", model_dir, "--tp-size", "3", "--device", "cpu"])
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=rank, dp_rank=None, gpu_id=rank))
    ps.init_distributed_environment(world_size=3, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                    local_rank=rank, backend="gloo")
    ps.initialize_model_parallel()
    world = get_parallel().tp_group.cpu_group
    out_dir = Path(out_root) / str(rank)
    out_dir.mkdir(parents=True, exist_ok=True)
    facts = {"rank": rank, "tp": get_parallel().tp_size}

    from sglang.srt.layers import engram as engram_mod
    from sglang.srt.layers import engram_staging

    facts["marked"] = {name: marked(getattr(engram_mod.EngramEmbedding, name))
                       for name in ("__init__", "finish_load", "_owned_rows")}
    facts["marked_stager"] = marked(engram_staging.EngramRowStager.__dict__["from_model"].__func__)
    layout, hasher, model, vocab = build(moduli)
    embeds = [e.embed for e in model.layers]
    facts["parameters"] = [sorted(n for n, _ in e.named_parameters()) for e in embeds]
    facts["shard_before_load"] = [[e.row_start, e.rows] for e in embeds]
    spec = installer().spec("engram_offload") if installer() else None
    offload = spec.state if spec is not None else None

    # Loading: plain through SGLang's loaders; armed through the adapter's filter of the same stream.
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator

    files = sorted(str(p) for p in Path(model_dir).glob("*.safetensors"))
    if offload is None:
        load_plain(model, model_dir)
    else:
        (_model, kept, *_), _ = offload.before_load_weights(model, safetensors_weights_iterator(files))
        facts["loader_kept"] = sorted(name for name, _ in kept)
        facts["loader_dropped"] = sorted(offload.dropped)
        if rank == 0:
            before = vm_size_kib()
            big = engram_mod.EngramEmbedding(384_016_682, DIM, 14, column_bounds=(0, 384_016_682))
            facts["real_size"] = {"vm_growth_kib": vm_size_kib() - before,
                                  "parameters": [n for n, _ in big.named_parameters()], "row_start": big.row_start,
                                  "rows": big.rows}
    for engram, layer in zip(model.layers, LAYERS):
        engram.embed.finish_load(label=f"layer {layer}")
    facts["shard"] = [[e.row_start, e.rows] for e in embeds]
    if offload is not None:
        facts["readers"] = [e.dsv41_table.reader for e in embeds]

    # table: every row of each table, then a shuffled pass with repeats.
    for engram, layer in zip(model.layers, LAYERS):
        n = engram.embed.dsv41_rows if offload else layout.num_embeddings[LAYERS.index(layer)]
        ids = torch.cat([torch.arange(n), torch.randperm(n, generator=torch.Generator().manual_seed(layer))[: n // 2],
                         torch.zeros(5, dtype=torch.int64), torch.full((5,), n - 1)])
        ids = torch.cat([ids, ids[: (-len(ids)) % 24]]).view(-1, 24)
        save(out_dir, f"table_l{layer}_ids", ids)
        save(out_dir, f"table_l{layer}", engram.embed(ids))
    if offload is not None:
        time.sleep(1.2)  # DSV41_STATS_SECONDS=1: the next read ends an interval

    # verify: hashed after the draft, rows prefetched after the hasher (armed).
    for step in range(2):
        input_ids, fb = verify_batch(hasher, step)
        hash_ids = hasher(input_ids, fb)
        save(out_dir, f"verify{step}_hash", hash_ids)
        for engram in model.layers:
            layer = LAYERS[engram.layer_hash_index]
            save(out_dir, f"verify{step}_l{layer}", engram.embed_rows(hash_ids[:, engram.layer_hash_index], fb, False))
            again = hash_ids[:, engram.layer_hash_index].clone()
            save(out_dir, f"verify{step}_l{layer}_sync", engram.embed(again, fb))

    # extend: staged ahead on the scheduler (armed), looked up through Engram.embed_rows.
    stager = engram_staging.EngramRowStager.from_model(model, hasher, torch.device("cpu"))
    facts["stager"] = type(stager).__name__ if stager is not None else None
    fills, slots, batches = extend_batches()
    for b, parts in enumerate(batches):
        input_ids, fb, batch = extend_forward_batch(fills, slots, parts)
        if stager is not None:
            fb.engram_staged_rows = stager.stage(batch)
        hash_ids = hasher(input_ids, fb)
        save(out_dir, f"extend{b}_hash", hash_ids)
        for engram in model.layers:
            layer = LAYERS[engram.layer_hash_index]
            save(out_dir, f"extend{b}_l{layer}", engram.embed_rows(hash_ids[:, engram.layer_hash_index], fb, False))

    if offload is not None:
        facts["counters"] = {"prefetched": offload.prefetched, "staged": offload.staged,
                             "checked_rows": offload.checked_rows, "mismatched_rows": offload.mismatched_rows}
        facts["refusals"] = refusals(rank, layout, packed_dir, world)
        if rank == 0:
            import sglang.srt.models.deepseek_v4 as dsv4

            facts["marked_load_weights"] = marked(dsv4.DeepseekV4ForCausalLM.load_weights)
    if rank == 0:
        refs, dtypes = reference_tables(model_dir)
        facts["checkpoint_dtypes"] = dtypes
        for layer in LAYERS:
            save(out_dir, f"reference_l{layer}", refs[layer])
    gathered = [None] * 3
    dist.all_gather_object(gathered, facts, group=world)
    if rank == 0:
        emit({"ranks": gathered, "layout_rows": list(layout.num_embeddings), "vocab": vocab})
    end_rank()


def main():
    model_dir, packed_dir, out_root, layout_json = sys.argv[1:5]
    moduli = json.loads(Path(layout_json).read_text())
    armed = bool(os.environ.get("DSV41_SOURCE"))
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    mp.spawn(worker, args=(port, model_dir, packed_dir, out_root, moduli, armed), nprocs=3)


if __name__ == "__main__":
    main()
