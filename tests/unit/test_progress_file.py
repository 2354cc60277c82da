"""The forward-step counter a rank shares with its agent: written with a seqlock in one page of
/dev/shm, read whole; a file anyone could have written is reported, not trusted."""

import os

import pytest

from dsv41 import progress

pytestmark = pytest.mark.unit


def test_steps_are_counted_with_their_age_on_the_nodes_monotonic_clock(tmp_path):
    now = [1_000_000_000]
    writer = progress.ProgressWriter(2, str(tmp_path), clock_ns=lambda: now[0])
    first = progress.read(writer.path, now_ns=3_000_000_000)
    assert (first.tp_rank, first.count, first.pid, first.problem) == (2, 0, os.getpid(), "")
    assert first.last_step_age_s == pytest.approx(2.0)  # since it started: no step yet
    now[0] = 5_000_000_000
    writer.step()
    writer.step()
    got = progress.read(writer.path, now_ns=5_500_000_000)
    assert got.count == 2 and got.last_step_age_s == pytest.approx(0.5)
    assert os.stat(writer.path).st_size == progress.SIZE


def test_a_new_run_replaces_the_previous_runs_file_whole(tmp_path):
    old = progress.ProgressWriter(0, str(tmp_path))
    old.step()
    new = progress.ProgressWriter(0, str(tmp_path))
    assert progress.read(new.path).count == 0
    assert [p.tp_rank for p in progress.read_all(str(tmp_path))] == [0]
    assert not [n for n in os.listdir(tmp_path) if n != "dsv41-progress-tp0"]  # no temporary left


def test_reading_every_rank_of_a_node_and_no_file_at_all(tmp_path):
    assert progress.read(str(tmp_path / "dsv41-progress-tp0")) is None
    assert progress.read_all(str(tmp_path / "missing")) == []
    for rank in (1, 0):
        progress.ProgressWriter(rank, str(tmp_path))
    (tmp_path / "dsv41-progress-tpx").write_text("not ours")
    assert [p.tp_rank for p in progress.read_all(str(tmp_path))] == [0, 1]


def test_a_file_others_may_write_or_of_another_format_is_reported_not_trusted(tmp_path):
    writer = progress.ProgressWriter(0, str(tmp_path))
    os.chmod(writer.path, 0o666)
    got = progress.read(writer.path, allowed_uids=(os.getuid(),))
    assert got.count == 0 and "only root may write a rank's progress" in got.problem
    other = tmp_path / "dsv41-progress-tp1"
    other.write_bytes(b"\0" * progress.SIZE)
    os.chmod(other, 0o644)
    assert progress.read(str(other), allowed_uids=(os.getuid(),)).problem.endswith("not a progress file")
    assert "owned by uid" in progress.read(str(other), allowed_uids=(12345,)).problem
