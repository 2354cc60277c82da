"""The supervisor over fake agents and a stand-in rank 0 HTTP server on loopback: operator requests
preempt a bring-up, the newer request wins, an agent lost in the middle of a step fails that step
naming the node (an incident, and the restart policy goes on), a rank exit fails the bring-up.

The real thing (agents in booted systemd nodes, the stand-in engine) is in
tests/integration/test_supervisor_preemption.py; these pin the supervisor's own logic fast.

The supervisor runs on a fake clock (tests.fakeclock) that only the test moves, a tick at a time:
the agents' heartbeats and the serving probe's observations come with the ticks, and after each
tick the test waits until the supervisor has applied them and checked leases and hangs at the new
time. "Nothing happened" is asserted after the supervisor had its chance to act over a stated span
of its time; "something happened" within a stated span of it."""

from __future__ import annotations

import io
import re
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest

from adapter.boot import BUILDERS
from dsv41.adapterlog import PREFIX
from coordinator import config
from coordinator.agents import AgentUnavailable
from coordinator.messages import Wake, WorkSeen
from coordinator.runtime import ClusterRuntime
from dsv41.journal import EventLog
from dsv41.v1 import agent_pb2 as pb
from tests.configtext import HOME, SEED_TEXT, edited
from tests.fakeclock import FakeClock
from tests.rpcfailure import RpcFailure

