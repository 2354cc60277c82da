"""dsv41-sim-rank as three real processes on loopback: rendezvous, serving, abort with real memory,
rank loss, SIGTERM drain, and NCCL's behaviour when a rank stops answering: the others wait in
the collective until the watchdog, and every rank counts its forward steps for its agent."""

import http.client
import json
import os
import signal
import socket
import subprocess
import threading
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BIN = Path(__file__).resolve().parents[2] / "bin" / "dsv41-sim-rank"
MiB = 1 << 20


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Rank:
    """One stand-in process; its output lines are collected as they come."""

    def __init__(self, argv, env):
        self.proc = subprocess.Popen(["/usr/bin/python3", str(BIN), *argv], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env)
        self.lines = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    def wait_line(self, fragment, timeout=10):
        deadline = time.monotonic() + timeout
        with self._cond:
            while not any(fragment in line for line in self.lines):
                left = deadline - time.monotonic()
                assert left > 0, f"no line with {fragment!r} in {self.lines}"
                self._cond.wait(left)
        return next(line for line in self.lines if fragment in line)

    def rss(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


class Group:
    def __init__(self, **env):
        self.dist_port, self.http_port = free_port(), free_port()
        self.progress_dir = tempfile.mkdtemp(prefix="dsv41-progress-")
        self.env = {**os.environ, "DSV41_PROGRESS_DIR": self.progress_dir, **env}
        self.ranks = {}

    def argv(self, rank, **changes):
        flags = {"--model-path": "/models/dsv", "--served-model-name": "dsv", "--tp-size": "3", "--nnodes": "3",
                 "--node-rank": str(rank), "--dist-init-addr": f"127.0.0.1:{self.dist_port}",
                 "--host": "127.0.0.1", "--port": str(self.http_port), "--chunked-prefill-size": "256",
                 "--mem-fraction-static": "0.93" if rank == 0 else "0.95", **changes}
        return [item for pair in flags.items() for item in pair] + ["--trust-remote-code", "--sleep-on-idle"]

    def start(self, rank, **changes):
        self.ranks[rank] = Rank(self.argv(rank, **changes), self.env)
        return self.ranks[rank]

    def start_all(self):
        for rank in (1, 0, 2):
            self.start(rank)
        self.ranks[0].wait_line("serving dsv on http://127.0.0.1")
        return self.ranks

    def call(self, method, path, body=None, timeout=30):
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=timeout)
        conn.request(method, path, body=None if body is None else json.dumps(body).encode())
        resp = conn.getresponse()
        raw = resp.read()
        conn.close()
        return resp.status, (json.loads(raw) if raw and resp.getheader("Content-Type") == "application/json" else raw)

    def inflight(self):
        return self.call("GET", "/dsv41/inflight")[1]["requests"]

    def kill_all(self):
        for rank in self.ranks.values():
            if rank.proc.poll() is None:
                rank.proc.kill()
            rank.proc.wait()


@pytest.fixture
def group_factory():
    groups = []

    def make(**env):
        groups.append(Group(**env))
        return groups[-1]

    yield make
    for group in groups:
        group.kill_all()


