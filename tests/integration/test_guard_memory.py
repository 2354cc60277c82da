"""The memory guard end to end with real memory: the coordinator brings three nodes up with the
stand-in engine, the head node's memory cgroup is limited (so `available` is the cgroup's
headroom), and a runaway prompt large enough to exhaust it is sent beside a normal request.
The guard must abort the runaway before the node runs out, 20 times in a row, with nothing
OOM-killed and the normal request completing each time. A control run in observe-only mode
shows the same runaway does kill the rank when nothing acts."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.integration.simcluster import Coordinator, boot, cluster_env

pytestmark = pytest.mark.integration

MB = 1_000_000
HEADROOM = 640 << 20            # the head node's cgroup limit above what it uses when serving idle
GUARD_BYTES = 150 * MB
BYTES_PER_TOKEN = 16384         # the stand-in allocates this per prefilled token
RUNAWAY_TOKENS = 60_000         # 983 MB: more than the headroom
NORMAL_WORDS = 170              # a ~500-token prompt whose answer decodes for ~2 s
RUNS = 20
GUARD_ENV = {
    "DSV41_SIM_BYTES_PER_TOKEN": str(BYTES_PER_TOKEN), "DSV41_SIM_PREFILL_TOKENS_PER_S": "20000",
    "DSV41_SIM_DECODE_TOKENS_PER_S": "10", "CHUNKED_PREFILL_SIZE": "768",
    "MEMORY_GUARD_GB": str(GUARD_BYTES / 1e9), "MEMORY_GUARD_LEAD_S": "0.5", "MEMORY_GUARD_ENVELOPE_S": "0.25",
    "MEMORY_GUARD_HYSTERESIS_GB": "0.05",
}


class HeadMemory:
    """The head node's memory cgroup, from the host."""

    def __init__(self, node):
        self.dir = next(d for d in node.cgroup_dirs if "/memory/" in str(d))

    def read(self, name: str) -> int:
        return int((self.dir / name).read_text())

    def limit_to(self, headroom: int) -> None:
        (self.dir / "memory.limit_in_bytes").write_text(str(self.read("memory.usage_in_bytes") + headroom))

    def reset_peak(self) -> None:
        (self.dir / "memory.max_usage_in_bytes").write_text("0")

    def lowest_available(self) -> int:
        return self.read("memory.limit_in_bytes") - self.read("memory.max_usage_in_bytes")

    def oom_kills(self) -> int:
        """OOM kills in the node's cgroup tree (cgroup v1 counts a kill in the victim's own cgroup)."""
        total = 0
        for path in self.dir.rglob("memory.oom_control"):
            fields = dict(line.split() for line in path.read_text().splitlines())
            total += int(fields["oom_kill"])
        return total


@pytest.fixture(scope="module")
def nodes(rootfs):
    cluster = boot(rootfs, memory_writable=True)
    try:
        yield cluster.nodes
    finally:
        cluster.stop()