pytestmark = pytest.mark.unit
DOWN = RpcFailure(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; connection refused")
SILENT = RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")


class RankZero:
    """/health and /v1/chat/completions of a rank 0; `healthy` switches /health from 503 to 200.
    `inflight`: the rids GET /dsv41/inflight lists (None: it answers {} as a route it does not
    know); `drains`: the bodies POST /dsv41/drain got; `drain_route` False answers it 404."""

    def __init__(self):
        self.healthy = threading.Event()
        self.inflight = None
        self.drains = []
        self.drain_route = True
        self.lifted = 0  # DELETE /dsv41/drain calls
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_DELETE(self):
                outer.lifted += 1
                outer.drains.clear()
                self._answer(200, {"draining": False})

            def do_GET(self):
                if self.path == "/dsv41/drain" and outer.drains:
                    self._answer(200, {"draining": True, "reason": outer.drains[-1]["reason"], "since_s": 1.0})
                    return
                if self.path == "/dsv41/inflight" and outer.inflight is not None:
                    self._answer(200, {"requests": [{"rid": r, "prompt_tokens": 1, "prefilled_tokens": 1}
                                                    for r in list(outer.inflight)]})
                    return
                self._answer(200 if outer.healthy.is_set() else 503, {})

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path == "/dsv41/drain":
                    outer.drains.append(json.loads(body))
                    self._answer(200 if outer.drain_route else 404, {})
                    return
                self._answer(200, {"choices": [{"message": {"content": "42"}, "finish_reason": "stop"}]})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        # its shutdown waits for a poll of serve_forever: 50 ms, not the default 500
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class FakeAgent:
    """A node agent in memory: ranks start and stop at once; `down` makes every call fail like a
    node that cannot be reached; `pack` is this node's pack layers' state."""

    def __init__(self, node, journal, clock):
        self.node, self.target = node, f"{node}:7441"
        self.clock = clock
        self.journal = journal  # shared list of (node, call) in call order across nodes
        self.down = False
        self.running = ""
        self.starts = 0
        self.pack = pb.PackLayerState.COMPLETE
        self.pack_running = False
        self.rows = None  # the pack's header range; None: this rank's third
        self.mount = pb.MountState.HEALTHY
        self.on_event = None
        self.frozen = False  # a frozen node: no heartbeat, and every call hangs until thawed
        self.boot = f"{node}-boot1"
        self.steps, self.stepped_at = 0, clock.monotonic()
        self.last_exit = None  # the ExitInfo of the rank's last run, as the agent reports it
        self.stop_deadlines = []  # the deadline of each StopRank
        self.output = []  # lines the rank logged, after its adapters' (recent_journal)

    def _call(self, what, timeout=None):
        self.journal.append((self.node, what))
        end = self.clock.monotonic() + (timeout or 10.0)
        while self.frozen:  # a frozen node's kernel takes the connection; nobody answers
            if self.clock.monotonic() >= end:
                raise AgentUnavailable(self.node, what, SILENT)
            self.clock.wait(0.01)  # the call's timeout is on the fake clock; a thaw is seen within 10 ms
        if self.down:
            raise AgentUnavailable(self.node, what, DOWN)

    def rank(self):
        return pb.RankState(active_state="active" if self.running else "inactive", invocation_id=self.running,
                            last_exit=self.last_exit)

    def status(self, timeout=None):
        self._call("status", timeout)
        return pb.NodeStatus(node=self.node, agent_version="1", rank=self.rank(),
                             memory=pb.MemorySample(available_bytes=100 << 30))

    def recent_journal(self, lines, units, timeout=30):
        """The rank's output: every adapter reports installed, as in a rank that armed them; then
        `output`, lines the test gives it (at the time of the call)."""
        self._call("read_journal", timeout)
        now = self.clock.time()
        return [pb.JournalLine(node=self.node, unit="dsv41-rank.service", message=f"{PREFIX}{name} installed (x)")
                for name, _build in BUILDERS] + [pb.JournalLine(node=self.node, unit="dsv41-rank.service",
                                                                message=m, at_unix_s=now - ago)
                                                   for m, ago in map(self._aged, self.output)]

    @staticmethod
    def _aged(line):
        """An output line: its text, logged now; or (text, seconds ago)."""
        return (line, 0.0) if isinstance(line, str) else line

    def check_fabric(self, plan, timeout):
        self._call("check_fabric")
        return pb.FabricReport(ok=True)

    def run_collective_test(self, spec, timeout):
        self._call("run_collective_test")
        slow = getattr(self, "slow_groups", {})  # group -> GB/s, as a test slows links
        figures = [pb.CollectiveTestFigure(group=group, busbw_gbps=slow.get(group, 4.6))
                   for group in ("spark1–spark2", "spark1–spark3", "spark2–spark3", "all")]
        return pb.CollectiveTestResult(node=self.node, ok=True, backend=spec.backend, transport="NET/IB",
                                       figures=figures)

    def pack_state(self, plan, timeout=None):
        self._call("pack_state")
        rank = int(self.node[-1]) - 1  # spark1..3: ranks 0..2, each a third of a 9-row table
        lo, hi = self.rows or (3 * rank, 3 * rank + 3)
        return pb.PackState(layers=[pb.PackLayerState(layer=1, rank=rank, state_kind=self.pack, state="x",
                                                      row_lo=lo, row_hi=hi, total_rows=9)],
                            running=self.pack_running)

    def start_pack(self, plan):
        self._call("start_pack")
        self.pack, self.pack_running = pb.PackLayerState.PACKING, True
        return self.pack_state(plan)

    def ensure_export(self, plan, timeout):
        self._call("ensure_export")
        return pb.ExportState(exported=True, outcome=pb.ExportState.EXPORTED)

    def ensure_mount(self, plan, timeout):
        self._call("ensure_mount")
        return pb.MountState(state=pb.MountState.MOUNTING)

    def get_mount(self, timeout=None):
        self._call("get_mount")
        return pb.MountState(state=self.mount)

    def start_rank(self, plan, generation, replace, timeout_s):
        self._call("start_rank")
        self.starts += 1
        self.running = f"{self.node}-run{self.starts}"
        return pb.StartRankResponse(outcome=pb.StartRankResponse.STARTED, rank=self.rank())

    def stop_rank(self, deadline_s):
        self._call("stop_rank")
        self.stop_deadlines.append(deadline_s)
        was, self.running = self.running, ""
        return pb.StopRankResponse(outcome=pb.StopRankResponse.CLEAN if was else pb.StopRankResponse.WAS_NOT_RUNNING)

    def watch_rank(self, on_event, on_lost, stop, heartbeat_ms=0):
        """Heartbeats as the agent sends them, every heartbeat_ms of the fake clock while the node
        is up and not frozen: sent as the clock moves, so the supervisor has them before the tick's
        markers."""
        self.on_event = on_event
        due = [self.clock.monotonic() + heartbeat_ms / 1000]

        def beat(now):
            if stop.is_set() or now < due[0]:
                return
            due[0] = now + heartbeat_ms / 1000
            if not self.down and not self.frozen:
                on_event(pb.RankEvent(rank=self.rank(), boot_id=self.boot, heartbeat=True, progress=[
                    pb.RankProgress(forward_count=self.steps, last_step_age_s=now - self.stepped_at)]))
        self.clock.on_advance(beat)
        return threading.Thread(target=lambda: None)  # the beats need no thread of their own

    def step(self):
        self.steps += 1
        self.stepped_at = self.clock.monotonic()

    def floor_stopping(self, detail):
        """This node's memory floor has signalled its rank, which is still stopping (draining)."""
        self.on_event(pb.RankEvent(rank=pb.RankState(active_state="deactivating", invocation_id=self.running,
                                                     stopping_cause=pb.ExitInfo.MEMORY_FLOOR,
                                                     stopping_detail=detail)))

    def exit_rank(self, result="signal", code="killed", status=9, at=None, floor=""):
        """The rank process ends; the agent streams its unit's state (`floor`: its memory floor
        ended it, with this detail)."""
        invocation, self.running = self.running, ""
        info = pb.ExitInfo(result=result, code=code, status=status, at_unix_s=at or self.clock.time(),
                           invocation_id=invocation, cause=pb.ExitInfo.MEMORY_FLOOR if floor else 0,
                           cause_detail=floor)
        self.on_event(pb.RankEvent(rank=pb.RankState(active_state="failed", invocation_id=invocation,
                                                     last_exit=info)))


TICK_S = 0.05  # how far the fake clock moves a tick: a fifth of the fastest heartbeat (LIVE's)
SUPERVISOR_REAL_S = 10.0  # real time the supervisor may take to apply a tick's messages


def real_wait(condition, what, limit_s=SUPERVISOR_REAL_S):
    """Waits in real time for a condition a real thread brings about, failing after limit_s."""
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {limit_s:g} s for {what}")
        time.sleep(0.001)


class Driver:
    """Moves the fake clock under a running supervisor, a tick at a time."""

    def __init__(self, rt, clock):
        self.rt, self.clock = rt, clock

    def _queued(self, marker):
        with self.rt._inbox.mutex:
            return any(m is marker for m in self.rt._inbox.queue)

    def settle(self):
        """Returns once the supervisor has applied every message posted so far and checked leases
        and hangs after it: it has taken the second of two markers posted now (the first was
        followed by a check, or by the recovery it found, which sets the phase `stopping` first)."""
        first, second = Wake(), Wake()
        self.rt.post(first)
        self.rt.post(second)
        real_wait(lambda: not self._queued(second) or not self.rt._worker.is_alive(), "the supervisor's inbox")

    def tick(self):
        self.clock.advance(TICK_S)
        self.settle()

    def run_for(self, seconds):
        """The supervisor's next `seconds`, tick by tick."""
        end = self.clock.monotonic() + seconds
        while self.clock.monotonic() < end - 1e-9:
            self.tick()

    def until(self, condition, within, what):
        """Ticks until condition() holds (its value), for at most `within` seconds of the clock."""
        end = self.clock.monotonic() + within
        self.settle()
        while True:
            found = condition()
            if found:
                return found
            if self.clock.monotonic() >= end:
                raise AssertionError(f"not within {within:g} s: {what()}")
            self.tick()

    def in_thread(self, fn, within, what):
        """fn() on a thread of its own (it waits for the supervisor), ticking until it returns."""
        done = threading.Event()
        threading.Thread(target=lambda: (fn(), done.set()), daemon=True).start()
        end = self.clock.monotonic() + within
        while not done.wait(0.001 if self.clock.monotonic() < end else SUPERVISOR_REAL_S):
            if self.clock.monotonic() >= end:
                raise AssertionError(f"not within {within:g} s: {what}")
            self.clock.advance(TICK_S)
            if self.rt._worker.is_alive():
                self.settle()


@pytest.fixture
def cluster():
    made = []

    def make(**keys):
        rank0 = RankZero()
        text = edited(SEED_TEXT, **{"HEAD_IP": "127.0.0.1", "PORT": str(rank0.port), "RANK_RUNTIME": "host",
                                    "NFS_SHARE": "0", "OFFLOAD_MODE": "host", "DSPARK_SPS_TABLE": "",
                                    "DSPARK_STS_TABLE": "", "RESTART_BACKOFF_S": "0.1", "RANK_MEMORY_GIB": "0.05",
                                    "MEMORY_RECOVERY_TIMEOUT_S": "1", **keys})
        cfg = config.parse(text, "cluster.env", HOME)
        journal = []
        clock = FakeClock()
        agents = {n.name: FakeAgent(n.name, journal, clock) for n in cfg.nodes}
        stream = io.StringIO()
        rt = ClusterRuntime(cfg, agents, EventLog("test", {}, stream=stream, use_journal=False), clock=clock.time,
                            monotonic=clock.monotonic)
        drive = Driver(rt, clock)
        made.append((rt, rank0, agents, drive))
        return rt, agents, rank0, journal, stream, drive
    yield make
    for rt, rank0, agents, drive in made:
        if rt._worker.is_alive():
            for agent in agents.values():
                agent.frozen = False
            drive.in_thread(lambda: rt.shutdown(stop_cluster=False), 120, "the supervisor to shut down")
        rank0.close()


def wait_phase(drive, *phases, within=10.0, detail=""):
    def reached():
        snap = drive.rt.snapshot()
        return snap if snap.phase in phases and detail in snap.detail else None
    return drive.until(reached, within, lambda: f"phase {drive.rt.snapshot().phase} ({drive.rt.snapshot().detail}), "
                       f"wanted {phases}")


def calls(journal, what):
    return [node for node, call in journal if call == what]


def test_a_stop_during_health_cancels_the_bring_up_and_stops_the_ranks_head_first(cluster):
    rt, agents, rank0, journal, _, drive = cluster()
    rt.run()
    wait_phase(drive, "health")
    rt.request("stop")
    snap = wait_phase(drive, "stopped", within=1.0)
    assert snap.detail == "requested by dsv41ctl stop"
    assert calls(journal, "stop_rank")[0] == "spark1" and sorted(calls(journal, "stop_rank")) == ["spark1", "spark2",
                                                                                                   "spark3"]
    assert not any(a.running for a in agents.values())
    drive.run_for(1.0)
    assert rt.snapshot().phase == "stopped" and sum(a.starts for a in agents.values()) == 3


def test_a_restart_then_a_stop_queued_during_a_bring_up_ends_stopped_without_a_second_bring_up(cluster):
    rt, agents, rank0, journal, _, drive = cluster()
    rt.run()
    wait_phase(drive, "health")
    rt.request("restart")
    rt.request("stop")
    wait_phase(drive, "stopped")
    drive.run_for(1.0)
    assert rt.snapshot().phase == "stopped"
    assert sum(a.starts for a in agents.values()) == 3  # the first bring-up's ranks only
    assert calls(journal, "check_fabric").count("spark1") == 1


def test_a_restart_during_a_bring_up_stops_and_brings_up_once_more(cluster):
    rt, agents, rank0, journal, _, drive = cluster()
    rt.run()
    wait_phase(drive, "health")
    rt.request("restart")
    drive.until(lambda: sum(a.starts for a in agents.values()) >= 6, 10,
                lambda: {n: a.starts for n, a in agents.items()})
    wait_phase(drive, "health")
    assert all(a.starts == 2 for a in agents.values())
    assert calls(journal, "stop_rank")[:1] == ["spark1"]
    rank0.healthy.set()
    wait_phase(drive, "serving")


def test_a_shutdown_during_health_returns_at_once_with_every_rank_stopped(cluster):
    rt, agents, rank0, journal, _, drive = cluster()
    rt.run()
    wait_phase(drive, "health")
    asked = drive.clock.monotonic()
    done = threading.Event()
    threading.Thread(target=lambda: (rt.shutdown(stop_cluster=True), done.set()), daemon=True).start()
    real_wait(done.is_set, "the shutdown")  # the clock standing still: it waits for nothing
    assert drive.clock.monotonic() == asked
    assert not any(a.running for a in agents.values())
    assert calls(journal, "stop_rank")[0] == "spark1"


def test_a_start_during_a_bring_up_is_that_bring_up(cluster):
    rt, agents, rank0, journal, _, drive = cluster()
    rt.run()
    wait_phase(drive, "health")
    rt.request("start")
    rank0.healthy.set()
    wait_phase(drive, "serving")
    drive.run_for(1.0)
    assert rt.snapshot().phase == "serving" and all(a.starts == 1 for a in agents.values())


def test_an_agent_lost_while_the_pack_job_runs_fails_the_pack_step_naming_it_and_the_restart_policy_goes_on(cluster):
    rt, agents, rank0, journal, stream, drive = cluster(OFFLOAD_MODE="nvme", SKIP_PREPARE="0", RESTART_BACKOFF_S="0.3")
    for agent in agents.values():
        agent.pack = pb.PackLayerState.ABSENT
    rt.run()
    wait_phase(drive, "pack")
    drive.until(lambda: "start_pack" in [c for _, c in journal], 5, lambda: journal)
    agents["spark2"].down = True  # the pack step polls every 2 s: the next poll finds it gone
    snap = wait_phase(drive, "restarting", within=10)
    assert snap.detail.startswith("attempt 1/3 in 0.3 s after: pack: spark2: agent at spark2:7441 refusing "
                                  "connections: dsv41-agent not running"), snap.detail
    incident = rt.incidents()[-1]
    assert (incident.kind, incident.node) == ("pack_failed", "spark2")
    assert "internal error" not in stream.getvalue()
    agents["spark2"].down = False
    for agent in agents.values():
        agent.pack, agent.pack_running = pb.PackLayerState.COMPLETE, False
    rank0.healthy.set()
    wait_phase(drive, "serving", within=15)


def test_packs_whose_rows_do_not_partition_the_table_fail_the_pack_step_before_launch(cluster):
    rt, agents, rank0, journal, _, drive = cluster(OFFLOAD_MODE="nvme")
    agents["spark2"].rows = (2, 6)  # overlaps spark1's [0, 3)
    rt.run()
    snap = wait_phase(drive, "failed")
    assert snap.detail == ("pack: spark2: layer 1: rows [2, 3) of 9 are in two shards: spark1 rank 0 [0, 3) and "
                           "spark2 rank 1 [2, 6); re-pack with `dsv41ctl pack --start`")
    assert calls(journal, "start_rank") == []


def test_an_agent_lost_while_the_share_polls_the_mounts_fails_the_share_step_naming_it(cluster):
    rt, agents, rank0, journal, _, drive = cluster(NFS_SHARE="1", SHARE_TIMEOUT_S="30")
    agents["spark3"].mount = pb.MountState.MOUNTING
    rt.run()
    wait_phase(drive, "share")
    drive.until(lambda: calls(journal, "get_mount").count("spark3") >= 2, 5, lambda: journal)
    agents["spark3"].down = True
    snap = wait_phase(drive, "restarting", "failed", within=10)
    assert "share: spark3: agent at spark3:7441 refusing connections: dsv41-agent not running" in snap.detail, \
        snap.detail
    assert (rt.incidents()[-1].kind, rt.incidents()[-1].node) == ("share_failed", "spark3")


def test_a_rank_that_exits_during_health_fails_the_step_naming_its_node(cluster):
    rt, agents, rank0, journal, _, drive = cluster(RESTART_BACKOFF_S="30")
    rt.run()
    wait_phase(drive, "health")
    agents["spark3"].exit_rank(result="exit-code", code="exited", status=1)
    snap = wait_phase(drive, "restarting", within=5)
    assert "health: spark3: during bring-up, rank on spark3 died first: rank unit failed: result exit-code" in \
        snap.detail, snap.detail
    assert rt.incidents()[-1].kind == "health_failed" and rt.incidents()[-1].node == "spark3"
    # the restart's backoff (30 s) gives way to an operator's start at once
    rank0.healthy.set()
    rt.request("start")
    wait_phase(drive, "serving", within=5)


def test_a_rank_exit_while_serving_is_blamed_and_recovered(cluster):
    rt, agents, rank0, journal, _, drive = cluster()
    rank0.healthy.set()
    rt.run()
    wait_phase(drive, "serving")
    now = drive.clock.time()
    agents["spark1"].exit_rank(result="exit-code", code="exited", status=1, at=now)
    agents["spark3"].exit_rank(result="signal", code="killed", status=9, at=now + 0.01)
    incident = wait_incident(drive, "rank_exit", within=5)
    assert incident.node == "spark3", incident.message  # ended from outside, within the blame window
    assert incident.message.endswith("then spark1 (result exit-code, exited status 1)")
    wait_restarted(drive, agents, within=10)
    # the broken group is not drained: rank 0 gets the workers' grace, not RANK_STOP_TIMEOUT_S
    assert agents["spark1"].stop_deadlines[-1] == 5 < rt.cfg.integer("RANK_STOP_TIMEOUT_S")


GLOO_CLOSED = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.1]:42374"