def wait_until(predicate, timeout=10, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_the_group_serves_aborts_keeps_kv_memory_as_sglangs_pool_does_and_drains_on_sigterm(group_factory):
    g = group_factory(DSV41_SIM_PREFILL_TOKENS_PER_S="4000", DSV41_SIM_BYTES_PER_TOKEN="65536",
                      DSV41_SIM_DECODE_TOKENS_PER_S="20")
    first = g.start(1)
    assert f"waiting for rank 0 at 127.0.0.1:{g.dist_port}" in first.wait_line("waiting for rank 0")
    head = g.start(0)
    assert f"to join at 127.0.0.1:{g.dist_port}" in head.wait_line("waiting for ranks")
    head.wait_line("rank 1 joined")
    g.start(2)
    head.wait_line("serving dsv")
    for rank in g.ranks.values():
        assert "stand-in for SGLang" in rank.wait_line("dsv41-sim-rank (")
    assert g.call("GET", "/health")[0] == 200

    status, body = g.call("POST", "/v1/chat/completions",
                          {"model": "dsv", "rid": "smoke", "messages": [{"role": "user", "content": "What is 19+23?"}]})
    assert status == 200 and body["id"] == "smoke"
    assert "42" in body["choices"][0]["message"]["content"] and body["choices"][0]["finish_reason"] == "stop"

    status, raw = g.call("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "19+23?"}],
                                                         "stream": True})
    events = [e[len("data: "):] for e in raw.decode().split("\n\n") if e]
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "42" in "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"

    # A 40k-token prompt: 10 s of prefill, 64 KiB per token (2.5 GiB if it ran to the end).
    baseline = head.rss()

    def long_prompt(rid):
        out = {}
        body = {"rid": rid, "messages": [{"role": "user", "content": "word " * 32_000}]}
        thread = threading.Thread(target=lambda: out.update(
            zip(("status", "body"), g.call("POST", "/v1/chat/completions", body))))
        thread.start()
        return thread, out

    client, result = long_prompt("runaway-1")
    wait_until(lambda: any(r["prefilled_tokens"] >= 8192 for r in g.inflight()), what="8192 tokens prefilled")
    grown = head.rss()
    assert grown - baseline >= 480 * MiB, (baseline, grown)
    assert g.call("POST", "/abort_request", {"rid": "runaway-1", "abort_all": False})[0] == 200
    client.join(10)
    assert result["status"] == 200 and result["body"]["choices"][0]["finish_reason"] == "abort"
    assert g.inflight() == []
    # As with SGLang's KV pool, what the aborted request held stays with the process...
    time.sleep(0.5)
    held = head.rss()
    assert held - baseline >= 480 * MiB, (baseline, held)
    # ...and the prefill_empty_cache hook (a chunk of a prompt of 8192 tokens and more) does not give
    # it back: the next prompt's KV takes the freed slots, whose pages are there, and nothing more.
    # That one is aborted within a few chunks of its own.
    client, result = long_prompt("next-1")
    wait_until(lambda: any(r["prefilled_tokens"] >= 2048 for r in g.inflight()), what="chunks of the next prompt")
    assert abs(head.rss() - held) < 64 * MiB, (held, head.rss())  # 2048 tokens of new KV would be 128 MiB
    assert g.call("POST", "/abort_request", {"rid": "next-1", "abort_all": False})[0] == 200
    client.join(10)
    assert result["status"] == 200 and result["body"]["choices"][0]["finish_reason"] == "abort"
    assert head.rss() - baseline >= 480 * MiB, (baseline, head.rss())
    head.wait_line("aborting runaway-1")

    # SIGTERM on a worker is only logged.
    g.ranks[1].proc.send_signal(signal.SIGTERM)
    g.ranks[1].wait_line("SIGTERM received and ignored")
    assert g.ranks[1].proc.poll() is None and g.call("GET", "/health")[0] == 200

    # SIGTERM on rank 0 with a request in flight: it completes, then every rank exits 0.
    result.clear()
    client = threading.Thread(target=lambda: result.update(zip(("status", "body"), g.call(
        "POST", "/v1/chat/completions", {"rid": "last", "messages": [{"role": "user", "content": "What is 19+23?"}]}))))
    client.start()
    wait_until(lambda: [r["rid"] for r in g.inflight()] == ["last"], what="the request in flight")
    head.proc.send_signal(signal.SIGTERM)
    assert "draining 1 in-flight requests" in head.wait_line("SIGTERM received: /health answers 503")
    assert g.call("GET", "/health")[0] == 503
    client.join(10)
    assert result["status"] == 200 and "42" in result["body"]["choices"][0]["message"]["content"]
    assert result["body"]["choices"][0]["finish_reason"] == "stop"
    assert [g.ranks[r].proc.wait(10) for r in (0, 1, 2)] == [0, 0, 0]
    assert "rank 0 asked all ranks to shut down" in g.ranks[2].wait_line("exit 0")


