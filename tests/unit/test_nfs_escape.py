"""Mount unit names: agent.nfs.paths.unit_name_for_path against systemd's own `systemd-escape`."""

import shutil
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.nfs.paths import unit_name_for_path

pytestmark = pytest.mark.unit
SYSTEMD_ESCAPE = shutil.which("systemd-escape")
needs_systemd_escape = pytest.mark.skipif(SYSTEMD_ESCAPE is None, reason="systemd-escape (package systemd) missing")


def systemd_escape(paths):
    r = subprocess.run([SYSTEMD_ESCAPE, "--path", "--suffix=mount", "--", *paths], capture_output=True, text=True,
                       check=True)
    names = r.stdout.split()  # escaped names never contain blanks (they become \x20)
    assert len(names) == len(paths)
    return names


def test_known_names():
    assert unit_name_for_path("/var/tmp/DeepSeek-V4.1-Flash") == "var-tmp-DeepSeek\\x2dV4.1\\x2dFlash.mount"
    assert unit_name_for_path("/") == "-.mount"
    assert unit_name_for_path("/.cache/m") == "\\x2ecache-m.mount"
    assert unit_name_for_path("/srv/a.b/.c") == "srv-a.b-.c.mount"  # only a leading dot is escaped
    assert unit_name_for_path("/srv/ü x") == "srv-\\xc3\\xbc\\x20x.mount"


@needs_systemd_escape
def test_recipe_paths_match_systemd_escape():
    paths = ["/var/tmp/DeepSeek-V4.1-Flash", "/home/op/NewModels/DeepSeek-V4.1-Flash", "/", "/mnt/a:b_c",
             "/srv/back\\slash", "/.dot/dir", "/x/-lead-dash"]
    assert [unit_name_for_path(p) for p in paths] == systemd_escape(paths)


component = st.text(alphabet=st.characters(blacklist_characters="/\0", blacklist_categories=("Cs",)),
                    min_size=1, max_size=12).filter(lambda c: c not in (".", ".."))
normalized_path = st.lists(component, min_size=1, max_size=5).map(lambda parts: "/" + "/".join(parts))


@needs_systemd_escape
@settings(max_examples=25, deadline=None)
@given(st.lists(normalized_path, min_size=1, max_size=40))
def test_any_normalized_path_matches_systemd_escape(paths):
    assert [unit_name_for_path(p) for p in paths] == systemd_escape(paths)