def blame_of_two_exits(cluster, first, then, output, unreadable=None):
    """Serving, `first`'s rank is SIGKILLed 30 ms before `then`'s, their ranks having logged `output`
    (node -> lines); `unreadable`: a node whose journal cannot be read meanwhile. The incident, and
    the runtime and agents, to see the cluster restart."""
    rt, agents, rank0, journal, _, drive = cluster()
    rank0.healthy.set()
    rt.run()
    wait_phase(drive, "serving")
    for node, lines in output.items():
        agents[node].output = lines
    if unreadable:
        def fail(lines, units, timeout=30):
            raise AgentUnavailable(unreadable, "ReadJournal", DOWN)
        agents[unreadable].recent_journal = fail
    now = drive.clock.time()
    agents[first].exit_rank(at=now)
    agents[then].exit_rank(at=now + 0.03)
    incident = wait_incident(drive, "rank_exit")
    if unreadable:
        del agents[unreadable].recent_journal  # the class's again
    return incident, drive, agents


def test_a_rank_whose_engine_said_a_peer_went_away_is_not_blamed_though_it_exited_first(cluster):
    # SGLang over gloo, rank 0's scheduler killed: a worker's launcher killed its tree on gloo's error
    # before rank 0's unit exited, both ended by SIGKILL
    incident, drive, agents = blame_of_two_exits(cluster, "spark3", "spark1", {"spark3": [
        "Scheduler hit an exception: Traceback (most recent call last):",
        GLOO_CLOSED + ". This is typically caused by a remote worker crashing."]})
    assert incident.node == "spark1", incident.message
    assert incident.message.endswith("then spark3 (result signal, killed status 9; its engine: Connection closed "
                                     "by peer [10.0.0.1]:42374)")
    wait_restarted(drive, agents, within=10)