def test_past_the_drain_budget_in_flight_requests_are_aborted_and_all_ranks_exit_0(group_factory):
    g = group_factory(DSV41_SIM_DRAIN_TIMEOUT_S="0.3", DSV41_SIM_PREFILL_TOKENS_PER_S="1000",
                      DSV41_SIM_BYTES_PER_TOKEN="0")
    ranks = g.start_all()
    result = {}
    client = threading.Thread(target=lambda: result.update(zip(("status", "body"), g.call(
        "POST", "/v1/chat/completions", {"rid": "slow", "messages": [{"role": "user", "content": "word " * 8000}]}))))
    client.start()
    wait_until(lambda: g.inflight() != [], what="the request in flight")
    ranks[0].proc.send_signal(signal.SIGTERM)
    client.join(10)
    assert result["status"] == 200 and result["body"]["choices"][0]["finish_reason"] == "abort"
    assert [ranks[r].proc.wait(10) for r in (0, 1, 2)] == [0, 0, 0]
    assert "aborted 1 requests" in ranks[0].wait_line("drain budget of 0.3 s spent")


@pytest.mark.parametrize("victim", [1, 2])
def test_a_killed_worker_takes_the_whole_group_down(group_factory, victim):
    g = group_factory()  # no peer timeout: an exit within seconds means the closed connection was noticed
    ranks = g.start_all()
    ranks[victim].proc.kill()
    others = [r for r in (0, 1, 2) if r != victim]
    assert [ranks[r].proc.wait(5) for r in others] == [1, 1]
    assert f"lost rank {victim} (connection closed" in ranks[0].wait_line("lost rank")
    assert f"lost rank {victim}" in ranks[others[1]].wait_line("lost rank")


def test_a_killed_head_takes_the_workers_down(group_factory):
    g = group_factory()
    ranks = g.start_all()
    ranks[0].proc.kill()
    assert [ranks[r].proc.wait(5) for r in (1, 2)] == [1, 1]
    assert f"lost rank 0 at 127.0.0.1:{g.dist_port} (connection closed" in ranks[1].wait_line("lost rank 0")


def test_ranks_that_disagree_do_not_form_a_group(group_factory):
    g = group_factory()
    head = g.start(0)
    worker = g.start(1, **{"--chunked-prefill-size": "512"})
    assert head.proc.wait(10) == 1 and worker.proc.wait(10) == 1
    line = head.wait_line("error:")
    assert "rank 1 disagrees with rank 0: --chunked-prefill-size 512 there, 256 here" in line
    assert "rank 0 refused this rank" in worker.wait_line("error:")


def test_a_worker_without_a_head_gives_up_at_the_rendezvous_deadline(group_factory):
    g = group_factory(DSV41_SIM_RENDEZVOUS_TIMEOUT_S="1")
    worker = g.start(2)
    assert worker.proc.wait(10) == 1
    assert f"rank 0 at 127.0.0.1:{g.dist_port} did not answer within 1 s" in worker.wait_line("error:")
    assert len([line for line in worker.lines if "waiting for rank 0" in line]) == 1


def test_sigterm_before_the_group_forms_stops_the_head_and_the_joined_workers(group_factory):
    g = group_factory()
    head = g.start(0)
    worker = g.start(1)
    head.wait_line("rank 1 joined")
    head.proc.send_signal(signal.SIGTERM)
    assert head.proc.wait(5) == 0 and worker.proc.wait(5) == 0
    worker.wait_line("rank 0 shut down before the group formed")


def counts(g):
    from dsv41 import progress
    return {p.tp_rank: p.count for p in progress.read_all(g.progress_dir, allowed_uids=(os.getuid(),))}


