"""The collective gate's job (adapter/collective_bench.py) for real: torch.distributed over gloo
as 3 (and 2) local processes on 127.0.0.1, with the SGLang environment's CPU torch, as the agent
runs it in a rank's runtime."""

from __future__ import annotations

import socket
import subprocess

import pytest

from dsv41 import collective
from tests.sglang.harness import REPO, venv

pytestmark = pytest.mark.sglang


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(nodes: list[str]) -> list[collective.Result]:
    python, port = str(venv() / "bin" / "python"), free_port()
    procs = [subprocess.Popen([python, "-m", "adapter.collective_bench", "--master-addr", "127.0.0.1",
                               "--master-port", str(port), "--rank", str(rank), "--nodes", ",".join(nodes),
                               "--backend", "gloo", "--bytes", str(1 << 20), "--iters", "3", "--warmup", "1",
                               "--timeout-s", "60"], cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(len(nodes))]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        lines = out.splitlines()
        assert sum(collective.RESULT_PREFIX in line for line in lines) == 1, out  # one result line
        results.append(collective.parse_result_line(lines))
    return results


def test_three_nodes_report_every_pair_and_the_group_the_same_on_each():
    results = run_job(["a", "b", "c"])
    assert all(r == results[0] for r in results)  # each figure is the slowest node's, agreed by all
    head = results[0]
    assert head.backend == "gloo" and head.transport == ""
    assert [f.group for f in head.figures] == ["a–b", "a–c", "b–c", "all"]
    for figure in head.figures:
        assert figure.nbytes == 1 << 20 and figure.busbw_gbps > 0
        n = len(figure.nodes)
        assert figure.busbw_gbps == pytest.approx(collective.bus_bandwidth_gbps(figure.nbytes, figure.seconds, n))


def test_two_nodes_have_one_pair_which_is_the_group():
    (first, second) = run_job(["a", "b"])
    assert first == second and [f.group for f in first.figures] == ["a–b", "all"]