def test_when_every_exit_so_far_lost_a_peer_the_cause_still_ending_is_waited_for_and_blamed(cluster):
    # SGLang over gloo, spark3's launcher killed -9: spark2's and spark1's ranks ended at once on
    # gloo's error, while spark3's unit was still stopping the scheduler its launcher left behind.
    rt, agents, rank0, journal, _, drive = cluster()
    rank0.healthy.set()
    rt.run()
    wait_phase(drive, "serving")
    agents["spark2"].output = [GLOO_CLOSED]
    agents["spark1"].output = ["RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error "
                               "[10.0.0.3]:39613: Connection reset by peer"]
    now = drive.clock.time()
    agents["spark2"].exit_rank(at=now)
    agents["spark1"].exit_rank(result="exit-code", code="exited", status=1, at=now + 0.03)
    drive.run_for(1.5)  # past SETTLE_S: both exits so far name a lost peer
    assert not [i for i in rt.incidents() if i.kind == "rank_exit"]
    agents["spark3"].exit_rank(at=now - 0.05)  # its unit's own record: the launcher's end
    incident = wait_incident(drive, "rank_exit")
    assert incident.node == "spark3", incident.message
    wait_restarted(drive, agents, within=10)


def test_an_earlier_runs_words_are_not_evidence(cluster):
    # spark3's rank said its collective lost a peer, a minute ago: in the run before this one
    incident, drive, agents = blame_of_two_exits(cluster, "spark3", "spark1", {"spark3": [(GLOO_CLOSED, 60.0)]})
    assert incident.node == "spark3" and "its engine" not in incident.message, incident.message
    wait_restarted(drive, agents, within=10)


def test_blame_is_decided_when_a_nodes_journal_cannot_be_read(cluster):
    incident, drive, agents = blame_of_two_exits(cluster, "spark1", "spark3", {"spark1": [GLOO_CLOSED]},
                                              unreadable="spark3")
    assert incident.node == "spark3", incident.message
    wait_restarted(drive, agents, within=10)


FLOOR = "available 0.700 GB below MEMORY_FLOOR_GB 0.800 GB: SIGTERM to every process of the rank"


def test_a_rank_its_node_floor_stopped_is_an_incident_naming_the_node_and_the_cluster_recovers(cluster):
    rt, agents, rank0, journal, _, drive = cluster()
    rank0.healthy.set()
    rt.run()
    wait_phase(drive, "serving")
    now = drive.clock.time()
    agents["spark1"].exit_rank(result="exit-code", code="exited", status=1, at=now)  # lost its peer
    # the floor's rank ended later than the peer it took down (a rank 0 drains, then the workers
    # go first): it is the cause all the same
    agents["spark2"].exit_rank(result="success", code="exited", status=0, at=now + 2.0, floor=FLOOR)
    incident = wait_incident(drive, "memory_floor")
    assert incident.node == "spark2" and FLOOR in incident.message, incident.message
    assert "stopped by the node's memory floor" in incident.message
    wait_restarted(drive, agents, within=10)
    assert rt.snapshot().restart_attempt == 1  # a restart like a crash's: it spends an attempt


def test_the_floor_is_the_cause_as_soon_as_it_signals_before_the_exits_it_causes(cluster):
    # rank 0 drains on the floor's SIGTERM and tells the workers to go: their exits come first
    rt, agents, rank0, journal, _, drive = cluster(RESTART_BACKOFF_S="30")
    rt.run()
    wait_phase(drive, "health")
    agents["spark1"].floor_stopping(FLOOR)
    now = drive.clock.time()
    agents["spark2"].exit_rank(result="success", code="exited", status=0, at=now)
    agents["spark3"].exit_rank(result="success", code="exited", status=0, at=now)
    agents["spark1"].exit_rank(result="success", code="exited", status=0, at=now + 0.4, floor=FLOOR)
    snap = wait_phase(drive, "restarting", within=5)
    incident = rt.incidents()[-1]
    assert incident.kind == "memory_floor" and incident.node == "spark1", incident
    assert "being stopped by the node's memory floor" in snap.detail and FLOOR in snap.detail
    rt.request("stop")
    wait_phase(drive, "stopped", within=5)


