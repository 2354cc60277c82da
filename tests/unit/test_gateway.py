"""The coordinator's gateway manager: the reconcile decision, the router's flags, and the manager's
loop over a fake gateway API, a fake head agent and a fake clock."""

import http.server
import io
import json
import threading

import grpc
import pytest

from coordinator import config
from coordinator.agents import AgentUnavailable
from coordinator.gateway import (SHUTDOWN_GRACE_S, UNIT_STOP_TIMEOUT_S, Gateway, GatewayActions, gateway_args,
                                 reconcile)
from coordinator.gatewayapi import GatewayApi, GatewayError, GatewayWorker
from dsv41.journal import EventLog
from dsv41.v1 import agent_pb2 as pb
from tests.configtext import HOME, edited, nodes_text
from tests.fakeclock import FakeClock
from tests.rpcfailure import RpcFailure

pytestmark = pytest.mark.unit

G1, G2 = "http://10.0.0.1:8888", "http://10.0.0.4:8888"


def grouped_cfg(**changes):
    text = edited(nodes_text(6), TP_SIZE="6", GROUPS='"spark1,spark2,spark3 spark4,spark5,spark6"', **changes)
    return config.parse(text, "cluster.env", HOME)


def w(id_, url, healthy=True):
    return GatewayWorker(id_, url, healthy)


# ---------------------------------------------------------------- reconcile

def test_reconcile_adds_the_wanted_groups_not_listed():
    actions = reconcile({"g1": G1, "g2": G2}, [w("a", G1)])
    assert actions == GatewayActions(add=(("g2", G2),), remove=())


def test_reconcile_removes_workers_no_wanted_group_has():
    stale = w("b", "http://10.0.0.9:8888")
    actions = reconcile({"g1": G1}, [w("a", G1), stale, w("c", G2)])
    assert actions.add == ()
    assert actions.remove == (w("c", G2), stale)  # by URL


def test_reconcile_keeps_one_of_duplicates_a_healthy_one():
    actions = reconcile({"g1": G1}, [w("sick", G1, healthy=False), w("well", G1), w("again", G1)])
    assert actions.add == ()
    assert {x.id for x in actions.remove} == {"sick", "again"}


def test_reconcile_with_nothing_to_do_and_with_nothing_wanted():
    assert reconcile({"g1": G1, "g2": G2}, [w("a", G1 + "/"), w("b", G2)]) == GatewayActions((), ())
    assert reconcile({}, []) == GatewayActions((), ())
    assert reconcile({}, [w("a", G1)]).remove == (w("a", G1),)


# ---------------------------------------------------------------- gateway_args

def flag(args, name):
    assert args.count(name) == 1, f"{name} in {args}"
    return args[args.index(name) + 1]


def test_gateway_args_carry_each_flag():
    args = gateway_args(grouped_cfg())
    expected = {"--host": "0.0.0.0", "--port": "30000", "--policy": "round_robin", "--prometheus-host": "127.0.0.1",
                "--prometheus-port": "29000", "--health-check-interval-secs": "5", "--health-failure-threshold": "2",
                "--health-success-threshold": "1", "--health-check-endpoint": "/health", "--retry-max-retries": "5",
                "--shutdown-grace-period-secs": str(SHUTDOWN_GRACE_S), "--request-timeout-secs": "1800",
                "--log-level": "info"}
    assert {name: flag(args, name) for name in expected} == expected
    assert len(args) == 2 * len(expected)
    assert UNIT_STOP_TIMEOUT_S == SHUTDOWN_GRACE_S + 15


def test_gateway_args_take_the_ports_from_the_config_and_never_a_key_or_worker():
    cfg = grouped_cfg(GATEWAY_PORT="31000", GATEWAY_METRICS_LISTEN="10.0.0.1:31090", API_KEY_FILE="/etc/dsv41/key")
    args = gateway_args(cfg)
    assert (flag(args, "--port"), flag(args, "--prometheus-host"), flag(args, "--prometheus-port")) == \
        ("31000", "10.0.0.1", "31090")
    assert not [a for a in args if "key" in a or a == "--worker-urls" or a.startswith("http")]


# ---------------------------------------------------------------- the manager over fakes