def chat_in_thread(g, rid, words, result, timeout=60):
    def run():
        try:
            result.update(zip(("status", "body"), g.call(
                "POST", "/v1/chat/completions", {"rid": rid, "messages": [{"role": "user", "content": "word " * words}]},
                timeout=timeout)))
        except OSError as exc:
            result["error"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_every_rank_counts_the_same_forward_steps(group_factory):
    g = group_factory()
    ranks = g.start_all()
    before = counts(g)
    assert set(before) == {0, 1, 2}
    status, body = g.call("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "19+23?"}]})
    assert status == 200 and "42" in body["choices"][0]["message"]["content"]
    wait_until(lambda: len(set(counts(g).values())) == 1, what="the ranks agreeing on the step count")
    after = counts(g)
    assert after[0] > before[0] + 1  # a prefill and decode steps, each on every rank
    assert ranks[0].proc.poll() is None


def test_a_stopped_worker_stalls_generation_and_health_while_the_http_side_answers(group_factory):
    g = group_factory(DSV41_SIM_PREFILL_TOKENS_PER_S="2000")
    ranks = g.start_all()
    result: dict = {}
    client = chat_in_thread(g, "stalled", 4000, result)  # prefills for about 0.5 s
    wait_until(lambda: g.inflight() != [], what="the request in flight")
    ranks[2].proc.send_signal(signal.SIGSTOP)
    try:
        # Steps already answered before the signal landed may still complete; then nobody steps.
        stalled = counts(g)
        for _ in range(50):
            time.sleep(0.2)
            again, stalled = stalled, counts(g)
            if again == stalled:
                break
        time.sleep(1.5)
        now = counts(g)
        assert now == stalled  # no rank takes a step while one of the group is stopped
        assert now[2] < max(now[0], now[1])  # the stopped rank is behind: it never started the step the others wait in
        assert client.is_alive() and "status" not in result
        assert [r["rid"] for r in g.inflight()] == ["stalled"]  # the HTTP side still answers
        with pytest.raises(OSError):  # /health runs a generation: it cannot answer meanwhile
            g.call("GET", "/health", timeout=3)
        assert all(rank.proc.poll() is None for rank in ranks.values())  # nobody gives up on silence
    finally:
        ranks[2].proc.send_signal(signal.SIGCONT)
    client.join(30)
    assert result["status"] == 200 and result["body"]["choices"][0]["finish_reason"] == "stop"
    assert g.call("GET", "/health")[0] == 200


@pytest.mark.parametrize("inherited", [signal.SIG_DFL, signal.SIG_IGN], ids=["sigquit_default", "sigquit_ignored"])
def test_the_watchdog_ends_a_step_that_never_completes_and_the_group_goes_down(group_factory, inherited):
    # SIG_IGN: started as a shell's background job is (SIGQUIT ignored, and exec keeps that); the
    # rank still dies of SIGQUIT, as SGLang's launcher, with a SIGQUIT handler of its own, does.
    g = group_factory()
    previous = signal.signal(signal.SIGQUIT, inherited)
    try:
        for rank in (1, 0, 2):
            g.start(rank, **{"--watchdog-timeout": "2"})
    finally:
        signal.signal(signal.SIGQUIT, previous)
    g.ranks[0].wait_line("serving dsv on http://127.0.0.1")
    g.ranks[1].proc.send_signal(signal.SIGSTOP)
    result: dict = {}
    t0 = time.monotonic()
    chat_in_thread(g, "r", 10, result)
    try:
        assert g.ranks[0].proc.wait(15) == -signal.SIGQUIT  # as SGLang's watchdog ends the scheduler
        took = time.monotonic() - t0
        assert 2.0 <= took < 10, took
        assert "Scheduler watchdog timeout (self.watchdog_timeout=2" in g.ranks[0].wait_line("watchdog timeout")
        assert "waited 2 s for ranks 1" in g.ranks[0].wait_line("watchdog timeout")
        assert g.ranks[2].proc.wait(10) != 0  # rank 0's connection closed under it
    finally:
        g.ranks[1].proc.send_signal(signal.SIGCONT)


def test_a_quick_exit_on_silence_only_where_a_test_asks_for_it(group_factory):
    g = group_factory(DSV41_SIM_PEER_TIMEOUT_S="1")
    ranks = g.start_all()
    ranks[2].proc.send_signal(signal.SIGSTOP)
    try:
        assert ranks[0].proc.wait(10) == 1
        assert "lost rank 2 (no heartbeat for 1 s)" in ranks[0].wait_line("lost rank")
    finally:
        ranks[2].proc.send_signal(signal.SIGCONT)
