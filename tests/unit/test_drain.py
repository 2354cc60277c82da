"""The drain before a restart that can wait: the contract rank 0 serves (dsv41/drain.py), the
rank's refusal as an ASGI middleware (adapter/drain.py), and the coordinator's loop
(coordinator/drain.py) on a fake clock."""

from __future__ import annotations

import asyncio
import io
import json

import pytest

from adapter.drain import DrainGate
from coordinator.bringup import Preempted
from coordinator.drain import Drainer, Outcome, lift_stale, verdict
from coordinator.guard.engine import EngineError
from coordinator.policy import Action, Request
from dsv41 import drain as contract
from dsv41.inflight import InflightList, InflightRequest
from dsv41.journal import EventLog
from tests.fakeclock import FakeClock

pytestmark = pytest.mark.unit


# ----- the contract

def test_a_drain_refuses_only_new_generation_requests():
    on = contract.DrainState("fabric drift on spark2", 10.0)
    for path in ("/v1/chat/completions", "/v1/completions", "/generate", "/v1/responses", "/v1/messages",
                 "/v1/chat/completions/"):
        assert contract.refuses(on, "POST", path), path
    for method, path in (("GET", "/health"), ("GET", "/health_generate"), ("POST", "/abort_request"),
                         ("GET", "/metrics"), ("GET", "/dsv41/inflight"), ("POST", "/dsv41/drain"),
                         ("GET", "/v1/models"), ("POST", "/v1/messages/count_tokens"), ("GET", "/v1/chat/completions")):
        assert not contract.refuses(on, method, path), (method, path)
    assert not contract.refuses(contract.DrainState(), "POST", "/v1/chat/completions")


def test_the_refusal_is_a_503_naming_the_reason_with_retry_after():
    status, headers, body = contract.refusal("dsv41ctl restart --drain")
    assert status == 503 and headers == {"Retry-After": str(contract.RETRY_AFTER_S)}
    assert body["error"]["code"] == 503 and body["error"]["type"] == "service_unavailable"
    assert "draining for a restart: dsv41ctl restart --drain; retry after it" in body["error"]["message"]


def test_post_starts_the_drain_delete_lifts_it_and_a_bad_reason_is_refused_saying_what_is_allowed():
    state = contract.DrainState()
    status, state, out = contract.answer(state, "POST", {"reason": "  planned\n restart "}, now=5.0)
    assert status == 200 and out == {"draining": True, "reason": "planned restart", "since_s": 0.0}
    status, again, out = contract.answer(state, "POST", {"reason": "newer"}, now=8.0)
    assert again.since == 5.0 and out["since_s"] == 3.0 and out["reason"] == "newer"  # the same drain
    assert contract.answer(again, "GET", None, now=9.0)[2] == {"draining": True, "reason": "newer", "since_s": 4.0}
    status, lifted, out = contract.answer(again, "DELETE", None, now=9.0)
    assert status == 200 and not lifted.draining and out == {"draining": False}
    for bad in (None, {}, {"reason": ""}, {"reason": 3}, ["x"]):
        status, kept, out = contract.answer(state, "POST", bad, now=9.0)
        assert status == 400 and kept is state and "non-empty reason" in out["error"]["message"]
    status, _, out = contract.answer(state, "POST", {"reason": "x" * 600}, now=9.0)
    assert status == 400 and "at most 500" in out["error"]["message"]


# ----- the rank's refusal (ASGI, as SGLang's FastAPI app calls it)

def asgi(app, method, path):
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app({"type": "http", "method": method, "path": path}, receive, send))
    return sent


def test_the_rank_middleware_answers_refused_requests_itself_and_passes_the_rest_on():
    said = []
    gate = DrainGate(clock=lambda: 1.0, say=said.append)
    passed = []

    async def inner(scope, receive, send):
        passed.append(scope["path"])

    app = gate.middleware()(inner)
    asgi(app, "POST", "/v1/chat/completions")
    assert passed == ["/v1/chat/completions"]
    assert gate.handle("POST", {"reason": "dsv41ctl restart --drain"})[0] == 200
    assert said == ["dsv41-adapter: drain: refusing new requests: dsv41ctl restart --drain"]
    sent = asgi(app, "POST", "/v1/chat/completions")
    assert passed == ["/v1/chat/completions"]  # not passed on
    start, body = sent
    assert start["status"] == 503 and (b"retry-after", str(contract.RETRY_AFTER_S).encode()) in start["headers"]
    assert "dsv41ctl restart --drain" in json.loads(body["body"])["error"]["message"]
    asgi(app, "GET", "/health")
    assert passed[-1] == "/health"
    gate.handle("DELETE", None)
    asgi(app, "POST", "/generate")
    assert passed[-1] == "/generate" and said[-1] == "dsv41-adapter: drain: lifted, admitting new requests"


# ----- the coordinator's loop

class Rank0:
    def __init__(self, listings, refuse=None):
        self.listings = list(listings)  # each read takes the next; the last one stays
        self.refuse = refuse
        self.reasons = []
        self.reads = 0

    def drain(self, reason):
        if self.refuse:
            raise EngineError(self.refuse)
        self.reasons.append(reason)

    def drain_state(self):
        return {"draining": True, "reason": self.reasons[-1], "since_s": 12.0} if self.reasons else {}

    def undrain(self):
        self.reasons.clear()

    def inflight(self):
        self.reads += 1
        return self.listings.pop(0) if len(self.listings) > 1 else self.listings[0]


def listing(*rids):
    return InflightList(tuple(InflightRequest(rid, 100, 100) for rid in rids))