def chat(address: str, rid: str, text: str, results: dict) -> None:
    body = json.dumps({"model": "deepseek-v4.1-flash", "rid": rid, "messages": [{"role": "user", "content": text}]})
    request = urllib.request.Request(f"http://{address}:8888/v1/chat/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            results[rid] = json.loads(reply.read())
    except Exception as exc:  # recorded, asserted on by the test
        results[rid] = {"error": repr(exc)}


def inflight(address: str) -> dict:
    with urllib.request.urlopen(f"http://{address}:8888/dsv41/inflight", timeout=5) as reply:
        return {r["rid"]: r for r in json.loads(reply.read())["requests"]}


def wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def events(log: Path, kind: str) -> list[dict]:
    """The coordinator's journal events of one kind (its stderr form: `<N>message [K=V ...]`)."""
    found = []
    for line in log.read_text().splitlines():
        if f"DSV41_EVENT={kind} " in line or line.endswith(f"DSV41_EVENT={kind}]"):
            found.append(dict(re.findall(r"(DSV41_[A-Z_]+)=(\S+)", line)))
    return found


def rank_units(nodes) -> dict[str, dict]:
    return {name: node.show("dsv41-rank.service", "ActiveState", "MainPID", "Result", "NRestarts")
            for name, node in nodes.items()}


def run_once(head, i: int, results: dict) -> tuple[threading.Thread, threading.Thread]:
    normal, runaway = f"normal-{i}", f"runaway-{i}"
    a = threading.Thread(target=chat, args=(head.address, normal, "hello world " * NORMAL_WORDS, results))
    a.start()
    # the normal request is decoding (its prefill done) before the runaway arrives
    wait(lambda: (r := inflight(head.address).get(normal)) and r["prefilled_tokens"] >= r["prompt_tokens"],
         10, f"{normal} to decode")
    b = threading.Thread(target=chat, args=(head.address, runaway, "abcd" * RUNAWAY_TOKENS, results))
    b.start()
    return a, b


def test_the_guard_aborts_a_runaway_prefill_before_the_head_runs_out_20_times(nodes, tmp_path):
    head = nodes["spark1"]
    c = Coordinator(tmp_path, cluster_env(nodes, **GUARD_ENV)).start()
    try:
        assert c.wait_phase("serving", "failed").phase == "serving"
        memory = HeadMemory(head)
        memory.limit_to(HEADROOM)
        idle_usage = memory.read("memory.usage_in_bytes")
        failures = memory.read("memory.failcnt")
        units_before = rank_units(nodes)
        assert all(u["ActiveState"] == "active" for u in units_before.values())
        lows = []
        for i in range(RUNS):
            wait(lambda: memory.read("memory.usage_in_bytes") < idle_usage + 32 * MB, 10, "memory to come back")
            memory.reset_peak()
            results: dict = {}
            a, b = run_once(head, i, results)
            a.join(60)
            b.join(60)
            runaway, normal = results[f"runaway-{i}"], results[f"normal-{i}"]
            assert runaway.get("choices", [{}])[0].get("finish_reason") == "abort", (i, runaway)
            assert runaway["usage"]["prompt_tokens"] == RUNAWAY_TOKENS
            assert normal.get("choices", [{}])[0].get("finish_reason") == "stop", (i, normal)
            assert normal["choices"][0]["message"]["content"]
            lows.append(memory.lowest_available())
            assert lows[-1] >= GUARD_BYTES, f"run {i}: lowest available {lows[-1] / MB:.0f} MB, guard 150 MB"
            aborts = events(c.log, "memory_abort")
            assert len(aborts) == i + 1, f"run {i}: {len(aborts)} memory_abort events"
            last = aborts[-1]
            assert last["DSV41_VICTIM_RID"] == f"runaway-{i}"
            assert last["DSV41_VICTIM_PROMPT_TOKENS"] == str(RUNAWAY_TOKENS)
            assert int(last["DSV41_AVAILABLE_BYTES"]) > GUARD_BYTES
            assert int(last["DSV41_SLOPE_BYTES_PER_S"]) < 0 and float(last["DSV41_PREDICTED_CROSSING_S"]) > 0
        # nothing was OOM-killed: the kernel's count, the units, the journals, the cluster
        assert memory.oom_kills() == 0
        assert memory.read("memory.failcnt") == failures  # the limit was never even reached
        assert rank_units(nodes) == units_before
        assert all(u["Result"] == "success" and u["NRestarts"] == "0" for u in units_before.values())
        oom = re.compile(r"\boom|out of memory", re.I)
        rank_log = [e["MESSAGE"] for e in head.journal(unit="dsv41-rank.service")]
        assert rank_log and not [m for m in rank_log if oom.search(m)]
        assert not [e["MESSAGE"] for e in head.journal() if oom.search(e["MESSAGE"])]
        assert events(c.log, "memory_abort_all") == [] and events(c.log, "memory_stop") == []
        assert events(c.log, "rank_exit") == [] and events(c.log, "incident") == []
        status = c.status()
        assert status.phase == "serving"
        print(f"lowest available over {RUNS} runs: {min(lows) / MB:.0f} MB (guard {GUARD_BYTES / MB:.0f} MB), "
              f"median {sorted(lows)[RUNS // 2] / MB:.0f} MB")
    finally:
        c.terminate()


def test_control_without_the_guard_acting_the_same_runaway_kills_the_rank(nodes, tmp_path):
    head = nodes["spark1"]
    env = cluster_env(nodes, **{**GUARD_ENV, "MEMORY_GUARD": "observe", "RESTART_MAX_ATTEMPTS": "0"})
    c = Coordinator(tmp_path, env).start()
    try:
        assert c.wait_phase("serving", "failed").phase == "serving"
        memory = HeadMemory(head)
        memory.limit_to(HEADROOM)
        failures = memory.read("memory.failcnt")
        results: dict = {}
        a, b = run_once(head, 0, results)
        a.join(60)
        b.join(60)
        # the node reached its limit and the rank was killed by a signal (the OOM killer's SIGKILL)
        assert memory.read("memory.failcnt") > failures and memory.lowest_available() == 0
        assert "error" in results["runaway-0"] and "error" in results["normal-0"]
        observed = events(c.log, "memory_abort_observed")
        assert observed and observed[0]["DSV41_VICTIM_RID"] == "runaway-0"
        assert events(c.log, "memory_abort") == []
        status = c.wait_phase("failed", timeout=30)
        assert status.last_incident.node == "spark1" and "signal" in status.last_incident.message, status
    finally:
        c.terminate()
        for node in nodes.values():
            node.run(["systemctl", "reset-failed"], check=False)