class FakeApi:
    """A gateway that registers an add at the next listing (as 0.3.2's background job does) and
    removes at the next listing; `down` makes every call fail as a refused connection does."""

    def __init__(self):
        self.workers_by_id: dict[str, GatewayWorker] = {}
        self.queued_adds: list[GatewayWorker] = []
        self.queued_removes: list[str] = []
        self.calls: list[tuple] = []
        self.down = False
        self.serial = 0

    def _check(self):
        if self.down:
            raise GatewayError("list workers (GET /workers)", None, "[Errno 111] Connection refused")

    def workers(self):
        self._check()
        for worker in self.queued_adds:
            if worker.url not in {x.url for x in self.workers_by_id.values()}:
                self.workers_by_id[worker.id] = worker
        for worker_id in self.queued_removes:
            self.workers_by_id.pop(worker_id, None)
        self.queued_adds, self.queued_removes = [], []
        return list(self.workers_by_id.values())

    def add(self, url, api_key):
        self._check()
        self.calls.append(("add", url, api_key))
        self.serial += 1
        self.queued_adds.append(GatewayWorker(f"id{self.serial}", url, True))
        return f"id{self.serial}"

    def remove(self, worker_id):
        self._check()
        self.calls.append(("remove", worker_id))
        self.queued_removes.append(worker_id)

    def adds(self):
        return [c[1] for c in self.calls if c[0] == "add"]


class FakeHead:
    def __init__(self):
        self.specs: list[pb.GatewaySpec] = []
        self.timeouts: list[float] = []
        self.failures = 0

    def set_gateway(self, spec, timeout=30.0):
        self.specs.append(spec)
        self.timeouts.append(timeout)
        if self.failures:
            self.failures -= 1
            raise AgentUnavailable("spark1", "SetGateway", RpcFailure(grpc.StatusCode.UNAVAILABLE,
                                                                       "failed to connect to all addresses"))
        return pb.GatewayState(active_state="active" if spec.run else "inactive", main_pid=4242 if spec.run else 0)


class Rig:
    def __init__(self, **cfg_changes):
        self.cfg = grouped_cfg(**cfg_changes)
        self.api, self.head, self.clock = FakeApi(), FakeHead(), FakeClock()
        self.routable = {"g1": G1, "g2": G2}
        self.health = {G1: 200, G2: 200}
        self.events: list[tuple[str, str, dict]] = []
        log = EventLog("test", {}, stream=io.StringIO(), use_journal=False)
        log.subscribe(lambda kind, priority, fields: self.events.append((kind, priority, fields)))
        self.gateway = Gateway(self.cfg, self.head, lambda: pb.RankSpec(runtime="host", rank=0), "sekrit", log,
                               lambda: dict(self.routable), api=self.api, monotonic=self.clock.monotonic,
                               sleep=self.clock.advance, healthy=lambda url: self.health.get(url) == 200)

    def kinds(self, kind):
        return [fields for k, _, fields in self.events if k == kind]

    def listed_urls(self):
        return sorted(x.url for x in self.api.workers_by_id.values())


def test_the_unit_is_asked_to_run_with_the_head_rank_runtime_and_the_flags():
    rig = Rig(GATEWAY_PYTHON="/opt/router/bin/python")
    assert rig.gateway.ensure_unit()
    spec = rig.head.specs[-1]
    assert spec.run and spec.rank.runtime == "host" and spec.python == "/opt/router/bin/python"
    assert list(spec.args) == gateway_args(rig.cfg) and spec.stop_timeout_s == SHUTDOWN_GRACE_S + 15
    assert rig.gateway.view().unit_state == "active"


def test_an_unreachable_head_agent_is_warned_once_and_the_unit_retried():
    rig = Rig()
    rig.head.failures = 3
    assert [rig.gateway.ensure_unit() for _ in range(3)] == [False, False, False]
    assert len(rig.kinds("gateway_unit_unreachable")) == 1
    assert "could not start the gateway's unit" in rig.gateway.view().error
    assert rig.gateway.ensure_unit()
    assert rig.gateway.view().error == "" and rig.gateway.view().unit_state == "active"


