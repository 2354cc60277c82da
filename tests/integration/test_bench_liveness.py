"""bench/liveness runs end to end (one round of two faults): each fault is found and named, the
ratio to its timeout printed, and the cluster serves again after the heal."""

import json
import re
import subprocess
import sys

import pytest

from tests.configtext import REPO

pytestmark = pytest.mark.integration


def test_liveness_bench_finds_a_killed_rank_and_a_frozen_node():
    done = subprocess.run([sys.executable, str(REPO / "bench" / "liveness"), "--rounds", "1", "--kinds", "exit,frozen",
                           "--lease", "2"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = dict(re.findall(r"^(exit|frozen) +(rank_exit|node_lost) ", done.stdout, re.M))
    assert rows == {"exit": "rank_exit", "frozen": "node_lost"}, done.stdout
    ratio = float(re.search(r"^frozen +node_lost +2\.0s +[0-9.]+s +[0-9.]+s +([0-9.]+)x", done.stdout, re.M).group(1))
    assert 0.5 <= ratio <= 2.0, done.stdout  # found within two leases, not before the lease could lapse
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["frozen"][0]["found_s"] > 0 and result["frozen"][0]["recovered_s"] > 0
