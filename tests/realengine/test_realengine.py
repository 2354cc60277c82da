"""Real SGLang 0.5.23 ranks (CPU, the tiny model) in three booted nodes with the packages, brought up
by the coordinator over mutual TLS, as docs/cpu-rehearsal.md tells an operator. The scenarios run in
file order on one cluster: each starts from what the previous one left (a bring-up costs about a
minute here, so the faults share it)."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from testbed.rehearsal import api_key, boot_rehearsal, engine_venv, profile_env, tiny_model
from testbed.sparks import build_debs, ctl, rank_pids, status, wait_serving
from tests.cluster.sparks import incidents, new_incident, unit_pid, wait_for
from tests.integration.test_guard_memory import HeadMemory

pytestmark = pytest.mark.realengine

SERVE_S = 240  # a TP3 bring-up of three CPU ranks on two cores: about 50 s, more beside a busy test
HANG_S = 20  # the profile's HANG_TIMEOUT_S
LEASE_S = 6  # NODE_LEASE_S's default


@pytest.fixture(scope="module")
def rehearsal(rootfs, tmp_path_factory):
    venv = engine_venv()
    model = tiny_model(venv, tmp_path_factory.mktemp("model"))
    debs = build_debs(tmp_path_factory.mktemp("debs"))
    # The scenarios' faults come minutes apart, within STABLE_SERVING_S: give the restarts room.
    cluster = boot_rehearsal(rootfs, debs, venv, model, RESTART_MAX_ATTEMPTS="20")
    try:
        yield cluster.nodes
    finally:
        cluster.stop()


class Client:
    """HTTP to rank 0 from the test machine, with the cluster's API key."""

    def __init__(self, head) -> None:
        self.base = f"http://{head.address}:8888"
        self.key = api_key(head)

    def post(self, path: str, body: dict, timeout: float = 120, key: bool = True) -> dict:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {self.key}"} if key else {})}
        request = urllib.request.Request(self.base + path, data=json.dumps(body).encode(), headers=headers)
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            body = reply.read()
            return json.loads(body) if body else {}

    def get(self, path: str, key: bool = True, timeout: float = 20) -> tuple[int, str]:
        headers = {"Authorization": f"Bearer {self.key}"} if key else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(self.base + path, headers=headers),
                                        timeout=timeout) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def chat(self, messages: list[dict], **extra) -> dict:
        return self.post("/v1/chat/completions", {"model": "deepseek-v4.1-flash", "messages": messages, **extra})

    def continue_answer(self, start: str, **extra) -> dict:
        """A chat whose answer continues `start`: the tiny model then follows its table from start's last byte."""
        return self.chat([{"role": "user", "content": "go on"}, {"role": "assistant", "content": start}],
                         continue_final_message=True, add_generation_prompt=False, **extra)


class Background:
    """One request in a thread, for faults injected while it is in flight."""

    def __init__(self, call) -> None:
        self.result: object = None
        self.thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self.thread.start()

    def _run(self, call) -> None:
        try:
            self.result = call()
        except Exception as exc:  # noqa: BLE001 - the outcome is what the scenario checks
            self.result = exc

    def outcome(self, timeout: float) -> object:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the request did not end"
        return self.result


def head_of(nodes):
    return nodes["spark1"]


def serving(head) -> dict:
    """The cluster serving, as each scenario starts: started again if an earlier scenario's failure
    left it stopped (that scenario has failed already; this one is not its casualty)."""
    if status(head).get("phase") in ("stopped", "failed"):
        ctl(head, "start")
    return wait_serving(head, timeout=SERVE_S)


def rank_journal(node) -> str:
    """The rank unit's output since its current start."""
    invocation = node.show("dsv41-rank.service", "InvocationID")["InvocationID"]
    return node.run(["journalctl", f"_SYSTEMD_INVOCATION_ID={invocation}", "-o", "cat", "--no-pager"],
                    check=False).stdout


def sglang_processes(node) -> list[str]:
    found = node.run(["pgrep", "-a", "-f", "sglang"], check=False).stdout.splitlines()
    return [line for line in found if "pgrep" not in line]


def pid_of(node, pattern: str) -> int:
    found = node.run(["pgrep", "-f", pattern], check=False).stdout.split()
    assert len(found) == 1, f"{node.name}: {pattern!r} matches {found}"
    return int(found[0])


def in_flight(client: Client) -> list[dict]:
    code, body = client.get("/dsv41/inflight")
    return json.loads(body)["requests"] if code == 200 else []


def forward_counts(body: dict) -> dict[str, int]:
    return {n["name"]: sum(int(p["forward_count"]) for p in n["status"].get("progress", [])) for n in body["nodes"]}


def long_answer(client: Client) -> Background:
    """A request that decodes for about 20 s (the a-z loop until the loop abort at 208 tokens)."""
    call = Background(lambda: client.post("/generate", {"text": "abc", "sampling_params": {
        "max_new_tokens": 1000, "temperature": 0}}, timeout=240))
    wait_for(lambda: in_flight(client), 30, "the request never showed in /dsv41/inflight")
    return call