def test_a_group_is_added_only_once_its_health_answers_200_and_logged_once_confirmed():
    rig = Rig()
    rig.health[G2] = 503
    rig.gateway.poll()
    assert rig.api.adds() == [G1]
    assert rig.api.calls[0][2] == "sekrit"  # the gateway sends the cluster's key to rank 0
    assert rig.kinds("gateway_worker_added") == []  # queued, not yet listed
    rig.gateway.poll()
    assert [f["DSV41_GROUP"] for f in rig.kinds("gateway_worker_added")] == ["g1"]
    assert rig.api.adds() == [G1]  # no add again for G2 while its health is 503
    rig.health[G2] = 200
    rig.gateway.poll()
    rig.gateway.poll()
    rig.gateway.poll()
    assert rig.listed_urls() == [G1, G2]
    assert [f["DSV41_GROUP"] for f in rig.kinds("gateway_worker_added")] == ["g1", "g2"]
    assert rig.api.adds() == [G1, G2]
    view = rig.gateway.view()
    assert view.ready and sorted(view.workers) == [("g1", G1, True), ("g2", G2, True)]


def test_a_queued_add_is_not_repeated_each_poll_but_asked_again_when_it_never_shows():
    rig = Rig()
    rig.routable = {"g1": G1}
    rig.api.workers = lambda: []  # the add's job keeps failing
    for _ in range(5):
        rig.gateway.poll()
        rig.clock.advance(0.5)
    assert rig.api.adds() == [G1]
    rig.clock.advance(10)
    rig.gateway.poll()
    assert rig.api.adds() == [G1, G1]


def test_a_group_that_stops_serving_is_removed_once_with_why():
    rig = Rig()
    for _ in range(2):
        rig.gateway.poll()
    del rig.routable["g2"]
    rig.api.queued_removes = []
    rig.gateway.poll()
    rig.gateway.poll()
    assert rig.listed_urls() == [G1]
    removed = rig.kinds("gateway_worker_removed")
    assert len(removed) == 1 and removed[0]["DSV41_GROUP"] == "g2" and "not serving" in removed[0]["DSV41_WHY"]


def test_remove_now_holds_the_group_out_until_release():
    rig = Rig()
    for _ in range(2):
        rig.gateway.poll()
    assert rig.gateway.remove_now("g2") is True
    assert rig.listed_urls() == [G1]
    for _ in range(3):  # still serving, still held out
        rig.gateway.poll()
    assert rig.listed_urls() == [G1]
    assert rig.api.adds() == [G1, G2]
    rig.gateway.release("g2")
    rig.gateway.poll()
    rig.gateway.poll()
    assert rig.listed_urls() == [G1, G2]
    assert rig.api.adds() == [G1, G2, G2]


def test_remove_now_repeats_the_delete_while_a_late_add_reappears():
    rig = Rig()
    for _ in range(2):
        rig.gateway.poll()
    real_workers = rig.api.workers
    late = {"left": 2}

    def workers():  # the delete is lost twice: a pending add completes after it
        listed = real_workers()
        if late["left"] and not any(x.url == G2 for x in listed):
            late["left"] -= 1
            rig.api.workers_by_id[f"late{late['left']}"] = GatewayWorker(f"late{late['left']}", G2, True)
            listed = real_workers()
        return listed
    rig.api.workers = workers
    assert rig.gateway.remove_now("g2", timeout_s=5.0) is True
    assert [c for c in rig.api.calls if c[0] == "remove"] == [("remove", "id2"), ("remove", "late1"),
                                                             ("remove", "late0")]
    assert G2 not in rig.listed_urls()


def test_remove_now_waits_for_a_just_queued_add_to_show_and_removes_it():
    rig = Rig()
    rig.gateway.poll()  # both adds queued, not yet listed
    assert rig.gateway.remove_now("g2", timeout_s=5.0) is True
    assert ("remove", "id2") in rig.api.calls and G2 not in rig.listed_urls()


def test_remove_now_waits_for_an_add_whose_job_ends_late_and_removes_it():
    rig = Rig()
    real_workers = rig.api.workers
    queued_at = rig.clock.monotonic()

    def workers():  # the add's job takes 1 s: until then the listing does not show it
        if rig.clock.monotonic() - queued_at < 1.0:
            return [x for x in rig.api.workers_by_id.values()]
        return real_workers()
    rig.api.workers = workers
    rig.gateway.poll()
    assert rig.gateway.remove_now("g2", timeout_s=5.0) is True
    assert 1.0 <= rig.clock.monotonic() - queued_at < 2.0  # done once it showed, not after ADD_SETTLE_S
    assert ("remove", "id2") in rig.api.calls and G2 not in rig.listed_urls()


def test_remove_now_says_false_when_the_gateway_does_not_answer():
    rig = Rig()
    rig.gateway.poll()
    rig.api.down = True
    start = rig.clock.monotonic()
    assert rig.gateway.remove_now("g1", timeout_s=2.0) is False
    assert rig.clock.monotonic() - start == pytest.approx(2.0, abs=0.2)
    assert rig.kinds("gateway_remove_unconfirmed")[0]["DSV41_GROUP"] == "g1"


