"""A full disk: a real small tmpfs. The pack fails with a clear error and leaves what was there.

Needs root (mount); skipped otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_pack_checkpoint import write_checkpoint  # noqa: E402

from dsv41 import engram_format as fmt  # noqa: E402
from agent.pack.packer import PackError, PackJob, Packer  # noqa: E402
from dsv41.sdnotify import SdNotify  # noqa: E402

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
ROWS = {1: 1001, 14: 4001}


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    # Room for layer 1 of rank 0 (~90 KiB) but not for layer 14 as well (~350 KiB more).
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "dsv41-test", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_cli_refuses_up_front_and_changes_nothing(small_disk: Path, tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "model", ROWS)
    argv = [sys.executable, "-m", "agent.pack", "--model", str(model), "--out", str(small_disk),
            "--rank", "0", "--tp", "3", "--block-size", "8K"]
    subprocess.run(argv + ["--layers", "1"], cwd=REPO, check=True, capture_output=True)
    before = snapshot(small_disk)
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 1
    assert "dsv41-pack: error: disk full: packing needs" in done.stderr
    assert "nothing was changed" in done.stderr
    assert snapshot(small_disk) == before


def test_full_disk_at_reservation_leaves_no_partial(small_disk: Path, tmp_path: Path) -> None:
    # The up-front check is told there is room (as when something else fills the disk after
    # it ran); the real reservation then meets the full tmpfs.
    model = write_checkpoint(tmp_path / "model", ROWS)
    (small_disk / "other-file").write_bytes(b"x" * 1000)
    before = snapshot(small_disk)
    job = PackJob(model_dir=model, out_dir=small_disk, rank=0, tp=3, layers=(14,),
                  block_bytes=8192)
    with pytest.raises(PackError, match=r"disk full: cannot reserve .* engram-l14-r0of3.bin"):
        Packer(job, SdNotify(None), free_bytes=lambda p: 2**40, log=lambda s: None).run()
    assert snapshot(small_disk) == before


def test_full_disk_keeps_an_earlier_partial_for_resume(small_disk: Path, tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "model", ROWS)
    target = fmt.expected_header(14, ROWS[14], 0, 3)
    partial = small_disk / fmt.partial_name(14, 0, 3)
    partial.write_bytes(fmt.encode_partial(fmt.PartialHeader(target, 0)))
    before = snapshot(small_disk)
    job = PackJob(model_dir=model, out_dir=small_disk, rank=0, tp=3, layers=(14,))
    with pytest.raises(PackError, match="disk full"):
        Packer(job, SdNotify(None), free_bytes=lambda p: 2**40, log=lambda s: None).run()
    assert snapshot(small_disk) == before