def test_1_the_coordinator_brings_real_ranks_to_serving_with_every_adapter_installed(rehearsal):
    head = head_of(rehearsal)
    head.run(["systemctl", "start", "dsv41-coordinator.service"], timeout=60)
    body = wait_serving(head, timeout=SERVE_S)
    assert body["ranks_running"] == 3
    # The plan's argv, accepted by the real server on every node: each rank runs and took a step.
    for name, node in rehearsal.items():
        assert any("sglang.launch_server" in p and "--node-rank" in p for p in sglang_processes(node)), name
        lines = [line for line in rank_journal(node).splitlines() if line.startswith("dsv41-adapter: ")]
        assert not [line for line in lines if "stays out" in line or "could not patch" in line], lines
        installed = {line.split()[1] for line in lines if " installed (" in line}
        assert {"tp3_pad", "loop_abort", "forward_progress"} <= installed, (name, lines)
        if node is head:
            assert {"inflight", "max_new_tokens", "api_key", "prefill_empty_cache"} <= installed, lines
    # The collective gate ran over gloo on the bridge before launch: a figure for every pair and the group.
    gate = body["collective"]
    assert gate["ok"] and gate["backend"] == "gloo", gate
    groups = {f["group"]: f["busbw_gbps"] for f in gate["figures"]}
    assert set(groups) == {"spark1–spark2", "spark1–spark3", "spark2–spark3", "all"}, groups
    assert min(groups.values()) >= gate["pair_floor_gbps"] > 0, groups
    print(f"collective gate figures on the veth bridge (gloo): {groups}")
    measured = coordinator_events_named(head, "collective_measured")
    assert measured and "spark1–spark3" in measured[-1]["MESSAGE"], measured
    # The matrix-product check ran in every node's engine environment in preflight, one figure a node.
    checked = coordinator_events_named(head, "matmul_checked")
    assert checked and all(f"{name} " in checked[-1]["MESSAGE"] for name in rehearsal), checked
    print(checked[-1]["MESSAGE"])


def test_2_a_chat_completion_and_the_forward_step_counters_moving(rehearsal):
    head = head_of(rehearsal)
    client = Client(head)
    answer = client.chat([{"role": "user", "content": "What is 19+23?"}])
    assert answer["choices"][0]["message"]["content"] == "42"
    assert answer["choices"][0]["finish_reason"] == "stop"
    before = forward_counts(status(head))
    text = client.post("/generate", {"text": "abc", "sampling_params": {"max_new_tokens": 20, "temperature": 0}})
    assert text["text"] == "defghijklmnopqrstuvw"  # the same greedy path as the model's table, at TP 3
    after = forward_counts(status(head))
    assert all(after[name] >= before[name] + 20 for name in before), (before, after)
    human = ctl(head, "status").stdout
    assert "SERVING" in human and "3/3 ranks" in human and "last forward step" in human


def test_8_loop_abort_the_max_token_clamp_and_the_api_key_on_real_generation(rehearsal):
    client = Client(head_of(rehearsal))
    same = client.continue_answer("#")["choices"][0]
    assert same["message"]["content"] == "#" * 64 and same["finish_reason"] == "stop"
    assert same["matched_stop"].startswith("loop abort (same_token")
    # /generate has no chat clamp: the a-z cycle runs until the loop abort sees four copies of a block.
    cycle = client.post("/generate", {"text": "abc", "sampling_params": {"max_new_tokens": 1000, "temperature": 0}})
    assert cycle["meta_info"]["finish_reason"]["type"] == "stop", cycle["meta_info"]
    assert cycle["meta_info"]["completion_tokens"] == 208
    clamped = client.continue_answer("abc", max_tokens=500)
    assert clamped["usage"]["completion_tokens"] == 160 and clamped["choices"][0]["finish_reason"] == "length"
    assert client.get("/server_info", key=False)[0] == 401
    code, info = client.get("/server_info")
    assert code == 200 and client.key not in info and json.loads(info)["tp_size"] == 3


def prompt(first: str, tokens: int) -> str:
    """`tokens` bytes (one token each) ending in "." so that the answer ends at once: all prefill."""
    return (first + "x" * tokens)[:tokens - 1] + "."


def prefill_lines(journal: str) -> list[tuple[int, int]]:
    """(#new-token, #queue-req) of each prefill batch the rank 0 scheduler logged."""
    return [(int(m.group(1)), int(m.group(2))) for m in re.finditer(
        r"Prefill batch, #new-seq: \d+, #new-token: (\d+), .*?#queue-req: (\d+)", journal)]


