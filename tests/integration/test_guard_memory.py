"""The memory guard end to end with real memory: the coordinator brings three nodes up with the
stand-in engine, the head node's memory cgroup is limited (so `available` is the cgroup's
headroom), and prompts large enough to exhaust it are sent. The stand-in's memory is the real
engine's (sim/allocator.py): what an aborted request held stays with the process until a long
prompt's next chunk empties the allocator's cache. The guard must abort a runaway before the
node runs out, 20 times in a row, with nothing OOM-killed and the normal request completing each
time; of several prompts that each fit but not together, it must abort the fewest, never all,
and let at least one complete. A control run in observe-only mode shows the same runaway does
kill the rank when nothing acts. The node's own floor stops a rank whose model load would
exhaust the node while no coordinator runs."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from dsv41.v1 import control_pb2 as cpb
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
    "MEMORY_GUARD_HYSTERESIS_GB": "0.05", "MEMORY_FLOOR_GB": "0.07",
}
# The stand-in's indexer buffers are its default, 4 bytes per (chunk token, prefix token), and the
# guard's cost model is the stand-in's own knobs (MEMORY_GUARD_*_BYTES empty, RANK_ENGINE=sim).
TRANSIENT_BYTES = 4


class HeadMemory:
    """The head node's memory cgroup, from the host."""

    def __init__(self, node):
        self.dir = next(d for d in node.cgroup_dirs if "/memory/" in str(d))

    def read(self, name: str) -> int:
        return int((self.dir / name).read_text())

    def limit_to(self, headroom: int) -> None:
        (self.dir / "memory.limit_in_bytes").write_text(str(self.read("memory.usage_in_bytes") + headroom))

    def unlimit(self) -> None:
        (self.dir / "memory.limit_in_bytes").write_text("-1")

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


def engine_memory(address: str) -> dict:
    """What the stand-in's allocator holds (/v1/loads): allocated and reserved (kept) bytes."""
    with urllib.request.urlopen(f"http://{address}:8888/v1/loads", timeout=5) as reply:
        return json.loads(reply.read())["loads"][0]


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


def serving_with_the_head_limited(c: Coordinator, head) -> tuple[HeadMemory, int]:
    """Once the cluster serves: the head's cgroup limited to HEADROOM above its use, its peak reset;
    the cgroup and its failure count now."""
    assert c.wait_phase("serving", "failed").phase == "serving"
    memory = HeadMemory(head)
    memory.limit_to(HEADROOM)
    memory.reset_peak()
    return memory, memory.read("memory.failcnt")


