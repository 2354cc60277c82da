import os

import pytest

from dsv41.atomicfile import replace_file

pytestmark = pytest.mark.unit


def test_the_file_is_replaced_whole_with_its_mode_and_no_temporary_left(tmp_path):
    path = tmp_path / "key"
    path.write_bytes(b"old")
    old_umask = os.umask(0o077)
    try:
        replace_file(str(path), b"new content", 0o640, owner=(os.geteuid(), os.getegid()))
    finally:
        os.umask(old_umask)
    assert path.read_bytes() == b"new content"
    assert path.stat().st_mode & 0o777 == 0o640  # the umask does not narrow it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["key"]


def test_a_failed_replace_leaves_the_target_as_it_was_and_no_temporary(tmp_path):
    target = tmp_path / "state"
    target.mkdir()
    (target / "inside").write_bytes(b"old")
    with pytest.raises(OSError):
        replace_file(str(target), b"new", 0o644)  # a directory with content cannot be replaced
    assert (target / "inside").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]