def test_7_the_guards_inputs_on_the_real_scheduler_listing_abort_by_rid_and_the_gate(rehearsal):
    head = head_of(rehearsal)
    client = Client(head)
    serving(head)
    logged_before = len(prefill_lines(rank_journal(head)))
    sizes = {"guard-a": 3000, "guard-b": 2500, "guard-c": 2000}
    calls = {rid: Background(lambda rid=rid, n=n: client.post("/generate", {
        "rid": rid, "text": prompt(rid[-1], n), "sampling_params": {"max_new_tokens": 4, "temperature": 0}}))
        for rid, n in sizes.items()}
    seen: dict[str, set[str]] = {rid: set() for rid in sizes}
    progress: dict[str, list[tuple[str, int]]] = {rid: [] for rid in sizes}
    deadline = time.monotonic() + 120
    while any(c.thread.is_alive() for c in calls.values()) and time.monotonic() < deadline:
        for record in in_flight(client):
            if record["rid"] in sizes:
                seen[record["rid"]].add(record["state"])
                progress[record["rid"]].append((record["state"], record["prefilled_tokens"]))
                assert record["prompt_tokens"] == sizes[record["rid"]]  # one token a byte, no BOS on /generate
        time.sleep(0.05)
    for rid, call in calls.items():
        answer = call.outcome(timeout=10)
        assert isinstance(answer, dict) and answer["meta_info"]["prompt_tokens"] == sizes[rid], answer
    # every request was listed while it was prefilled chunk by chunk (256 tokens), one at a time
    assert all("prefilling" in states for states in seen.values()), seen
    assert any("waiting" in states for states in seen.values()), seen
    # A prefill only moves forward; a waiting request's figure is its prefix-cache match, which the
    # scheduler looks up again at each pass and may shrink (seen: 1 token, then 0)
    for rid, values in progress.items():
        filling = [n for state, n in values if state == "prefilling"]
        assert filling == sorted(filling) and max(n for _, n in values) <= sizes[rid], (rid, values)
    # the scheduler's own lines: the prompts' tokens prefilled (less what its prefix cache held, a
    # token or so; plus the coordinator's canaries, a few tokens each) in chunks of at most 256,
    # with the others queued meanwhile
    batches = prefill_lines(rank_journal(head))[logged_before:]
    assert sum(sizes.values()) - len(sizes) <= sum(n for n, _ in batches) <= sum(sizes.values()) + 64, batches
    assert max(n for n, _ in batches) <= 256 and any(queued for _, queued in batches), batches

    # an abort by rid ends the request being prefilled at its next chunk, with finish_reason abort
    call = Background(lambda: client.post("/generate", {"rid": "guard-abort", "text": prompt("q", 6000),
                                                       "sampling_params": {"max_new_tokens": 4}}))
    wait_for(lambda: any(r["rid"] == "guard-abort" and r["prefilled_tokens"] > 0 for r in in_flight(client)), 60,
             "the request never started its prefill")
    assert client.post("/abort_request", {"rid": "guard-abort"}) == {}  # 200, an empty body
    answer = call.outcome(timeout=60)
    assert isinstance(answer, dict) and answer["meta_info"]["finish_reason"]["type"] == "abort", answer
    wait_for(lambda: not [r for r in in_flight(client) if r["rid"] == "guard-abort"], 10, "still listed")
    # the admission gate is armed in every rank and its all-reduce ran in the real TP 3 group
    for name, node in rehearsal.items():
        assert "dsv41-adapter: admission_gate installed" in rank_journal(node), name


def available(head, name: str) -> int:
    """The node's available memory as its agent reports it (the tighter of MemAvailable and its cgroup's room)."""
    return next(int(n["status"]["memory"]["available_bytes"]) for n in status(head)["nodes"] if n["name"] == name)


def listed(client: Client, rid: str) -> dict | None:
    return next((r for r in in_flight(client) if r["rid"] == rid), None)


def test_7b_the_admission_gate_holds_a_request_on_a_workers_memory_through_the_groups_all_reduce(rehearsal):
    head, spark2 = head_of(rehearsal), rehearsal["spark2"]
    client = Client(head)
    serving(head)
    # not held: the same request with every node's memory ample prefills at once
    started = time.monotonic()
    client.post("/generate", {"rid": "gate-free", "text": prompt("g", 300), "sampling_params": {"max_new_tokens": 2}})
    free_s = time.monotonic() - started
    # spark2's node: room below MEMORY_GUARD_GB (1 GB), above MEMORY_FLOOR_GB (0.5 GB), as its agent
    # reports it; rank 0's node has gigabytes: only the group's all-reduce of the headroom can hold
    # rank 0's admission. (Set again until it holds: the ranks may still give back memory from the
    # prefills before.)
    memory = HeadMemory(spark2)
    try:
        wait_for(lambda: memory.limit_to(800_000_000) or 0.6e9 < available(head, "spark2") < 0.95e9, 30,
                 f"spark2's room never settled below the guard: {available(head, 'spark2')} B")
        call = Background(lambda: client.post("/generate", {"rid": "gate-held", "text": prompt("h", 300),
                                                            "sampling_params": {"max_new_tokens": 2}}))
        wait_for(lambda: listed(client, "gate-held"), 30, "the request never showed in /dsv41/inflight")
        waited = time.monotonic()
        held = []
        while (record := listed(client, "gate-held")) and record["state"] == "waiting":
            held.append(available(head, "spark2"))
            assert time.monotonic() - waited < 60, held[-5:]
            time.sleep(0.1)
        held_s = time.monotonic() - waited
        answer = call.outcome(timeout=60)
    finally:
        memory.unlimit()
    # A request alone is held for DSV41_ADMISSION_LONE_WAIT_S (5 s where the guard acts) for the
    # guard to abort, then goes in and ends at its "." (stop); its prefill's transient on spark2,
    # already below the guard, may read as a fall, and the guard then aborts it (both were seen)
    assert 4.0 <= held_s and held_s > 5 * free_s and max(held) < 1e9, (held_s, free_s, held[-5:])
    print(f"gate: free request {free_s:.2f} s; held {held_s:.1f} s, then {answer['meta_info']['finish_reason']}")
    assert answer["meta_info"]["finish_reason"]["type"] in ("stop", "abort"), answer
    # with the room back, a request goes in at once again
    started = time.monotonic()
    client.post("/generate", {"rid": "gate-after", "text": prompt("g", 300), "sampling_params": {"max_new_tokens": 2}})
    assert time.monotonic() - started < max(2.0, 5 * free_s)


GUARD_ACTIONS = ("memory_abort", "memory_abort_all", "memory_stop", "memory_guard_rearmed")


