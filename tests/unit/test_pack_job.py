"""The pack job end to end on a small real checkpoint: round trip through the row store at every
rank of TP 3 and 4, kill-and-resume with a real SIGKILL, skipping complete layers, replacing stale
ones, sd_notify progress."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_pack_checkpoint import ROWS, packed_row, write_checkpoint

from adapter.engram.settings import StoreSettings
from adapter.engram.store import RowStore
from dsv41 import engram_format as fmt
from agent.pack.__main__ import main
from agent.pack.packer import PackError, PackJob, Packer, status_line
from agent.pack.state import Status, pack_state
from dsv41.sdnotify import SdNotify

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "model")


def pack(model: Path, out: Path, rank: int, tp: int, **kw) -> list[str]:
    lines: list[str] = []
    job = PackJob(model_dir=model, out_dir=out, rank=rank, tp=tp,
                  block_bytes=kw.pop("block_bytes", 100 * fmt.ROW_BYTES), **kw)
    Packer(job, SdNotify(None), log=lines.append).run()
    return lines


@pytest.mark.parametrize("tp", [3, 4])
def test_round_trip_every_row_every_rank(model: Path, tmp_path: Path, tp: int) -> None:
    settings = StoreSettings(io_threads=4, stats_seconds=0)
    for rank in range(tp):
        out = tmp_path / f"r{rank}"
        pack(model, out, rank, tp)
        for layer, n in ROWS.items():
            lo, hi = fmt.row_range(n, rank, tp)
            with RowStore.open_rank(out, layer=layer, rank=rank, tp=tp, total_rows=n,
                                    settings=settings) as store:
                got = store.read_rows(list(range(n)))
            for row in range(n):
                want = packed_row(layer, row) if lo <= row < hi else bytes(fmt.ROW_BYTES)
                assert got[row * 264:(row + 1) * 264] == want, (layer, rank, row)
        assert not list(out.glob("*.partial"))


def test_rows_of_all_ranks_cover_the_table_once(model: Path, tmp_path: Path) -> None:
    tp = 3
    for rank in range(tp):
        pack(model, tmp_path, rank, tp, layers=(14,))
    blob = b"".join((tmp_path / fmt.file_name(14, r, tp)).read_bytes()[fmt.HEADER_BYTES:]
                    for r in range(tp))
    assert blob == b"".join(packed_row(14, i) for i in range(ROWS[14]))


def test_complete_layer_is_skipped_not_rewritten(model: Path, tmp_path: Path) -> None:
    pack(model, tmp_path, 1, 3)
    path = tmp_path / fmt.file_name(1, 1, 3)
    before = path.stat().st_mtime_ns, path.stat().st_ino
    lines = pack(model, tmp_path, 1, 3)
    assert (path.stat().st_mtime_ns, path.stat().st_ino) == before
    assert sum("skipped" in line for line in lines) == 2


def test_stale_file_is_replaced(model: Path, tmp_path: Path) -> None:
    # A file under this rank's name whose header holds another range (e.g. copied from rank 0).
    pack(model, tmp_path / "other", 0, 3, layers=(1,))
    path = tmp_path / fmt.file_name(1, 1, 3)
    path.write_bytes((tmp_path / "other" / fmt.file_name(1, 0, 3)).read_bytes())
    assert pack_state(tmp_path, 1, 3, (1,))[0].status is Status.STALE
    pack(model, tmp_path, 1, 3, layers=(1,))
    assert pack_state(tmp_path, 1, 3, (1,), model)[0].status is Status.COMPLETE
    lo, hi = fmt.row_range(ROWS[1], 1, 3)
    assert path.read_bytes()[fmt.HEADER_BYTES:] == b"".join(packed_row(1, i) for i in range(lo, hi))


def test_partial_from_another_checkpoint_starts_over(model: Path, tmp_path: Path) -> None:
    target = fmt.expected_header(1, ROWS[1], 0, 3)
    partial = tmp_path / fmt.partial_name(1, 0, 3)
    junk = bytes([0x5A]) * (target.rows * fmt.ROW_BYTES)
    partial.write_bytes(fmt.encode_partial(fmt.PartialHeader(target, target.rows // 2)) + junk)
    lines = pack(model, tmp_path, 0, 3, layers=(1,))
    assert any("differs from the checkpoint; starting over" in line for line in lines)
    assert (tmp_path / fmt.file_name(1, 0, 3)).read_bytes()[fmt.HEADER_BYTES:] == \
        b"".join(packed_row(1, i) for i in range(target.row_lo, target.row_hi))


def test_space_check_refuses_before_touching_anything(model: Path, tmp_path: Path) -> None:
    job = PackJob(model_dir=model, out_dir=tmp_path, rank=0, tp=3)
    with pytest.raises(PackError, match=r"disk full: packing needs .* GiB are free"):
        Packer(job, SdNotify(None), free_bytes=lambda p: 1000, log=lambda s: None).run()
    assert list(tmp_path.iterdir()) == []


def test_cli_sends_ready_and_progress_over_notify_socket(model: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    addr = f"@dsv41-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + addr[1:])
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", addr)
    assert main(["--model", str(model), "--out", str(tmp_path), "--rank", "2", "--tp", "3",
                 "--block-size", "8K"]) == 0
    messages = []
    sock.setblocking(False)
    try:
        while True:
            messages.append(sock.recv(4096).decode())
    except BlockingIOError:
        pass
    sock.close()
    assert messages[0].startswith("READY=1\nSTATUS=packing layers: 1, 14")
    assert "STATUS=layer 1: 0.0/0.0 GiB, 0 MB/s, ETA unknown" in messages
    assert "STATUS=layer 14: complete, 0.0 GiB" in messages
    assert messages[-1] == "STATUS=complete: layer 1, layer 14"


def test_cli_failure_is_exit_1_with_the_reason(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tmp_path), "--out", str(tmp_path / "o"), "--rank", "0",
                 "--tp", "3"]) == 1
    assert "model.safetensors.index.json: missing" in capsys.readouterr().err


def test_cli_rejects_a_rank_outside_tp(model: Path, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--model", str(model), "--out", str(tmp_path), "--rank", "3", "--tp", "3"])
    assert e.value.code == 2


def test_status_line_shape() -> None:
    assert status_line(14, int(41.2 * 2**30), 63 * 2**30, 812e6) == \
        "layer 14: 41.2/63.0 GiB, 812 MB/s, ETA 29 s"


def test_sigkill_mid_pack_then_resume(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "model", {1: 6001, 14: 2003})
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "agent.pack", "--model", str(model), "--out", str(out),
            "--rank", "1", "--tp", "3", "--block-size", "8K", "--checkpoint-size", "16K",
            "--max-mbps", "0.4"]
    proc = subprocess.Popen(argv, cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            state = pack_state(out, 1, 3, (1,))[0] if out.exists() else None
            if state and state.status is Status.PACKING and state.done_bytes >= 64 * 1024:
                break
            assert proc.poll() is None and time.monotonic() < deadline, "pack ended too early"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / fmt.file_name(1, 1, 3)).exists()
    interrupted = pack_state(out, 1, 3, (1,), model)[0]
    assert interrupted.status is Status.PACKING
    assert 0 < interrupted.done_bytes < interrupted.total_bytes

    done = subprocess.run(argv[:-2], cwd=REPO, stderr=subprocess.PIPE, text=True, check=True)
    lo, hi = fmt.row_range(6001, 1, 3)
    resumed_at = lo + interrupted.done_bytes // fmt.ROW_BYTES
    assert f"layer 1: resuming at row {resumed_at}" in done.stderr
    assert (out / fmt.file_name(1, 1, 3)).read_bytes() == fmt.encode_header(
        fmt.expected_header(1, 6001, 1, 3)) + b"".join(packed_row(1, i) for i in range(lo, hi))
    assert [s.status for s in pack_state(out, 1, 3, model_dir=model)] == [Status.COMPLETE] * 2
    assert not list(out.glob("*.partial"))


def test_killed_after_last_checkpoint_finishes_without_copying(model: Path, tmp_path: Path) -> None:
    # All rows durable, header still partial (killed between the last fsync and the rename).
    target = fmt.expected_header(14, ROWS[14], 2, 4)
    rows = b"".join(packed_row(14, i) for i in range(target.row_lo, target.row_hi))
    partial = tmp_path / fmt.partial_name(14, 2, 4)
    partial.write_bytes(fmt.encode_partial(fmt.PartialHeader(target, target.rows)) + rows)
    lines = pack(model, tmp_path, 2, 4, layers=(14,))
    assert f"layer 14: resuming at row {target.row_hi} ({target.rows} of {target.rows} rows " \
        "already written)" in lines
    assert any("copied 0 rows" in line for line in lines)
    assert (tmp_path / fmt.file_name(14, 2, 4)).read_bytes() == fmt.encode_header(target) + rows
    assert not partial.exists()


def test_leftover_partial_beside_a_complete_file_is_removed(model: Path, tmp_path: Path) -> None:
    pack(model, tmp_path, 0, 3, layers=(1,))
    partial = tmp_path / fmt.partial_name(1, 0, 3)
    partial.write_bytes(b"old attempt")
    lines = pack(model, tmp_path, 0, 3, layers=(1,))
    assert not partial.exists() and any("removed leftover" in line for line in lines)


def test_rank_with_no_rows_gets_an_empty_shard(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "model", {1: 2, 14: 3})
    pack(model, tmp_path / "out", 0, 3)  # floor split of 2 rows over 3 ranks: rank 0 owns none
    path = tmp_path / "out" / fmt.file_name(1, 0, 3)
    assert path.read_bytes() == fmt.encode_header(fmt.expected_header(1, 2, 0, 3))
    states = pack_state(tmp_path / "out", 0, 3, model_dir=model)
    assert [s.status for s in states] == [Status.COMPLETE] * 2