def test_a_floor_stop_during_the_model_load_fails_the_step_as_a_memory_floor_incident(cluster):
    rt, agents, rank0, journal, _, drive = cluster(RESTART_BACKOFF_S="30")
    rt.run()
    wait_phase(drive, "health")
    agents["spark1"].exit_rank(result="signal", code="killed", status=9, floor=FLOOR)
    snap = wait_phase(drive, "restarting", within=5)
    assert "health: spark1: during bring-up, rank on spark1 died first" in snap.detail and FLOOR in snap.detail
    assert rt.incidents()[-1].kind == "memory_floor" and rt.incidents()[-1].node == "spark1"
    rt.request("stop")
    wait_phase(drive, "stopped", within=5)


def test_the_rank_spec_carries_the_floor_and_it_is_not_part_of_the_fingerprint():
    from coordinator import plan as plan_mod
    from coordinator.agents import rank_spec_pb
    cfg = config.parse(edited(SEED_TEXT, MEMORY_FLOOR_GB="0.6", MEMORY_FLOOR_KILL_AFTER_S="2.5"), "cluster.env", HOME)
    node_plan = plan_mod.render_node(cfg, "spark2")
    spec = rank_spec_pb(node_plan, "gen")
    assert (spec.memory_floor_bytes, spec.memory_floor_kill_after_ms, spec.memory_floor_interval_ms) == (
        600_000_000, 2500, 20)
    other = plan_mod.render_node(config.parse(edited(SEED_TEXT, MEMORY_FLOOR_GB="0.7"), "cluster.env", HOME), "spark2")
    assert other.fingerprint == node_plan.fingerprint  # a new floor does not restart running ranks
    off = rank_spec_pb(plan_mod.render_node(config.parse(edited(SEED_TEXT, MEMORY_FLOOR_GB="0"), "cluster.env",
                                                          HOME), "spark2"), "gen")
    assert (off.memory_floor_bytes, off.memory_floor_kill_after_ms, off.memory_floor_interval_ms) == (0, 0, 0)


# ----- liveness

def wait_restarted(drive, agents, within=15.0):
    """Serving again after one restart of every rank: the incident is recorded before the restart
    begins, so the phase alone may still be the old serving."""
    rt = drive.rt
    drive.until(lambda: rt.snapshot().phase == "serving" and all(a.starts >= 2 for a in agents.values()), within,
                lambda: (rt.snapshot(), {n: a.starts for n, a in agents.items()}))
    assert all(a.starts == 2 for a in agents.values()), {n: a.starts for n, a in agents.items()}


def wait_incident(drive, kind, within=10.0):
    def found():
        of_kind = [i for i in drive.rt.incidents() if i.kind == kind]
        return of_kind[-1] if of_kind else None
    return drive.until(found, within, lambda: f"no {kind} incident: {drive.rt.incidents()}")


def every(clock, period_s, action):
    """action(now) every period_s of the clock, as it moves (a probe's observations)."""
    due = [clock.monotonic() + period_s]

    def tick(now):
        if now >= due[0]:
            due[0] = now + period_s
            action(now)
    clock.on_advance(tick)


LIVE = {"NODE_LEASE_S": "1", "HANG_TIMEOUT_S": "1", "RESTART_BACKOFF_S": "0.1"}


def test_a_frozen_worker_is_lost_naming_it_then_waited_for_and_the_cluster_serves_again_once_thawed(cluster):
    rt, agents, rank0, journal, _, drive = cluster(**LIVE)
    rank0.healthy.set()
    rt.run()
    wait_phase(drive, "serving")
    frozen_at = drive.clock.monotonic()
    agents["spark3"].frozen = True
    lost = wait_incident(drive, "node_lost")
    assert drive.clock.monotonic() - frozen_at <= 2 * 1.0  # within two leases
    assert lost.node == "spark3" and lost.message.startswith("spark3 lost: not heard from since ")
    snap = wait_phase(drive, "waiting", within=10)
    assert snap.detail.startswith("waiting for spark3: agent at spark3:7441 not answering for 1.0 s (frozen, "
                                  "powered off or cut off?)"), snap.detail  # preflight's call waits a lease
    assert not agents["spark1"].running and not agents["spark2"].running  # the others were stopped
    drive.run_for(3.0)  # the status calls of the waiting (2 s each) time out meanwhile
    assert rt.snapshot().phase == "waiting" and rt.snapshot().restart_attempt == 0  # a lost node spends none
    agents["spark3"].frozen = False
    wait_restarted(drive, agents)
    assert rt.snapshot().restart_attempt == 0


def test_a_node_that_booted_again_is_recorded_and_the_cluster_restarted(cluster):
    rt, agents, rank0, journal, _, drive = cluster(**LIVE)
    rank0.healthy.set()
    rt.run()
    wait_phase(drive, "serving")
    drive.until(lambda: rt.liveness_views()["spark2"][0] >= 0, 1.0, lambda: "a heartbeat from the first boot")
    agents["spark2"].boot = "spark2-boot2"
    agents["spark2"].running = ""  # a new boot runs no rank
    rebooted = wait_incident(drive, "node_rebooted")
    assert rebooted.node == "spark2" and "booted again" in rebooted.message
    wait_restarted(drive, agents)


def test_a_rank_that_stops_stepping_while_work_is_pending_is_hung_and_named(cluster):
    rt, agents, rank0, journal, _, drive = cluster(**LIVE)
    rank0.healthy.set()
    rt.run()
    wait_phase(drive, "serving")
    # spark2 stopped at step n; the others started step n + 1 and wait in it
    for agent in agents.values():
        agent.step()
    agents["spark1"].step()
    agents["spark3"].step()
    every(drive.clock, 0.1, lambda now: rt.post(WorkSeen(True, now)))  # the probe sees requests in flight
    hung = wait_incident(drive, "rank_hung", within=10)
    assert hung.node == "spark2" and "no forward step for" in hung.message and "at step 1" in hung.message
    wait_restarted(drive, agents)