def guard_armed(head) -> bool:
    """Whether the coordinator's memory guard is armed: it never acted, or its last event re-armed
    it (after an action it escalates on the next fall: abort_all, then stop the ranks)."""
    events = head.journal(fields=("DSV41_EVENT",), matches=[f"DSV41_EVENT={e}" for e in GUARD_ACTIONS])
    return not events or events[-1]["DSV41_EVENT"] == "memory_guard_rearmed"


def test_7c_the_node_floor_ends_the_real_process_tree_and_the_cluster_recovers(rehearsal):
    head, spark3 = head_of(rehearsal), rehearsal["spark3"]
    before = rank_pids(serving(head))
    # A node that falls below the floor falls below the guard on the way: an armed guard aborts what
    # is in flight, one still escalating after 7b's episode (spark2 held below it) would stop the
    # ranks itself, before the floor. Let it re-arm (MEMORY_GUARD's quiet time, 10 s).
    wait_for(lambda: guard_armed(head), 60, "the memory guard did not re-arm")
    seen = len(incidents(head, "memory_floor"))
    memory = HeadMemory(spark3)
    memory.limit_to(300_000_000)  # room below MEMORY_FLOOR_GB (0.5 GB)
    try:
        incident = new_incident(head, "memory_floor", seen, timeout=30)
        assert incident["DSV41_NODE_NAME"] == "spark3", incident["MESSAGE"]
        assert "below MEMORY_FLOOR_GB" in incident["MESSAGE"], incident["MESSAGE"]
        wait_for(lambda: not sglang_processes(spark3), 30, f"SGLang still runs on spark3: {sglang_processes(spark3)}")
        floor = spark3.journal(unit="dsv41-agent.service", fields=None, matches=["DSV41_EVENT=memory_floor"])
        assert floor and "SIGTERM to every process of the rank" in floor[0]["MESSAGE"], floor
    finally:
        memory.unlimit()
    wait_serving(head, timeout=SERVE_S, changed_from=before)


def test_4a_rank_0s_scheduler_killed(rehearsal):
    _kill_and_recover(rehearsal, "spark1", "sglang::scheduler")


def test_4b_a_workers_scheduler_killed(rehearsal):
    _kill_and_recover(rehearsal, "spark2", "sglang::scheduler")


def test_4c_a_workers_main_process_killed(rehearsal):
    _kill_and_recover(rehearsal, "spark3", None)


def _kill_and_recover(nodes, name: str, pattern: str | None) -> None:
    head, node = head_of(nodes), nodes[name]
    client = Client(head)
    before = rank_pids(serving(head))
    seen = len(incidents(head, "rank_exit"))
    call = long_answer(client)
    victim = pid_of(node, pattern) if pattern else unit_pid(node, "dsv41-rank.service")
    node.run(["kill", "-9", str(victim)])
    incident = new_incident(head, "rank_exit", seen, timeout=90)
    assert incident["DSV41_NODE_NAME"] == name, incident["MESSAGE"]
    # the peers' own output said their collective lost a peer (gloo: "closed/reset by peer")
    cause, _, followers = incident["MESSAGE"].partition("; then ")
    assert "its engine:" not in cause and "by peer" in followers, incident["MESSAGE"]
    outcome = call.outcome(timeout=120)
    assert not isinstance(outcome, dict) or outcome["meta_info"]["finish_reason"]["type"] != "length", outcome
    wait_serving(head, timeout=SERVE_S, changed_from=before)
    assert client.chat([{"role": "user", "content": "19+23?"}])["choices"][0]["message"]["content"] == "42"


def test_5_a_stopped_worker_scheduler_is_hung_naming_it(rehearsal):
    head, spark3 = head_of(rehearsal), rehearsal["spark3"]
    client = Client(head)
    before = rank_pids(serving(head))
    seen = len(incidents(head, "rank_hung"))
    call = long_answer(client)
    stopped_at = time.monotonic()
    spark3.run(["kill", "-STOP", str(pid_of(spark3, "sglang::scheduler"))])
    hung = new_incident(head, "rank_hung", seen, timeout=HANG_S + 30)
    assert time.monotonic() - stopped_at <= HANG_S + 5.0
    assert hung["DSV41_NODE_NAME"] == "spark3", hung["MESSAGE"]
    call.outcome(timeout=120)
    wait_serving(head, timeout=SERVE_S, changed_from=before)


def test_6_a_powered_off_worker_is_lost_waited_for_and_serves_again_after_it_boots(rehearsal):
    head, spark3 = head_of(rehearsal), rehearsal["spark3"]
    before = rank_pids(serving(head))
    lost_seen = len(incidents(head, "node_lost"))
    spark3.power_cut()
    cut_at = time.monotonic()
    lost = new_incident(head, "node_lost", lost_seen, timeout=4 * LEASE_S)
    assert time.monotonic() - cut_at <= 2 * LEASE_S + 1.0
    assert lost["DSV41_NODE_NAME"] == "spark3", lost["MESSAGE"]
    wait_for(lambda: status(head).get("phase") == "waiting", 60, "not waiting for spark3")
    spark3.power_on()
    wait_serving(head, timeout=SERVE_S, changed_from=before)


CONFIG = "/etc/dsv41/cluster.env"


def reload_coordinator(head):
    return head.run(["systemctl", "reload", "dsv41-coordinator.service"], check=False, timeout=150)


def coordinator_events_named(head, event: str) -> list[dict]:
    return head.journal(unit="dsv41-coordinator.service", fields=None, matches=[f"DSV41_EVENT={event}"])


