"""GetPackState (agent.rpc_pack) over shards written by the real pack job: each layer's row range
and table size come back in the reply, for the coordinator's partition check."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from test_pack_checkpoint import ROWS, write_checkpoint

from dsv41 import engram_format as fmt
from agent.pack.packer import PackJob, Packer
from agent.pathtrust import PathTrust
from agent.rpc_pack import PackRpcs
from dsv41.sdnotify import SdNotify
from dsv41.v1 import agent_pb2 as pb
from tests.unit.test_nfs_rpc import Context, NoSystemd, Rank

pytestmark = pytest.mark.unit


def pack_rpcs(root: Path) -> PackRpcs:
    return PackRpcs(SimpleNamespace(allowed_paths=(str(root),)),  # the node's ALLOWED_PATHS
                    NoSystemd(),  # no pack unit: not running
                    events=None, rank=Rank(), path_trust=PathTrust,
                    host_root="/")  # paths as they are: this test's tree is not behind a PrivateTmp


def test_pack_state_carries_each_files_rows(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "model")
    out = tmp_path / "engram"
    Packer(PackJob(model_dir=model, out_dir=out, rank=2, tp=3, layers=(14,)), SdNotify(None),
           log=lambda _line: None).run()
    spec = pb.PackSpec(source_dir=str(model), out_dir=str(out), tp=3, ranks=[2], layers=[1, 14])
    state = pack_rpcs(tmp_path).GetPackState(spec, Context())
    assert not state.running
    by_layer = {s.layer: s for s in state.layers}
    assert by_layer[14].state == "complete" and by_layer[14].rank == 2
    lo, hi = fmt.row_range(ROWS[14], 2, 3)
    assert (by_layer[14].row_lo, by_layer[14].row_hi, by_layer[14].total_rows) == (lo, hi, ROWS[14])
    assert by_layer[1].state == "absent" and (by_layer[1].row_lo, by_layer[1].row_hi, by_layer[1].total_rows) == (0, 0, 0)
    # The wire carries them: a reply parsed back has the same fields.
    again = pb.PackState.FromString(state.SerializeToString())
    assert again.layers[1].row_hi == hi and again.layers[1].total_rows == ROWS[14]
