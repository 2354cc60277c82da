"""Packed Engram shards on the node: the pack job and the pack state.

Pack state (for the agent's PackState RPC), a few milliseconds, never a full re-read::

    from agent.pack.state import pack_state, Status
    states = pack_state(out_dir, rank, tp, layers=(1, 14), model_dir=model_dir_or_None)
    # -> [LayerState(layer, status: Status (absent|packing|complete|stale|corrupt), path,
    #                detail: str, done_bytes, total_bytes), ...]

Pack job (for StartPack: a transient unit ``dsv41-pack.service`` with ``Type=notify``; refuse it
while the rank runs from these files). Exact argv::

    /usr/bin/python3 -m agent.pack --model MODEL --out PACKED_DIR --rank R --tp TP [--layers 1,14]
    # installed as: dsv41-pack --model ... (same options)
    # optional: --block-size 64M --checkpoint-size 1G --verify-rows 64 --max-mbps N

It sends READY=1 once the checkpoint headers are parsed, finished layers are skipped and the free
space is checked (a failure before that fails the unit's start), then ``STATUS=`` lines, at most
one a second, of these forms::

    STATUS=packing layers: 1, 14
    STATUS=layer 14: 41.2/63.0 GiB, 812 MB/s, ETA 27 s
    STATUS=layer 14: verifying 66 sampled rows
    STATUS=layer 14: complete, 63.0 GiB
    STATUS=complete: layer 1, layer 14
    STATUS=failed: disk full: packing needs ... (exit status 1; usage errors exit 2)

Killed at any point it can simply be started again: it resumes from the partial file
(``engram-l{L}-r{R}of{TP}.bin.partial``) and never leaves a partial file under the final name.
"""