def rank_argv(node) -> str:
    return " ".join(sglang_processes(node))


def test_9_config_apply_on_real_ranks_refuses_an_invalid_line_applies_the_guard_live_and_restarts_for_a_flag(rehearsal):
    head, client = head_of(rehearsal), Client(head_of(rehearsal))
    pids = rank_pids(serving(head))
    good = head.run(["cat", CONFIG]).stdout
    try:
        bad = good + "TP_SIZE=3\n"
        head.write_file(CONFIG, bad, mode=0o640)
        assert reload_coordinator(head).returncode != 0
        refused = ctl(head, "config", "apply")
        assert refused.returncode == 1
        assert f"cluster.env:{len(bad.splitlines())}: TP_SIZE: defined twice" in refused.stderr, refused.stderr
        body = status(head)
        assert body["phase"] == "serving" and rank_pids(body) == pids
        # With the admission gate on, the guard's level is in the ranks' environment: it restarts them.
        head.write_file(CONFIG, good.replace("MEMORY_GUARD_GB=1\n", "MEMORY_GUARD_GB=1.2\n"), mode=0o640)
        assert "MEMORY_GUARD_GB: '1' -> '1.2' (restarts the ranks)" in ctl(head, "config", "diff").stdout
        # The guard's lead time is the coordinator's alone: live, the ranks untouched, and they answer.
        guarded = good + "MEMORY_GUARD_LEAD_S=2\n"
        head.write_file(CONFIG, guarded, mode=0o640)
        assert "MEMORY_GUARD_LEAD_S: '1' -> '2' (applies at once)" in ctl(head, "config", "diff").stdout
        assert reload_coordinator(head).returncode == 0
        assert rank_pids(wait_serving(head, timeout=30)) == pids
        assert coordinator_events_named(head, "memory_guard_started")[-1]["DSV41_LEAD_S"] == "2.0"
        assert client.chat([{"role": "user", "content": "hi"}], max_tokens=4)["choices"]
        # A rank flag: one restart of the group, which then runs with it.
        restarts = len(coordinator_events_named(head, "config_restart"))
        head.write_file(CONFIG, with_flags(guarded, "--watchdog-timeout 301"), mode=0o640)
        assert "EXTRA_SGLANG_ARGS" in ctl(head, "config", "diff").stdout
        assert reload_coordinator(head).returncode == 0
        new = rank_pids(wait_serving(head, timeout=SERVE_S, changed_from=pids))
        assert all(new[n] != pids[n] for n in pids), (pids, new)
        assert len(coordinator_events_named(head, "config_restart")) == restarts + 1
        assert "--watchdog-timeout 301" in rank_argv(rehearsal["spark2"])
        assert client.chat([{"role": "user", "content": "hi"}], max_tokens=4)["choices"]
    finally:
        restore(head, good)


def with_flags(text: str, flags: str) -> str:
    line = next(x for x in text.splitlines() if x.startswith("EXTRA_SGLANG_ARGS="))
    return text.replace(line + "\n", f'EXTRA_SGLANG_ARGS="{flags}"\n')


def restore(head, text: str) -> None:
    """The profile as the scenario found it, applied (the next scenarios start from it)."""
    head.write_file(CONFIG, text, mode=0o640)
    ctl(head, "config", "apply")


def test_9a_a_flag_that_stops_every_rank_at_start_is_rolled_back_and_the_old_flags_serve(rehearsal):
    head, client = head_of(rehearsal), Client(head_of(rehearsal))
    before = rank_pids(serving(head))
    good = head.run(["cat", CONFIG]).stdout
    seen = len(incidents(head, "rolled_back"))
    try:
        # SGLang's own argparse refuses the value (config check knows the flag, not its choices).
        head.write_file(CONFIG, with_flags(good, "--watchdog-timeout 300 --kv-cache-dtype dsv41"), mode=0o640)
        assert reload_coordinator(head).returncode == 0
        rolled = new_incident(head, "rolled_back", seen, timeout=SERVE_S)
        assert "EXTRA_SGLANG_ARGS" in rolled["MESSAGE"] and "failed" in rolled["MESSAGE"], rolled["MESSAGE"]
        after = rank_pids(wait_serving(head, timeout=SERVE_S, changed_from=before))
        argv = rank_argv(rehearsal["spark3"])
        assert "--watchdog-timeout 300" in argv and "--kv-cache-dtype" not in argv, argv
        assert client.chat([{"role": "user", "content": "hi"}], max_tokens=4)["choices"]
        assert "EXTRA_SGLANG_ARGS" in ctl(head, "config", "diff").stdout  # the file still holds the change
        assert "holds a change that was rolled back" in status(head)["config_note"]
        head.write_file(CONFIG, good, mode=0o640)
        assert ctl(head, "config", "apply").returncode == 0
        assert rank_pids(wait_serving(head, timeout=30)) == after
    finally:
        restore(head, good)