def test_an_unreachable_gateway_is_warned_once_per_episode():
    rig = Rig()
    assert rig.gateway.ensure_unit()
    rig.api.down = True
    rig.gateway.poll()  # the router is starting: no warning yet
    assert rig.kinds("gateway_unreachable") == []
    rig.clock.advance(20)
    for _ in range(5):
        rig.gateway.poll()
    assert len(rig.kinds("gateway_unreachable")) == 1
    view = rig.gateway.view()
    assert not view.ready and "Connection refused" in view.error
    rig.api.down = False
    rig.gateway.poll()
    rig.gateway.poll()
    assert len(rig.kinds("gateway_reachable")) == 1 and rig.gateway.view().error == ""
    rig.api.down = True
    rig.gateway.poll()
    assert len(rig.kinds("gateway_unreachable")) == 2


def test_stop_with_the_unit_asks_it_not_to_run():
    rig = Rig()
    rig.gateway.stop(stop_unit=False)
    assert rig.head.specs == []
    rig.gateway.stop(stop_unit=True)
    assert [s.run for s in rig.head.specs] == [False]
    assert rig.gateway.view().unit_state == "inactive"


def test_the_thread_ensures_the_unit_then_polls_until_stopped():
    rig = Rig()
    polled = threading.Event()
    rig.api.workers_real = rig.api.workers

    def workers():
        polled.set()
        return rig.api.workers_real()
    rig.api.workers = workers
    rig.gateway._poll_s = 0.01
    rig.gateway.start()
    assert polled.wait(5.0)
    rig.gateway.stop(stop_unit=False)
    assert [s.run for s in rig.head.specs] == [True]


# ---------------------------------------------------------------- GatewayApi over a local HTTP server

class Answers(http.server.BaseHTTPRequestHandler):
    routes: dict = {}
    seen: list = []

    def _answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.seen.append((self.command, self.path, self.headers.get("Authorization"), body))
        status, reply = self.routes.get((self.command, self.path), (404, ""))
        data = reply.encode() if isinstance(reply, str) else json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_DELETE = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    Answers.routes, Answers.seen = {}, []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_the_api_speaks_0_3_2s_worker_routes_with_the_key(server):
    Answers.routes = {
        ("GET", "/readiness"): (503, {"status": "not ready", "reason": "insufficient healthy workers"}),
        ("GET", "/workers"): (200, {"workers": [{"id": "u1", "url": G1, "is_healthy": False}], "total": 1}),
        ("POST", "/workers"): (202, {"status": "accepted", "worker_id": "u2"}),
        ("DELETE", "/workers/u1"): (202, {"status": "accepted"}),
    }
    api = GatewayApi(server + "/", "sekrit")
    assert api.readiness() == (False, 0, 0)
    assert api.workers() == [GatewayWorker("u1", G1, False)]
    assert api.add(G2, "sekrit") == "u2" and api.add(G2, None) == "u2"
    api.remove("u1")
    api.remove("gone")  # 404: already removed
    posts = [s for s in Answers.seen if s[0] == "POST"]
    assert [p[3] for p in posts] == [{"url": G2, "api_key": "sekrit"}, {"url": G2}]
    assert {s[2] for s in Answers.seen} == {"Bearer sekrit"}
    assert GatewayApi(server).workers() and Answers.seen[-1][2] is None  # no key: no header


def test_the_api_says_what_was_asked_and_what_came_back(server):
    Answers.routes = {("GET", "/workers"): (401, ""), ("POST", "/workers"): (500, "boom " * 100)}
    api = GatewayApi(server, "wrong")
    with pytest.raises(GatewayError) as refused:
        api.workers()
    assert refused.value.status == 401 and "list workers (GET http://127.0.0.1:" in str(refused.value)
    assert "API key" in str(refused.value)
    with pytest.raises(GatewayError) as failed:
        api.add(G1, None)
    assert f"add worker {G1}" in str(failed.value) and "answered 500" in str(failed.value)
    assert len(failed.value.detail) <= 200
    with pytest.raises(GatewayError) as down:
        GatewayApi("http://127.0.0.1:9", timeout_s=1.0).workers()
    assert down.value.unreachable and "no answer" in str(down.value)