def drainer(engine, clock, broken=lambda: False, wait=None):
    stream = io.StringIO()
    details = []
    d = Drainer(engine, EventLog("test", {}, stream=stream, use_journal=False), wait=wait or clock.advance,
                call=lambda fn: fn(), monotonic=clock.monotonic, broken=broken, set_detail=details.append)
    return d, stream, details


def test_the_drain_waits_until_nothing_is_in_flight_and_says_how_many_finished_and_how_long():
    clock = FakeClock()
    engine = Rank0([listing("a", "b"), listing("b"), listing("b", "HEALTH_CHECK_1"), listing("HEALTH_CHECK_2")])
    d, stream, details = drainer(engine, clock)
    drained = d.run("dsv41ctl restart --drain", 600)
    assert drained.outcome is Outcome.DONE and drained.finished == 2 and drained.left == ()
    assert drained.seconds == 3.0 and engine.reasons == ["dsv41ctl restart --drain"]
    log = stream.getvalue()
    assert "DSV41_EVENT=drain_started" in log and "DSV41_IN_FLIGHT=2" in log
    assert "DSV41_EVENT=drain_done" in log and "DSV41_FINISHED=2" in log and "DSV41_SECONDS=3.0" in log
    assert details[0].startswith("draining for a restart (dsv41ctl restart --drain): 2 requests in flight")


def test_the_drain_ends_at_its_timeout_naming_the_requests_it_cuts():
    clock = FakeClock()
    engine = Rank0([listing("a", "b"), listing("b")])
    d, stream, _ = drainer(engine, clock)
    drained = d.run("planned", 5)
    assert drained.outcome is Outcome.TIMEOUT and drained.left == ("b",) and drained.finished == 1
    assert drained.seconds == 5.0 and not drained.nothing_left
    log = stream.getvalue()
    assert "<4>" in log.split("DSV41_EVENT=drain_timeout")[0].splitlines()[-1] and "DSV41_RIDS=b" in log


def test_a_rank_0_that_does_not_take_the_drain_is_logged_and_nothing_is_waited_for():
    clock = FakeClock()
    engine = Rank0([listing("a")], refuse="POST /dsv41/drain: HTTP 404: not found")
    d, stream, _ = drainer(engine, clock)
    drained = d.run("planned", 600)
    assert drained.outcome is Outcome.UNANSWERED and engine.reads == 0 and clock.monotonic() == 1000.0
    assert "DSV41_EVENT=drain_unavailable" in stream.getvalue() and "HTTP 404" in stream.getvalue()


def test_a_group_that_breaks_or_a_listing_that_goes_ends_the_drain_at_once():
    clock = FakeClock()
    broken = []
    engine = Rank0([listing("a")])
    d, stream, _ = drainer(engine, clock, broken=lambda: bool(broken), wait=lambda s: (clock.advance(s),
                                                                                        broken.append(1)))
    assert d.run("planned", 600).outcome is Outcome.BROKEN and clock.monotonic() == 1001.0
    assert "DSV41_EVENT=drain_interrupted" in stream.getvalue()
    engine = Rank0([listing("a"), InflightList(unavailable="GET /dsv41/inflight: connection refused")])
    d, stream, _ = drainer(engine, FakeClock())
    drained = d.run("planned", 600)
    assert drained.outcome is Outcome.LISTING_LOST and "connection refused" in stream.getvalue()


def test_a_zero_timeout_skips_the_drain_and_a_preempting_request_escapes_the_loop():
    clock = FakeClock()
    engine = Rank0([listing("a")])
    d, stream, _ = drainer(engine, clock)
    assert d.run("planned", 0).outcome is Outcome.SKIPPED and engine.reasons == []
    assert "DSV41_EVENT=drain_skipped" in stream.getvalue()

    def stop_arrives(_seconds):
        raise Preempted(Request(Action.STOP))
    d, _, _ = drainer(engine, clock, wait=stop_arrives)
    with pytest.raises(Preempted):
        d.run("planned", 600)


def test_verdict_order_broken_before_lost_before_done_before_timeout():
    assert verdict(listing("a"), 0, 10, broken=True) is Outcome.BROKEN
    assert verdict(InflightList(unavailable="x"), 99, 10, broken=False) is Outcome.LISTING_LOST
    assert verdict(listing(), 99, 10, broken=False) is Outcome.DONE
    assert verdict(listing("a"), 10, 10, broken=False) is Outcome.TIMEOUT
    assert verdict(listing("a"), 9.9, 10, broken=False) is None


def test_a_rank_0_that_does_not_answer_at_all_has_nothing_to_drain():
    class Down(Rank0):
        def drain(self, reason):
            from coordinator.guard.engine import EngineUnreachable
            raise EngineUnreachable("POST http://10.0.0.1:8888/dsv41/drain: [Errno 111] Connection refused")
    clock = FakeClock()
    d, stream, _ = drainer(Down([listing("a")]), clock)
    assert d.run("configuration change: NCCL_DEBUG", 600).outcome is Outcome.SKIPPED
    assert "DSV41_EVENT=drain_skipped" in stream.getvalue() and "Connection refused" in stream.getvalue()
    assert "<6>" in stream.getvalue()  # information, not a warning


def test_a_stale_drain_is_lifted_and_one_not_there_is_left_alone():
    engine = Rank0([listing()])
    stream = io.StringIO()
    log = EventLog("test", {}, stream=stream, use_journal=False)
    assert lift_stale(engine, log, "no restart follows it") is False and stream.getvalue() == ""
    engine.drain("dsv41ctl restart --drain")
    assert lift_stale(engine, log, "no restart follows it") is True and engine.reasons == []
    assert "DSV41_EVENT=drain_lifted" in stream.getvalue() and "for 12 s" in stream.getvalue()