def test_no_hang_while_idle_or_while_every_rank_steps(cluster):
    rt, agents, rank0, journal, _, drive = cluster(**LIVE)
    rank0.healthy.set()
    rt.run()
    wait_phase(drive, "serving")
    rt.post(WorkSeen(False, drive.clock.monotonic()))
    drive.run_for(2.5)  # idle: counters standing still mean nothing (HANG_TIMEOUT_S is 1 s)
    assert not rt.incidents() and rt.snapshot().phase == "serving"

    def busy_and_stepping(now):
        rt.post(WorkSeen(True, now))
        for agent in agents.values():
            agent.step()
    every(drive.clock, 0.1, busy_and_stepping)
    drive.run_for(2.5)
    assert not [i for i in rt.incidents() if i.kind == "rank_hung"]
    assert rt.snapshot().phase == "serving"


def test_ranks_that_exit_around_a_node_that_went_dark_blame_the_node(cluster):
    rt, agents, rank0, journal, _, drive = cluster(**LIVE)
    rank0.healthy.set()
    rt.run()
    wait_phase(drive, "serving")
    agents["spark3"].down = True  # powered off: its agent is gone with its rank
    now = drive.clock.time()
    agents["spark1"].exit_rank(result="exit-code", code="exited", status=1, at=now)
    agents["spark2"].exit_rank(result="exit-code", code="exited", status=1, at=now + 0.001)
    lost = wait_incident(drive, "node_lost", within=10)
    assert lost.node == "spark3"
    assert "then rank exits on spark1 (result exit-code, exited status 1), spark2" in lost.message
    assert not [i for i in rt.incidents() if i.kind == "rank_exit"]
    wait_phase(drive, "waiting", within=10)
    agents["spark3"].down = False
    wait_phase(drive, "serving", within=15)


def pause_events(stream):
    return [line for line in stream.getvalue().splitlines() if "DSV41_EVENT=coordinator_paused" in line]


def serving_with_work(cluster):
    """A serving cluster with requests in flight whose ranks step while `stepping` holds."""
    rt, agents, rank0, journal, stream, drive = cluster(**LIVE)
    rank0.healthy.set()
    rt.run()
    wait_phase(drive, "serving")
    stepping = [True]

    def busy(now):
        rt.post(WorkSeen(True, now))
        if stepping[0]:
            for agent in agents.values():
                agent.step()
    every(drive.clock, 0.1, busy)
    drive.run_for(0.5)
    return rt, agents, stream, drive, stepping


def pause_the_coordinator(drive, seconds):
    """The whole head frozen: the supervisor checks nothing while the clock moves `seconds` at
    once; what the agents sent meanwhile reaches it as it runs again."""
    drive.settle()
    drive.clock.advance(seconds)
    drive.settle()
    return drive.clock.monotonic()


def test_the_coordinator_paused_for_five_leases_keeps_every_node_that_answers_with_one_event(cluster):
    rt, agents, stream, drive, stepping = serving_with_work(cluster)
    stepping[0] = False  # rank 0 froze with the head: no rank steps
    pause_the_coordinator(drive, 5.0)
    drive.run_for(0.6)  # the ranks step again only after a while (under HANG_TIMEOUT_S, 1 s)
    stepping[0] = True
    drive.run_for(3.0)
    assert not rt.incidents(), rt.incidents()
    assert rt.snapshot().phase == "serving" and all(a.starts == 1 for a in agents.values())
    (event,) = pause_events(stream)
    assert "the coordinator did not run for 5.0 s" in event and "DSV41_PAUSED_S=5.0" in event
    assert "DSV41_ANSWERED=spark1,spark2,spark3" in event and "DSV41_SILENT= " in event


def test_a_node_silent_after_the_coordinators_pause_is_lost_a_lease_after_it(cluster):
    rt, agents, stream, drive, stepping = serving_with_work(cluster)
    agents["spark3"].frozen = True
    resumed_at = pause_the_coordinator(drive, 5.0)
    lost = wait_incident(drive, "node_lost", within=3.0)
    assert 1.0 < drive.clock.monotonic() - resumed_at <= 1.0 + 2 * TICK_S  # a lease after the pause
    assert lost.node == "spark3" and lost.message.startswith("spark3 lost: not heard from since ")
    (event,) = pause_events(stream)
    assert "DSV41_ANSWERED=spark1,spark2" in event and "DSV41_SILENT=spark3" in event
    assert not [i for i in rt.incidents() if i.kind != "node_lost"]


def test_a_node_that_booted_again_during_the_coordinators_pause_is_a_reboot_as_before(cluster):
    rt, agents, stream, drive, stepping = serving_with_work(cluster)
    agents["spark2"].boot, agents["spark2"].running = "spark2-boot2", ""
    pause_the_coordinator(drive, 5.0)
    rebooted = wait_incident(drive, "node_rebooted", within=3.0)
    assert rebooted.node == "spark2"
    wait_restarted(drive, agents)
    (event,) = drive.until(lambda: pause_events(stream), 1.0, lambda: "no coordinator_paused event")
    assert "DSV41_REBOOTED=spark2" in event and "DSV41_ANSWERED=spark1,spark3" in event


def test_a_gap_under_half_a_lease_is_no_pause(cluster):
    rt, agents, stream, drive, stepping = serving_with_work(cluster)
    pause_the_coordinator(drive, 0.4)
    drive.run_for(2.0)
    assert not pause_events(stream) and not rt.incidents()


def test_the_coordinator_says_starting_until_it_has_looked_for_ranks_to_adopt_not_stopped(cluster):
    # The control socket answers before the supervisor's first decision; "stopped" there was a lie
    # to a status read (and to a test waiting for a bring-up to end).
    rt, agents, rank0, journal, _, drive = cluster()
    assert rt.snapshot().phase == "starting"
    for agent in agents.values():
        agent.frozen = True  # the agents do not answer yet: the search for running ranks waits
    rt.run(autostart=False)
    drive.run_for(1.0)  # within the status calls' 10 s
    snap = rt.snapshot()
    assert (snap.phase, snap.detail) == ("starting", "looking for running ranks to adopt")
    ok, message = rt.unexport(force=False, unmount=False, wait_s=1)
    assert not ok and "starting (phase starting)" in message
    for agent in agents.values():
        agent.frozen = False
    snap = wait_phase(drive, "stopped", within=15)
    assert snap.detail == "nothing was running; waiting for dsv41ctl start"
    assert sum(a.starts for a in agents.values()) == 0


def test_a_floor_stop_made_while_no_coordinator_ran_is_an_incident_found_at_start(cluster):
    rt, agents, rank0, journal, stream, drive = cluster()
    at = 1796340201.0  # 2026-12-03 23:23:21 UTC
    agents["spark2"].last_exit = pb.ExitInfo(result="signal", code="killed", status=15, at_unix_s=at,
                                             cause=pb.ExitInfo.MEMORY_FLOOR, cause_detail="available 0.7 GB below "
                                             "MEMORY_FLOOR_GB 0.8 GB: SIGTERM")
    agents["spark3"].last_exit = pb.ExitInfo(result="success", code="exited", at_unix_s=at)  # an ordinary stop
    rt.run(autostart=False)
    wait_phase(drive, "stopped", within=15)
    (incident,) = rt.incidents()
    assert (incident.node, incident.kind) == ("spark2", "memory_floor")
    assert incident.message == ("found at start: the node's memory floor stopped its rank at 2026-12-03 23:23:21 UTC "
                                "(available 0.7 GB below MEMORY_FLOOR_GB 0.8 GB: SIGTERM)")
    assert rt.snapshot().last_incident == incident
    assert "DSV41_INCIDENT=memory_floor" in stream.getvalue()