def test_10_systemctl_restart_of_the_coordinator_keeps_every_real_rank_serving(rehearsal):
    head, client = head_of(rehearsal), Client(head_of(rehearsal))
    pids = rank_pids(serving(head))
    coordinator = unit_pid(head, "dsv41-coordinator.service")
    adopted = len(coordinator_events_named(head, "adopted"))
    head.run(["systemctl", "restart", "dsv41-coordinator.service"], timeout=120)
    assert unit_pid(head, "dsv41-coordinator.service") not in (0, coordinator)
    assert rank_pids(wait_serving(head, timeout=60)) == pids
    assert len(coordinator_events_named(head, "adopted")) == adopted + 1
    events = ctl(head, "events", "--last", "1000").stdout
    assert "rank_exit" in events and "coordinator_started" in events, events  # scenario 4's, from before it
    stopping = coordinator_events_named(head, "coordinator_stopping")[-1]
    assert stopping["DSV41_JOB_TYPE"] == "restart" and stopping["DSV41_RANKS_KEPT"] == "yes", stopping["MESSAGE"]
    for name, node in rehearsal.items():
        assert unit_pid(node, "dsv41-rank.service") == pids[name]
    assert client.chat([{"role": "user", "content": "hi"}], max_tokens=4)["choices"]


def test_11_the_head_frozen_20_s_keeps_every_real_rank_with_one_pause_event(rehearsal):
    head, client = head_of(rehearsal), Client(head_of(rehearsal))
    pids = rank_pids(serving(head))
    seen = {kind: len(incidents(head, kind)) for kind in ("node_lost", "rank_hung", "node_rebooted", "rank_exit")}
    paused = len(coordinator_events_named(head, "coordinator_paused"))
    head.freeze()  # the coordinator, the head's agent and rank 0 together
    try:
        time.sleep(20.0)
    finally:
        head.thaw()
    thawed_at = time.monotonic()
    wait_for(lambda: coordinator_events_named(head, "coordinator_paused")[paused:], 4 * LEASE_S,
             "no coordinator_paused event")
    time.sleep(max(0.0, thawed_at + 2 * LEASE_S - time.monotonic()))  # past the leases counted from the thaw
    body = status(head)
    assert body["phase"] == "serving" and rank_pids(body) == pids, body.get("phase_detail")
    assert {kind: len(incidents(head, kind)) for kind in seen} == seen, ctl(head, "events").stdout
    (event,) = coordinator_events_named(head, "coordinator_paused")[paused:]
    assert 19.0 <= float(event["DSV41_PAUSED_S"]) <= 30.0, event["MESSAGE"]
    assert client.chat([{"role": "user", "content": "hi"}], max_tokens=4)["choices"]


def test_13_a_slowed_link_fails_the_collective_gate_naming_the_pair(rehearsal):
    """spark3's link rate-limited on its host-side veth: the next bring-up's gate measures the
    pairs with spark3 below the floor and fails before launch, naming the slowest; with the limit
    gone the cluster serves again."""
    head, slow = head_of(rehearsal), rehearsal["spark3"]
    serving(head)
    refused = ctl(head, "fabric", "test")  # the ranks hold the rendezvous port
    assert refused.returncode == 1 and "refused in phase serving" in refused.stderr, refused.stdout + refused.stderr
    stopped = ctl(head, "stop", "--wait", "180")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    failed_before = len(incidents(head, "collective_failed"))
    veth = slow.host_veth
    subprocess.run(["tc", "qdisc", "add", "dev", veth, "root", "tbf", "rate", "100mbit", "burst", "64kb",
                    "latency", "50ms"], check=True)
    try:
        tested = ctl(head, "fabric", "test")  # on demand, with the ranks stopped
        assert tested.returncode == 1, tested.stdout + tested.stderr
        assert re.search(r"spark[12]–spark3: [0-9.]+ GB/s, floor 0.1 GB/s", tested.stderr), tested.stderr
        assert "collective gate (gloo): spark1–spark2" in tested.stdout, tested.stdout
        assert ctl(head, "start").returncode == 0
        wait_for(lambda: status(head).get("phase") == "failed", 240, "the bring-up did not fail at the gate")
        body = status(head)
        detail = body["phase_detail"]
        assert "collective" in detail and "COLLECTIVE_PAIR_MIN_GBPS" in detail, detail
        assert re.search(r"spark[12]–spark3: [0-9.]+ GB/s, floor 0.1 GB/s", detail), detail
        assert len(incidents(head, "collective_failed")) == failed_before + 1
        slowest = {f["group"]: f["busbw_gbps"] for f in body["collective"]["figures"]}
        print(f"collective gate figures with spark3 at 100 Mbit/s: {slowest}")
        assert slowest["spark1–spark2"] >= 0.1 > max(slowest["spark1–spark3"], slowest["spark2–spark3"]), slowest
        assert all(sglang_processes(node) == [] for node in rehearsal.values())  # it failed before launch
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", veth, "root"], check=False)
    assert ctl(head, "start").returncode == 0
    body = wait_serving(head, timeout=SERVE_S)
    assert body["collective"]["ok"], body["collective"]


def refusal(client: Client, key: bool = True) -> tuple[int, dict, str]:
    """A new chat request's HTTP status, its error body and its Retry-After (it is expected to be refused)."""
    try:
        client.post("/v1/chat/completions", {"model": "deepseek-v4.1-flash", "max_tokens": 4,
                                             "messages": [{"role": "user", "content": "hi"}]}, timeout=30, key=key)
    except urllib.error.HTTPError as exc:
        text = exc.read().decode()
        return exc.code, (json.loads(text) if text.startswith("{") else {}), exc.headers.get("Retry-After") or ""
    return 200, {}, ""