def predicted(event: dict) -> bool:
    """The abort came before the crossing: by the requests' cost (the projected low with every
    request kept below the guard, memory still above it: on a fall, or at a look at the requests
    that arrived) or by the trend (a fall, a crossing ahead)."""
    if event["DSV41_BASIS"] in ("model", "look"):
        return int(event["DSV41_PROJECTED_LOW_KEPT_BYTES"]) < GUARD_BYTES < int(event["DSV41_AVAILABLE_BYTES"])
    return int(event["DSV41_SLOPE_BYTES_PER_S"]) < 0 and float(event["DSV41_PREDICTED_CROSSING_S"]) > 0


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
        lows, kept = [], []
        for i in range(RUNS):
            wait(lambda: not inflight(head.address), 10, "the last run's requests to end")
            # What the aborted runaway held stays with the engine (its caching allocator) until the
            # next long prompt's first chunk; it must not pile up from run to run.
            kept.append(engine_memory(head.address)["memory_reserved_bytes"])
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
            assert int(last["DSV41_AVAILABLE_BYTES"]) > GUARD_BYTES and predicted(last), last
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
        # Held, not returned by itself, and not piling up from run to run: what one run leaves is at
        # most what its runaway could take above the guard (memory never went below it); a steady
        # leak of more than about 25 MB a run would pass that within the 20 runs.
        assert max(kept) > 0 and max(kept) <= HEADROOM - GUARD_BYTES, [k // MB for k in kept]
        print(f"lowest available over {RUNS} runs: {min(lows) / MB:.0f} MB (guard {GUARD_BYTES / MB:.0f} MB), "
              f"median {sorted(lows)[RUNS // 2] / MB:.0f} MB; kept by the engine between runs up to "
              f"{max(kept) / MB:.0f} MB")
    finally:
        c.terminate()


def test_control_without_the_guard_acting_the_same_runaway_kills_the_rank(nodes, tmp_path):
    head = nodes["spark1"]
    # The node's own floor off too: nothing acts. The normal answer (33 tokens) decodes at 2 tokens/s
    # so that it is still in flight when the runaway, ~2 s after it arrives, exhausts the node: at the
    # guard runs' 10 tokens/s it could end first on a loaded machine, and this asserts it is lost.
    env = cluster_env(nodes, **{**GUARD_ENV, "MEMORY_GUARD": "observe", "RESTART_MAX_ATTEMPTS": "0",
                                "MEMORY_FLOOR_GB": "0", "DSV41_SIM_DECODE_TOKENS_PER_S": "2"})
    c = Coordinator(tmp_path, env).start()
    try:
        memory, failures = serving_with_the_head_limited(c, head)
        results: dict = {}
        a, b = run_once(head, 0, results)
        a.join(60)
        b.join(60)
        # the node reached its limit and the rank was killed by a signal (the OOM killer's SIGKILL)
        assert memory.read("memory.failcnt") > failures and memory.lowest_available() == 0
        assert "error" in results["runaway-0"] and "error" in results["normal-0"], results
        observed = events(c.log, "memory_abort_observed")
        assert observed and observed[0]["DSV41_VICTIM_RID"] == "runaway-0", observed
        assert events(c.log, "memory_abort") == []
        status = c.wait_phase("failed", timeout=30)
        assert status.last_incident.node == "spark1" and "signal" in status.last_incident.message, status
    finally:
        c.terminate()
        for node in nodes.values():
            node.run(["systemctl", "reset-failed"], check=False)


def test_a_stop_during_a_runaway_prefill_aborts_it_while_rank_0_drains_and_the_stop_completes(nodes, tmp_path):
    # An operator's stop while a runaway prefills: rank 0 drains what is in flight (SGLang finishes
    # it before it exits), and the runaway would exhaust the head during the drain. The guard goes
    # on through `stopping`: it aborts the runaway, the normal request completes, the stop ends.
    # The floor is off (only the coordinator acts), the prefill slower, and the guard without its
    # cost model (it would abort the runaway by its cost at once, before the stop): it acts on the
    # trend, once the runaway nears the guard, well after the stop is under way.
    head = nodes["spark1"]
    env = cluster_env(nodes, **{**GUARD_ENV, "MEMORY_FLOOR_GB": "0", "DSV41_SIM_PREFILL_TOKENS_PER_S": "5000",
                                "MEMORY_GUARD_TOKEN_BYTES": "0", "MEMORY_GUARD_TRANSIENT_BYTES": "0",
                                "RANK_STOP_TIMEOUT_S": "40"})
    c = Coordinator(tmp_path, env).start()
    try:
        memory, failures = serving_with_the_head_limited(c, head)
        results: dict = {}
        a, b = run_once(head, 0, results)
        wait(lambda: (r := inflight(head.address).get("runaway-0")) and r["prefilled_tokens"] > 0, 10,
             "the runaway to prefill")
        c.stub().Stop(cpb.StopRequest(), timeout=20)
        assert c.wait_phase("stopping", timeout=10).phase == "stopping"
        assert events(c.log, "memory_abort") == []  # the stop came first
        a.join(60)
        b.join(60)
        assert results["runaway-0"].get("choices", [{}])[0].get("finish_reason") == "abort", results
        assert results["normal-0"].get("choices", [{}])[0].get("finish_reason") == "stop", results
        (abort,) = events(c.log, "memory_abort")
        assert abort["DSV41_VICTIM_RID"] == "runaway-0" and predicted(abort), abort
        print(f"aborted during the stop at {int(abort['DSV41_AVAILABLE_BYTES']) / MB:.0f} MB available, "
              f"lowest {memory.lowest_available() / MB:.0f} MB")
        assert c.wait_phase("stopped", "failed", timeout=60).phase == "stopped"
        assert memory.lowest_available() >= GUARD_BYTES, memory.lowest_available()
        assert memory.oom_kills() == 0 and memory.read("memory.failcnt") == failures
        assert events(c.log, "memory_abort_all") == [] and events(c.log, "memory_stop") == []
        assert head.show("dsv41-rank.service", "Result")["Result"] == "success"  # drained and exited 0
    finally:
        c.terminate()
        for node in nodes.values():
            node.run(["systemctl", "reset-failed"], check=False)


SEVERAL = {"p10k": 10_000, "p14k": 14_000, "p18k": 18_000}  # tokens; the head holds any one of them


def several_at_once(head) -> tuple[dict, dict]:
    """SEVERAL's prompts sent together: every reply, and each one's finish reason."""
    results: dict = {}
    threads = [threading.Thread(target=chat, args=(head.address, rid, "abcd" * tokens, results))
               for rid, tokens in SEVERAL.items()]
    for t in threads:
        t.start()
        time.sleep(0.01)
    for t in threads:
        t.join(90)
    return results, {rid: r.get("choices", [{}])[0].get("finish_reason") for rid, r in results.items()}


def test_several_prompts_that_each_fit_alone_lose_the_fewest_and_one_completes(nodes, tmp_path):
    # The demo's case: prompts arriving together, each of which fits alone (its KV and its last
    # chunk's buffers), together they do not. The old guard aborted a queued prompt (it freed
    # nothing), then everything.
    head = nodes["spark1"]
    c = Coordinator(tmp_path, cluster_env(nodes, **GUARD_ENV)).start()
    try:
        assert c.wait_phase("serving", "failed").phase == "serving"
        memory = HeadMemory(head)
        memory.limit_to(HEADROOM)
        room = HEADROOM - GUARD_BYTES
        for tokens in SEVERAL.values():
            assert tokens * (BYTES_PER_TOKEN + TRANSIENT_BYTES * 768) < room  # alone, each fits
        assert sum(SEVERAL.values()) * BYTES_PER_TOKEN > room                # together, they do not
        failures = memory.read("memory.failcnt")
        units_before = rank_units(nodes)
        memory.reset_peak()
        results, reasons = several_at_once(head)
        assert set(reasons.values()) <= {"stop", "abort"}, results
        completed = [rid for rid, why in reasons.items() if why == "stop"]
        assert completed, reasons
        aborts = events(c.log, "memory_abort")
        assert {e["DSV41_VICTIM_RID"] for e in aborts} == {rid for rid, why in reasons.items() if why == "abort"}
        assert len(aborts) == 1, aborts  # 10k and 14k fit together: one abort is the fewest
        assert all(predicted(e) for e in aborts)
        assert memory.lowest_available() >= GUARD_BYTES, memory.lowest_available()
        assert events(c.log, "memory_abort_all") == [] and events(c.log, "memory_stop") == []
        assert memory.oom_kills() == 0 and memory.read("memory.failcnt") == failures
        assert rank_units(nodes) == units_before
        confirmed = events(c.log, "memory_abort_confirmed")
        assert [e["DSV41_VICTIM_RID"] for e in confirmed] == [e["DSV41_VICTIM_RID"] for e in aborts]
        print(f"several prompts: {reasons}; lowest available {memory.lowest_available() / MB:.0f} MB; "
              f"{aborts[0]['DSV41_VICTIM_RID']} aborted ({aborts[0]['DSV41_VICTIM_WHY']})")
    finally:
        c.terminate()


def rank_environment(node) -> dict[str, str]:
    pid = node.show("dsv41-rank.service", "MainPID")["MainPID"]
    raw = node.run(["cat", f"/proc/{pid}/environ"]).stdout
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def test_with_the_admission_gate_every_rank_gets_the_guards_level_and_the_same_prompts_stay_above_it(nodes, tmp_path):
    # MEMORY_GUARD_ADMISSION=1: the coordinator hands every rank the guard's level and cost model
    # (the stand-in's engine holds a first step back by them, as the adapter does in SGLang), and
    # the guard's projection counts what the ranks hold back. The demo's prompts again: no OOM,
    # the lowest point above the guard, no abort_all, at least one completes.
    head = nodes["spark1"]
    c = Coordinator(tmp_path, cluster_env(nodes, **GUARD_ENV, MEMORY_GUARD_ADMISSION="1")).start()
    try:
        assert c.wait_phase("serving", "failed").phase == "serving"
        for name, node in nodes.items():
            env = rank_environment(node)
            assert (env.get("DSV41_ADMISSION_GUARD_BYTES"), env.get("DSV41_ADMISSION_TOKEN_BYTES"),
                    env.get("DSV41_ADMISSION_TRANSIENT_BYTES")) == (str(GUARD_BYTES), str(BYTES_PER_TOKEN), "4.0"), name
        memory = HeadMemory(head)
        memory.limit_to(HEADROOM)
        failures = memory.read("memory.failcnt")
        memory.reset_peak()
        results, reasons = several_at_once(head)
        assert set(reasons.values()) <= {"stop", "abort"}, results
        assert [rid for rid, why in reasons.items() if why == "stop"], reasons
        aborts = events(c.log, "memory_abort")
        assert {e["DSV41_VICTIM_RID"] for e in aborts} == {rid for rid, why in reasons.items() if why == "abort"}
        assert memory.lowest_available() >= GUARD_BYTES, memory.lowest_available()
        assert events(c.log, "memory_abort_all") == [] and events(c.log, "memory_stop") == []
        assert memory.oom_kills() == 0 and memory.read("memory.failcnt") == failures
        print(f"several prompts with the gate: {reasons}; lowest available {memory.lowest_available() / MB:.0f} MB; "
              f"{len(aborts)} aborted")
    finally:
        c.terminate()


LOAD_BYTES = 1 << 30  # more than the head's headroom: the load would exhaust it
CONTAINER_ID = "5c" * 32
CONTAINER_SCOPE = f"docker-{CONTAINER_ID}.scope"


def start_container_stand_in(node) -> None:
    """What dockerd makes of the container runtime's `docker run` under systemd's cgroup driver:
    the server's processes in a scope of their own, docker-ID.scope, outside the rank unit, and the
    id in the client's --cidfile (the host runtime's unit has no RuntimeDirectory: written here)."""
    node.run(["sh", "-c", f"mkdir -p /run/dsv41-rank && echo {CONTAINER_ID} > /run/dsv41-rank/container.id && "
              f"(setsid systemd-run --quiet --scope --unit {CONTAINER_SCOPE} sleep 600 </dev/null >/dev/null 2>&1 &)"])
    wait(lambda: node.show(CONTAINER_SCOPE, "ActiveState")["ActiveState"] == "active", 10, "the container stand-in")


def stop_container_stand_in(node) -> None:
    node.run(["systemctl", "stop", CONTAINER_SCOPE], check=False)
    node.run(["rm", "-rf", "/run/dsv41-rank"], check=False)


def test_the_node_floor_stops_a_rank_whose_load_would_exhaust_the_node_while_no_coordinator_runs(nodes, tmp_path):
    head = nodes["spark1"]
    start_container_stand_in(head)
    memory = HeadMemory(head)
    memory.limit_to(HEADROOM)
    failures = memory.read("memory.failcnt")
    memory.reset_peak()
    env = cluster_env(nodes, **{**GUARD_ENV, "DSV41_SIM_LOAD_S": "4", "DSV41_SIM_LOAD_BYTES": str(LOAD_BYTES),
                                "MEMORY_FLOOR_GB": "0.1", "RESTART_MAX_ATTEMPTS": "0", "HEALTH_TIMEOUT_S": "60"})
    started = time.time()
    c = Coordinator(tmp_path, env).start()

    def floor_events():
        return [e for e in head.journal(unit="dsv41-agent.service", fields=None)
                if e.get("DSV41_EVENT") == "memory_floor" and float(e["__REALTIME_TIMESTAMP"]) / 1e6 > started]
    try:
        c.wait_phase("health", timeout=60)  # the ranks run and load
        c.kill()  # nothing on the network is left to save the node
        before = time.time()
        event = wait(lambda: next(iter(floor_events()), None), 30, "the floor's event")
        assert event["DSV41_SIGNAL"] == "SIGTERM" and int(event["DSV41_FLOOR_BYTES"]) == 100 * MB
        assert int(event["DSV41_AVAILABLE_BYTES"]) < 100 * MB
        # The container's processes got the SIGTERM too, found by the id in the cidfile, not through dockerd.
        assert f"sent also to the 1 process(es) of container {CONTAINER_ID[:12]}" in event["MESSAGE"], event
        wait(lambda: head.show(CONTAINER_SCOPE, "ActiveState")["ActiveState"] != "active", 10,
             "the container stand-in's process to end")
        wait(lambda: head.show("dsv41-rank.service", "ActiveState")["ActiveState"] in ("inactive", "failed"), 20,
             "the head's rank to stop")
        # the node never ran out: no OOM kill, the cgroup's limit never reached
        assert memory.oom_kills() == 0 and memory.read("memory.failcnt") == failures
        assert memory.lowest_available() > 0
        exits = [e for e in head.journal(unit="dsv41-agent.service", fields=None)
                 if e.get("DSV41_EVENT") == "rank_exit" and float(e["__REALTIME_TIMESTAMP"]) / 1e6 > before - 30]
        assert exits and exits[-1]["DSV41_CAUSE"] == "memory_floor", exits
        # A coordinator whose own guard is off brings the cluster up again: the floor stops the load
        # again, and the coordinator records it as an incident naming the node (and recovers as
        # from any rank exit: here RESTART_MAX_ATTEMPTS=0, so it gives up).
        c.config.write_text(env + "MEMORY_GUARD=off\n")
        c.start()
        status = c.wait_phase("failed", timeout=120)
        # the stop it did not see is an incident too, found when it started
        found = [line for line in c.log.read_text().splitlines() if "DSV41_EVENT=incident" in line
                 and "found at start: the node's memory floor stopped its rank at" in line]
        assert len(found) == 1 and found[0].startswith("<3>spark1: ") and "DSV41_NODE_NAME=spark1" in found[0], found
        assert status.last_incident.kind == "memory_floor" and status.last_incident.node == "spark1", status
        assert "stopped by the node's memory floor" in status.last_incident.message
        assert memory.oom_kills() == 0 and memory.read("memory.failcnt") == failures
    finally:
        stop_container_stand_in(head)
        if c.proc is not None and c.proc.poll() is None:
            c.terminate()
        for node in nodes.values():
            node.run(["systemctl", "stop", "dsv41-rank.service"], check=False)
            node.run(["systemctl", "reset-failed"], check=False)


def test_the_coordinators_guard_stops_a_bring_up_whose_load_would_exhaust_the_head(nodes, tmp_path):
    # During launch, health and smoke the guard runs too: nothing is in flight to abort while the
    # model loads, so it stops the ranks, above the guard and well before the node's floor.
    head = nodes["spark1"]
    memory = HeadMemory(head)
    memory.limit_to(HEADROOM)
    failures = memory.read("memory.failcnt")
    memory.reset_peak()
    env = cluster_env(nodes, **{**GUARD_ENV, "DSV41_SIM_LOAD_S": "4", "DSV41_SIM_LOAD_BYTES": str(LOAD_BYTES),
                                "MEMORY_FLOOR_GB": "0.1", "RESTART_MAX_ATTEMPTS": "0"})
    c = Coordinator(tmp_path, env).start()
    try:
        # Until the supervisor's first decision the phase is "starting" (coordinator/runtime.py), so the
        # "stopped" waited for here is the guard's, not the coordinator's initial state.
        status = c.wait_phase("stopped", "failed", "serving", timeout=120)
        assert status.phase == "stopped", status
        (stop,) = [line for line in c.log.read_text().splitlines() if "DSV41_EVENT=memory_stop " in line
                   or line.endswith("DSV41_EVENT=memory_stop]")]
        assert "nothing is in flight to abort" in stop or "cannot tell which request" in stop, stop
        assert status.last_incident.kind == "stopped" and "memory guard" in status.last_incident.message
        assert events(c.log, "memory_abort_all") == []
        assert memory.lowest_available() >= GUARD_BYTES, memory.lowest_available()
        assert memory.oom_kills() == 0 and memory.read("memory.failcnt") == failures
        floor = [e for e in head.journal(unit="dsv41-agent.service", fields=None)
                 if e.get("DSV41_EVENT") == "memory_floor" and e.get("DSV41_INVOCATION")]
        assert all(float(e["__REALTIME_TIMESTAMP"]) / 1e6 < c.config.stat().st_mtime for e in floor)
    finally:
        c.terminate()
        for node in nodes.values():
            node.run(["systemctl", "reset-failed"], check=False)
