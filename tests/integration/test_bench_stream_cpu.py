"""bench/stream_cpu runs end to end (short slices): the agent's WatchMemory on a real gRPC server,
every arm measured, and the guard's change-only stream sending fewer messages than every sample."""

import re
import subprocess
import sys

import pytest

from tests.configtext import REPO

pytestmark = pytest.mark.integration


def test_stream_cpu_bench_measures_every_arm():
    done = subprocess.run([sys.executable, str(REPO / "bench" / "stream_cpu"), "--rounds", "1", "--seconds", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    arms = dict(re.findall(r"^  (floor|idle server|guard's stream|every sample) +([0-9.]+) %", done.stdout, re.M))
    assert set(arms) == {"floor", "idle server", "guard's stream", "every sample"}, done.stdout
    assert all(float(v) > 0 for v in arms.values()), done.stdout  # schedstat saw each process run
    sent = dict(re.findall(r"^  (guard's stream|every sample) .* (\d+) messages per slice", done.stdout, re.M))
    assert int(sent["every sample"]) >= 10 and int(sent["guard's stream"]) < int(sent["every sample"]), done.stdout
    assert re.search(r"^target: CPU <= 0.5 % at 50 ms, as the guard streams -> (met|NOT met) \(", done.stdout, re.M)