def test_12_restart_drain_lets_the_request_in_flight_finish_and_refuses_new_ones_naming_the_drain(rehearsal):
    head = head_of(rehearsal)
    client = Client(head)
    before = rank_pids(serving(head))
    started_before = len(coordinator_events_named(head, "drain_started"))
    call = long_answer(client)
    asked = ctl(head, "restart", "--drain")
    assert asked.returncode == 0 and "DRAIN_TIMEOUT_S" in asked.stdout, asked.stdout + asked.stderr
    wait_for(lambda: status(head).get("phase") == "draining", 15, "the coordinator did not start draining")
    code, body, retry_after = refusal(client)
    assert code == 503 and retry_after == "60", (code, body)
    assert "draining for a restart: dsv41ctl restart --drain" in body["error"]["message"], body
    assert refusal(client, key=False)[0] == 401  # SGLang's API key still answers first
    code, drain = client.get("/dsv41/drain")
    assert code == 200 and json.loads(drain)["draining"] is True
    outcome = call.outcome(timeout=120)
    assert isinstance(outcome, dict) and outcome["meta_info"]["finish_reason"]["type"] == "stop", outcome
    assert outcome["meta_info"]["completion_tokens"] == 208  # its whole answer, to the loop abort
    after = wait_serving(head, timeout=SERVE_S, changed_from=before)
    assert all(after_pid != before[name] for name, after_pid in rank_pids(after).items())
    assert client.chat([{"role": "user", "content": "19+23?"}])["choices"][0]["message"]["content"] == "42"
    started = coordinator_events_named(head, "drain_started")[started_before:]
    assert started and started[-1]["DSV41_IN_FLIGHT"] == "1", started
    done = coordinator_events_named(head, "drain_done")
    assert done and done[-1]["DSV41_FINISHED"] == "1", done


def test_14_a_fabric_address_added_while_serving_is_drained_and_restarted_naming_the_node(rehearsal):
    """Another tool adds an address to spark2's fabric netdev under the real group: the agent's
    netlink watch reports it at once, the coordinator records fabric_changed naming spark2 and the
    change, drains the real request in flight to its end, and the group serves again; taking the
    address away is one more change."""
    head, spark2 = head_of(rehearsal), rehearsal["spark2"]
    client = Client(head)
    before = rank_pids(serving(head))
    seen = len(incidents(head, "fabric_changed"))
    drains_before = len(coordinator_events_named(head, "drain_started"))
    call = long_answer(client)
    spark2.run(["ip", "addr", "add", "10.78.0.2/24", "dev", "host0"])
    try:
        changed = new_incident(head, "fabric_changed", seen, timeout=30)
        assert changed["DSV41_NODE_NAME"] == "spark2", changed["MESSAGE"]
        assert "host0 address 10.78.0.2/24 added" in changed["MESSAGE"], changed["MESSAGE"]
        wait_for(lambda: status(head).get("phase") == "draining", 20, "the coordinator did not drain")
        code, body, _ = refusal(client)
        assert code == 503 and "draining for a restart: the fabric of spark2 changed" in body["error"]["message"]
        outcome = call.outcome(timeout=120)
        assert isinstance(outcome, dict) and outcome["meta_info"]["completion_tokens"] == 208, outcome
        after = wait_serving(head, timeout=SERVE_S, changed_from=before)
        assert all(after_pid != before[name] for name, after_pid in rank_pids(after).items())
        drained = coordinator_events_named(head, "drain_started")[drains_before:]
        assert drained and drained[0]["DSV41_IN_FLIGHT"] == "1", drained
    finally:
        spark2.run(["ip", "addr", "del", "10.78.0.2/24", "dev", "host0"], check=False)
    removed = new_incident(head, "fabric_changed", seen + 1, timeout=30)
    assert "host0 address 10.78.0.2/24 removed" in removed["MESSAGE"], removed["MESSAGE"]
    wait_serving(head, timeout=SERVE_S, changed_from=rank_pids(after))
    assert client.chat([{"role": "user", "content": "19+23?"}])["choices"][0]["message"]["content"] == "42"


def test_3_stop_with_a_request_in_flight_leaves_no_sglang_process(rehearsal):
    head = head_of(rehearsal)
    client = Client(head)
    serving(head)
    call = long_answer(client)
    # rank 0 drains: the request decodes to its end (the loop abort), then every rank exits; the
    # phase says stopped only once every node confirmed its rank unit gone
    stopped = ctl(head, "stop", "--wait", "180")
    assert stopped.returncode == 0 and "STOPPED" in stopped.stdout, stopped.stdout + stopped.stderr
    outcome = call.outcome(timeout=10)
    assert isinstance(outcome, dict) and outcome["meta_info"]["finish_reason"]["type"] == "stop", outcome
    assert outcome["meta_info"]["completion_tokens"] == 208
    for name, node in rehearsal.items():
        assert sglang_processes(node) == [], name
    started = ctl(head, "start")
    assert started.returncode == 0, started.stderr
    wait_serving(head, timeout=SERVE_S)
    call = long_answer(client)
    head.run(["systemctl", "stop", "dsv41-coordinator.service"], timeout=180)
    outcome = call.outcome(timeout=120)
    assert isinstance(outcome, dict) and outcome["meta_info"]["finish_reason"]["type"] == "stop", outcome
    for name, node in rehearsal.items():
        assert sglang_processes(node) == [], name


# ------------------------------------------------------------------ several groups behind the gateway

GATEWAY_PORT = 30000  # GATEWAY_PORT's default