def test_with_autostart_the_first_phase_after_starting_is_the_bring_up_not_stopped(cluster):
    rt, agents, rank0, journal, stream, drive = cluster()
    seen = [rt.snapshot().phase]
    publish = rt._set

    def every_phase(**changes):  # each phase the supervisor publishes, however briefly
        if changes.get("phase", seen[-1]) != seen[-1]:
            seen.append(changes["phase"])
        return publish(**changes)
    rt._set = every_phase
    rt.run()
    wait_phase(drive, "health")
    assert "stopped" not in seen and seen[0] in ("starting", "preflight"), seen


def test_a_stop_while_starting_stops_what_runs_and_starts_nothing(cluster):
    rt, agents, rank0, journal, _, drive = cluster()
    for agent in agents.values():
        agent.running, agent.frozen = f"{agent.node}-old", True  # ranks of an earlier coordinator
    rt.run()
    drive.run_for(1.0)  # within the status calls' 10 s
    assert rt.snapshot().phase == "starting"
    rt.request("stop")
    for agent in agents.values():
        agent.frozen = False
    snap = wait_phase(drive, "stopped", within=15)
    assert snap.detail == "requested by dsv41ctl stop"
    drive.run_for(1.0)
    assert rt.snapshot().phase == "stopped"
    assert not any(a.running for a in agents.values()) and sum(a.starts for a in agents.values()) == 0
    assert sorted(calls(journal, "stop_rank")) == ["spark1", "spark2", "spark3"]


# ---------------------------------------------------------------- a configuration change's restart


def rollout_of(keys=("NCCL_DEBUG",), confirm_s=300.0):
    from coordinator.runtime import Rollout
    asked = []
    return Rollout(keys, confirm_s, asked.append), asked


def test_a_configuration_change_stops_the_running_ranks_head_first_and_brings_them_up_once(cluster):
    rt, agents, rank0, journal, stream, drive = cluster()
    for agent in agents.values():
        agent.running = "old-run"
    rank0.healthy.set()
    rollout, asked = rollout_of()
    rt.run(restart_for=("NCCL_DEBUG",), rollout=rollout)
    wait_phase(drive, "serving", within=10)
    assert calls(journal, "stop_rank")[0] == "spark1" and sorted(calls(journal, "stop_rank")) == ["spark1", "spark2",
                                                                                                   "spark3"]
    assert all(a.starts == 1 for a in agents.values()) and asked == []
    assert "DSV41_EVENT=config_restart" in stream.getvalue() and "DSV41_KEYS=NCCL_DEBUG" in stream.getvalue()


def test_a_failed_bring_up_under_a_rollout_is_rolled_back_at_once_without_a_retry(cluster):
    rt, agents, rank0, journal, _, drive = cluster(RESTART_MAX_ATTEMPTS="5")
    rollout, asked = rollout_of()
    rt.run(restart_for=("NCCL_DEBUG",), rollout=rollout)
    wait_phase(drive, "health")
    agents["spark2"].exit_rank(result="exit-code", code="exited", status=2)
    incident = wait_incident(drive, "rolled_back")
    assert incident.message.startswith("the configuration change of NCCL_DEBUG failed: the bring-up failed at "
                                       "health: "), incident.message
    assert len(asked) == 1 and "health" in asked[0]
    assert rt.snapshot().phase == "failed"
    drive.run_for(2.0)  # no retry of the change: the coordinator brings the previous configuration back
    assert all(a.starts == 1 for a in agents.values())


def test_a_rank_exit_soon_after_serving_rolls_back_and_one_after_the_confirmation_is_recovered(cluster):
    rt, agents, rank0, journal, stream, drive = cluster()
    rank0.healthy.set()
    rollout, asked = rollout_of(confirm_s=30.0)
    rt.run(restart_for=("NCCL_DEBUG",), rollout=rollout)
    wait_phase(drive, "serving")
    drive.run_for(1.0)
    agents["spark3"].exit_rank(result="exit-code", code="exited", status=1)
    incident = wait_incident(drive, "rolled_back")
    assert "rank on spark3 exited" in incident.message and len(asked) == 1
    # how long it had served: about the second run_for gave it, not the clock's whole reading
    assert re.search(r", [12] s after serving", asked[0]), asked[0]
    # A second run of the same: confirmed after 30 s of serving, a later exit is an ordinary recovery.
    rt2, agents2, rank02, _, stream2, drive2 = cluster()
    rank02.healthy.set()
    rollout2, asked2 = rollout_of(confirm_s=30.0)
    rt2.run(restart_for=("NCCL_DEBUG",), rollout=rollout2)
    wait_phase(drive2, "serving")
    drive2.until(lambda: "DSV41_EVENT=config_confirmed" in stream2.getvalue(), 40, lambda: "not confirmed")
    agents2["spark3"].exit_rank(result="exit-code", code="exited", status=1)
    wait_restarted(drive2, agents2, within=15)
    assert asked2 == [] and not [i for i in rt2.incidents() if i.kind == "rolled_back"]


def test_a_slow_pair_fails_the_collective_gate_before_launch_naming_it_and_fabric_test_measures_again(cluster):
    rt, agents, rank0, journal, stream, drive = cluster()
    for agent in agents.values():
        agent.slow_groups = {"spark1–spark3": 0.71, "spark2–spark3": 1.2, "all": 0.9}
    rt.run()
    snap = wait_phase(drive, "failed")
    assert snap.detail == "collective: spark1–spark3: 0.71 GB/s, floor 3.5 GB/s (COLLECTIVE_PAIR_MIN_GBPS)"
    assert sum(a.starts for a in agents.values()) == 0  # no rank was launched
    assert rt.snapshot().last_incident.kind == "collective_failed"
    assert not snap.collective.ok and snap.collective.figures[1].busbw_gbps == 0.71
    for agent in agents.values():
        agent.slow_groups = {}
    answers = []
    drive.in_thread(lambda: answers.append(rt.fabric_test()), 10, "the fabric test")
    (passed, message), = answers
    assert passed and message.startswith("passed: spark1–spark2 4.60 GB/s"), message
    assert rt.snapshot().collective.ok and rt.snapshot().phase == "failed"  # a test starts nothing