class Load:
    """A client sending one chat request a second through the gateway, counting the answers."""

    def __init__(self, client: Client) -> None:
        self.client, self.codes = client, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                reply = self.client.post("/v1/chat/completions", {"model": "deepseek-v4.1-flash", "max_tokens": 4,
                                          "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
                self.codes.append(200 if reply.get("choices") else f"no choices: {reply}")
            except urllib.error.HTTPError as exc:
                self.codes.append(f"{exc.code} {exc.read()[:200]!r}")
            except OSError as exc:
                self.codes.append(repr(exc))
            self._stop.wait(max(0.0, 1.0 - (time.monotonic() - started)))

    def stop(self) -> list:
        self._stop.set()
        self._thread.join(90)
        return self.codes


def groups_serving(head, timeout: float, changed: dict | None = None) -> dict:
    """Status once every group serves and the gateway has each as a healthy worker (with `changed`:
    once each group named there runs other PIDs)."""
    def ready():
        body = status(head)
        gateway = body.get("gateway", {})
        healthy = [w for w in gateway.get("workers", []) if w.get("healthy")]
        if all(g.get("phase") == "serving" for g in body.get("groups", [])) and body.get("groups") and \
                len(healthy) == len(body["groups"]) and \
                (changed is None or all(group_pids(body, g) != pids for g, pids in changed.items())):
            return body
        return None
    try:
        return wait_for(ready, timeout, "the groups did not all serve behind the gateway")
    except AssertionError:
        body = status(head)
        seen = [(g["name"], g["phase"], g.get("phase_detail", "")) for g in body.get("groups", [])]
        journal = head.run(["journalctl", "-u", "dsv41-coordinator", "-n", "60", "--no-pager", "-o", "cat"],
                           check=False).stdout
        raise AssertionError(f"the groups did not all serve behind the gateway within {timeout} s: {seen}; "
                             f"gateway {body.get('gateway')}\n{journal}") from None


def group_pids(body: dict, group: str) -> dict[str, int]:
    names = next(g["nodes"] for g in body["groups"] if g["name"] == group)
    return {n: p for n, p in rank_pids(body).items() if n in names}


def test_15_three_groups_behind_the_gateway_one_killed_and_the_gateway_keeps_answering(rehearsal):
    """GROUPS of one node each (TP 1: three ranks are what two cores hold), the gateway run from the
    ranks' own runtime (the engine's environment has sglang-router, as the SGLang image does)."""
    head = head_of(rehearsal)
    head.run(["systemctl", "stop", "dsv41-coordinator.service"], timeout=180)
    before = head.run(["cat", CONFIG]).stdout
    # As on a head that never applied another file: the groups start together. (A change from the file
    # the earlier scenarios applied would roll, one group's bring-up after another, and a rank exit
    # within ROLLOUT_CONFIRM_S of it would bring that file back, as documented: the kill here is a
    # fault of the serving groups, not of a change.)
    head.run(["rm", "-rf", "/var/lib/dsv41/coordinator/config"])
    grouped = profile_env(rehearsal, GROUPS='"spark1 spark2 spark3"', TP_SIZE="1", RESTART_MAX_ATTEMPTS="20")
    head.write_file(CONFIG, grouped, mode=0o640)
    try:
        head.run(["systemctl", "start", "dsv41-coordinator.service"], timeout=60)
        body = groups_serving(head, SERVE_S)
        assert body["gateway"]["url"] == f"http://{head.address}:{GATEWAY_PORT}", body["gateway"]
        assert head.run(["systemctl", "is-active", "dsv41-gateway.service"], check=False).stdout.strip() == "active"
        client = Client(head)
        client.base = f"http://{head.address}:{GATEWAY_PORT}"
        assert client.chat([{"role": "user", "content": "hi"}], max_tokens=4)["choices"]
        assert client.get("/v1/models", key=False)[0] == 200  # the gateway's open route
        with pytest.raises(urllib.error.HTTPError) as refused:  # the gateway's key is the cluster's
            client.post("/v1/chat/completions", {"model": "deepseek-v4.1-flash", "messages": []}, key=False)
        assert refused.value.code == 401
        pids = {g: group_pids(body, g) for g in ("g1", "g2", "g3")}
        load = Load(client)
        time.sleep(8)
        rehearsal["spark2"].run(["kill", "-9", str(pids["g2"]["spark2"])])
        after = groups_serving(head, 2 * SERVE_S, changed={"g2": pids["g2"]})
        # Go on sending once group 2 is back, to at least 30 requests over the whole window.
        wait_for(lambda: len(load.codes) >= 30, 90, f"the client sent {len(load.codes)} requests only")
        codes = load.stop()
        assert group_pids(after, "g1") == pids["g1"] and group_pids(after, "g3") == pids["g3"], (pids, after)
        ok = codes.count(200)
        print(f"through the gateway while g2 was killed and restarted: {ok}/{len(codes)} answered 200")
        assert len(codes) >= 30 and ok >= 0.95 * len(codes), codes
        exits = incidents(head, "rank_exit")
        assert exits and exits[-1]["DSV41_NODE_NAME"] == "spark2" and exits[-1]["DSV41_GROUP"] == "g2", exits[-1:]
        stopped = ctl(head, "stop", "--wait", "180")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert head.run(["systemctl", "is-active", "dsv41-gateway.service"], check=False).stdout.strip() != "active"
        for name, node in rehearsal.items():
            assert sglang_processes(node) == [], name
    finally:
        head.run(["systemctl", "stop", "dsv41-coordinator.service"], check=False, timeout=180)
        head.write_file(CONFIG, before, mode=0o640)