def test_the_fabric_test_is_refused_while_ranks_run(cluster):
    rt, agents, rank0, journal, stream, drive = cluster()
    rt.run()
    rank0.healthy.set()
    wait_phase(drive, "serving")
    answers = []
    drive.in_thread(lambda: answers.append(rt.fabric_test()), 10, "the fabric test")
    (passed, message), = answers
    assert not passed and message.startswith("refused in phase serving"), message


def test_with_the_gate_off_every_bring_up_warns_and_runs_no_job(cluster):
    rt, agents, rank0, journal, stream, drive = cluster(COLLECTIVE_GATE="0")
    rt.run()
    wait_phase(drive, "health")
    assert calls(journal, "run_collective_test") == []
    assert "collective_gate_off" in stream.getvalue()


# ----- the drain before a restart that can wait

def serving_with_requests(cluster, *rids, **keys):
    rt, agents, rank0, journal, stream, drive = cluster(**keys)
    rank0.healthy.set()
    rank0.inflight = list(rids)
    rt.run()
    wait_phase(drive, "serving")
    return rt, agents, rank0, journal, stream, drive


def test_a_drained_restart_waits_for_the_requests_in_flight_then_restarts_with_rank_0_drained_as_usual(cluster):
    rt, agents, rank0, journal, stream, drive = serving_with_requests(cluster, "chat-1", "chat-2")
    rt.request("restart", drain=True)
    snap = wait_phase(drive, "draining", within=2)
    assert rank0.drains == [{"reason": "dsv41ctl restart --drain"}]
    drive.run_for(5.0)
    snap = rt.snapshot()
    assert snap.phase == "draining" and "2 requests in flight" in snap.detail, snap.detail
    assert calls(journal, "stop_rank") == []  # nothing stopped while they run
    rank0.inflight = ["chat-2"]
    drive.run_for(2.0)
    rank0.inflight = []
    wait_restarted(drive, agents, within=10)
    log = stream.getvalue()
    assert "DSV41_EVENT=drain_started" in log and "DSV41_IN_FLIGHT=2" in log
    assert "DSV41_EVENT=drain_done" in log and "DSV41_FINISHED=2" in log
    assert agents["spark1"].stop_deadlines == [rt.cfg.integer("RANK_STOP_TIMEOUT_S")]


def test_a_drain_that_runs_out_cuts_what_is_left_naming_it_and_stops_rank_0_without_its_own_drain(cluster):
    rt, agents, rank0, journal, stream, drive = serving_with_requests(cluster, "chat-long", DRAIN_TIMEOUT_S="3")
    rt.request("restart", drain=True)
    wait_phase(drive, "draining", within=2)
    wait_restarted(drive, agents, within=10)
    log = stream.getvalue()
    assert "DSV41_EVENT=drain_timeout" in log and "DSV41_RIDS=chat-long" in log
    assert agents["spark1"].stop_deadlines == [5]  # the workers' grace, not RANK_STOP_TIMEOUT_S again


def test_a_stop_during_the_drain_preempts_it_and_nothing_is_restarted(cluster):
    rt, agents, rank0, journal, stream, drive = serving_with_requests(cluster, "chat-1")
    rt.request("restart", drain=True)
    wait_phase(drive, "draining", within=2)
    rt.request("stop")
    wait_phase(drive, "stopped", within=1.0)
    drive.run_for(1.0)
    assert all(a.starts == 1 and not a.running for a in agents.values())


def test_a_rank_exit_during_the_drain_turns_it_into_the_urgent_recovery(cluster):
    rt, agents, rank0, journal, stream, drive = serving_with_requests(cluster, "chat-1")
    rt.request("restart", drain=True)
    wait_phase(drive, "draining", within=2)
    agents["spark2"].exit_rank(result="exit-code", code="exited", status=1)
    incident = wait_incident(drive, "rank_exit", within=5)
    assert incident.node == "spark2"
    wait_restarted(drive, agents, within=10)
    assert "DSV41_EVENT=drain_interrupted" in stream.getvalue()
    assert agents["spark1"].stop_deadlines == [5]  # the broken group is not drained


def test_a_rank_0_without_the_drain_route_is_restarted_without_one(cluster):
    rt, agents, rank0, journal, stream, drive = serving_with_requests(cluster, "chat-1")
    rank0.drain_route = False
    rt.request("restart", drain=True)
    wait_restarted(drive, agents, within=10)
    assert "DSV41_EVENT=drain_unavailable" in stream.getvalue() and "HTTP 404" in stream.getvalue()
    assert "DSV41_EVENT=drain_started" not in stream.getvalue()


def test_a_plain_restart_and_a_zero_drain_timeout_do_not_drain(cluster):
    rt, agents, rank0, journal, stream, drive = serving_with_requests(cluster, "chat-1")
    rt.request("restart")
    wait_restarted(drive, agents, within=10)
    assert rank0.drains == [] and "drain_" not in stream.getvalue()
    rt, agents, rank0, journal, stream, drive = serving_with_requests(cluster, "chat-1", DRAIN_TIMEOUT_S="0")
    rt.request("restart", drain=True)
    wait_restarted(drive, agents, within=10)
    assert rank0.drains == [] and "DSV41_EVENT=drain_skipped" in stream.getvalue()


def test_a_configuration_change_drains_the_running_ranks_before_it_restarts_them(cluster):
    rt, agents, rank0, journal, stream, drive = cluster()
    for agent in agents.values():
        agent.running = "old-run"
    rank0.healthy.set()
    rank0.inflight = ["chat-1"]
    rollout, asked = rollout_of()
    rt.run(restart_for=("NCCL_DEBUG",), rollout=rollout)
    wait_phase(drive, "draining", within=2)
    # The phase is published just before rank 0 is asked: wait for the ask itself.
    drive.until(lambda: rank0.drains, 2, "rank 0 was never asked to drain")
    assert rank0.drains == [{"reason": "configuration change: NCCL_DEBUG"}]
    drive.run_for(2.0)
    assert calls(journal, "stop_rank") == []
    rank0.inflight = []
    wait_phase(drive, "serving", within=10)
    assert "DSV41_EVENT=drain_done" in stream.getvalue() and asked == []


def test_a_coordinator_stopping_during_a_drain_and_leaving_the_ranks_lifts_the_drain(cluster):
    rt, agents, rank0, journal, stream, drive = serving_with_requests(cluster, "chat-1")
    rt.request("restart", drain=True)
    wait_phase(drive, "draining", within=2)
    drive.in_thread(lambda: rt.shutdown(stop_cluster=False), 10, "the supervisor to shut down")
    assert rank0.lifted == 1 and all(a.running for a in agents.values())
    assert "DSV41_EVENT=drain_lifted" in stream.getvalue()
