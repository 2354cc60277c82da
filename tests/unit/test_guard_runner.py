"""The guard's runner against a real HTTP server standing in for rank 0 and scripted memory
streams: what it sends to the engine, what it asks of the cluster, what it journals."""

from __future__ import annotations

import json
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from coordinator.guard import policy as p
from coordinator.guard.engine import EngineApi, EngineError, parse_inflight
from coordinator.guard.events import event_of
from coordinator.guard.runner import MemoryGuard
from dsv41.cost import CostModel
from dsv41.journal import EventLog
from dsv41.v1 import agent_pb2 as pb

pytestmark = pytest.mark.unit
MB = 1_000_000
SETTINGS = p.GuardSettings(guard_bytes=150 * MB, lead_s=0.5, envelope_s=0.25, hysteresis_bytes=50 * MB)


class Rank0:
    """A tiny rank 0: GET /dsv41/inflight, POST /abort_request; records what it received."""

    def __init__(self, inflight: list[dict] | None, abort_status: int = 200, api_key: str | None = None):
        self.inflight = inflight
        self.abort_status = abort_status
        self.aborts: list[dict] = []
        self.arrived = threading.Event()
        self.on_inflight = lambda: None
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, status, body=b""):
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _authorised(self):
                if api_key and self.headers.get("Authorization") != f"Bearer {api_key}":
                    self._send(401, b'{"error": "Unauthorized"}')
                    return False
                return True

            def do_GET(self):
                if not self._authorised():
                    return
                outer.on_inflight()
                if self.path == "/dsv41/inflight" and outer.inflight is not None:
                    self._send(200, json.dumps({"requests": outer.inflight, "source": "test"}).encode())
                else:
                    self._send(404, b'{"detail": "Not Found"}')

            def do_POST(self):
                if not self._authorised():
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.aborts.append(body)
                outer.arrived.set()
                self._send(outer.abort_status)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class Stream:
    def __init__(self):
        self.q: queue.Queue = queue.Queue()
        self.cancelled = False

    def __iter__(self):
        return self

    def __next__(self):
        item = self.q.get()
        if item is None:
            raise StopIteration
        return item

    def cancel(self):
        self.cancelled = True
        self.q.put(None)


class Source:
    def __init__(self, node: str):
        self.node = node
        self.streams: list[Stream] = []
        self.opened = threading.Event()

    def watch_memory(self, interval_ms, psi_trigger=True, **send):
        assert interval_ms == SETTINGS.interval_ms and psi_trigger
        # only what moved, and the samples after it that a confirmation needs
        assert send == {"min_change_bytes": 4 << 20, "heartbeat_ms": 5000, "replay_samples": 0,
                        "follow_samples": SETTINGS.confirm_samples}
        stream = Stream()
        self.streams.append(stream)
        self.opened.set()
        return stream

    def push_ramp(self, start: int, rate: float, seconds: float, t0: float = 0.0, step: float = 0.02) -> int:
        """Queues the ramp's samples; returns how many."""
        count = int(seconds / step)
        for i in range(count):
            level = max(0, int(start - rate * i * step))
            self.streams[-1].q.put(pb.MemorySample(at_monotonic_s=t0 + i * step, available_bytes=level))
        return count


def wait_until(condition, what: str, timeout: float = 5.0) -> None:
    """Waits for `condition()` against a deadline (the guard's threads run on their own)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.005)


def wait_all_handled(guard, pushed: int) -> None:
    """Every sample queued has been decided on, and what was decided carried out (the runner counts
    a sample after both)."""
    wait_until(lambda: guard.stats.samples >= pushed, f"{pushed} samples handled (got {guard.stats.samples})")


def confirmations_ended() -> bool:
    """The thread that reads the list after an abort, the only one that journals its confirmation, has ended."""
    return not any(t.name == "guard-confirm" and t.is_alive() for t in threading.enumerate())


class Journal:
    def __init__(self):
        self.entries: list[dict] = []
        self.log = EventLog("dsv41-coordinator", {"DSV41_NODE": "spark1"}, sender=self.send)

    def send(self, **entry):
        self.entries.append(entry)

    def kinds(self):
        return [e["DSV41_EVENT"] for e in self.entries]

    def wait_for(self, kind: str, timeout: float = 5.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.entries:
                if e["DSV41_EVENT"] == kind:
                    return e
            time.sleep(0.01)
        raise AssertionError(f"no {kind} event; got {self.kinds()}")


@pytest.fixture
def rig():
    made = []

    def make(inflight, mode="act", abort_status=200, serving_key=1.0, settings=SETTINGS, serving=True,
             stopping=False):
        rank0 = Rank0(inflight, abort_status)
        source = Source("spark1")
        journal = Journal()
        stops: list[str] = []
        state = {"key": serving_key, "serving": serving, "journal_at_stop": [], "stopping": stopping, "asked": 0}

        def guarded():
            state["asked"] += 1
            return None if state["key"] is None else (state["key"], state["serving"])

        def stop(reason: str) -> None:
            state["journal_at_stop"].append(journal.kinds())
            stops.append(reason)
        guard = MemoryGuard(p.GuardSettings(**{**settings.__dict__, "mode": mode}), {"spark1": source},
                            EngineApi(rank0.url), journal.log,
                            guarded,
                            stop, poll_s=0.02, stopping=lambda: state["stopping"])
        made.append((guard, rank0))
        guard.start()
        return guard, rank0, source, journal, stops, state
    yield make
    for guard, rank0 in made:
        guard.stop()
        rank0.close()


RUNAWAY = [{"rid": "small", "prompt_tokens": 200, "prefilled_tokens": 200, "age_s": 3.0},
           {"rid": "runaway", "prompt_tokens": 60000, "prefilled_tokens": 20000, "age_s": 1.0}]


def test_a_runaway_is_aborted_on_rank_0_with_one_journal_event_carrying_the_numbers(rig):
    guard, rank0, source, journal, stops, _ = rig(RUNAWAY)
    assert source.opened.wait(2)
    source.push_ramp(700 * MB, 400 * MB, 1.2)
    assert rank0.arrived.wait(5)
    event = journal.wait_for("memory_abort")
    assert rank0.aborts[0] == {"rid": "runaway", "abort_all": False}
    assert event["DSV41_VICTIM_RID"] == "runaway" and event["DSV41_VICTIM_PROMPT_TOKENS"] == "60000"
    assert int(event["DSV41_AVAILABLE_BYTES"]) < 700 * MB and int(event["DSV41_SLOPE_BYTES_PER_S"]) < -300 * MB
    assert float(event["DSV41_PREDICTED_CROSSING_S"]) <= SETTINGS.lead_s + SETTINGS.envelope_s
    assert event["DSV41_GUARD_BYTES"] == str(150 * MB) and event["DSV41_NODE_NAME"] == "spark1"
    assert event["PRIORITY"] == "3" and "runaway" in event["MESSAGE"]
    assert journal.kinds().count("memory_abort") == 1 and stops == []


def test_observe_mode_journals_what_it_would_do_and_sends_nothing(rig):
    guard, rank0, source, journal, stops, _ = rig(RUNAWAY, mode="observe")
    assert source.opened.wait(2)
    pushed = source.push_ramp(700 * MB, 400 * MB, 1.2)
    event = journal.wait_for("memory_abort_observed")
    assert "would be aborting request runaway" in event["MESSAGE"] and event["DSV41_GUARD_MODE"] == "observe"
    wait_all_handled(guard, pushed)
    assert rank0.aborts == [] and stops == []


def test_without_the_in_flight_route_it_aborts_all(rig):
    guard, rank0, source, journal, stops, _ = rig(None)
    assert source.opened.wait(2)
    source.push_ramp(700 * MB, 400 * MB, 1.2)
    assert rank0.arrived.wait(5)
    assert rank0.aborts[0] == {"rid": "", "abort_all": True}
    event = journal.wait_for("memory_abort_all")
    assert "404" in event["DSV41_INFLIGHT_UNAVAILABLE"]


def test_memory_that_keeps_falling_ends_in_one_stop_request(rig):
    guard, rank0, source, journal, stops, state = rig(RUNAWAY)
    assert source.opened.wait(2)
    pushed = source.push_ramp(700 * MB, 400 * MB, 2.0)   # the engine ignores the aborts
    journal.wait_for("memory_stop")
    wait_all_handled(guard, pushed)
    assert [a["abort_all"] for a in rank0.aborts] == [False, True]
    assert len(stops) == 1 and "after abort_all" in stops[0]
    assert journal.kinds().count("memory_stop") == 1
    # The stop is asynchronous (the supervisor's): the guard's reason is in the journal before it is asked.
    assert state["journal_at_stop"][0][-1] == "memory_stop"


def test_while_the_cluster_stops_a_growing_request_is_aborted_and_no_second_stop_is_asked(rig):
    # Rank 0 drains during a stop: what grows meanwhile is aborted as when serving; the fall that
    # goes on is not answered with another stop (it would be served after this one).
    guard, rank0, source, journal, stops, state = rig(RUNAWAY, stopping=True)
    assert source.opened.wait(2)
    pushed = source.push_ramp(700 * MB, 400 * MB, 2.0)   # the engine ignores the aborts
    event = journal.wait_for("memory_stop")
    assert event["DSV41_OUTCOME"] == "not carried out: the cluster is stopping already"
    assert [a["abort_all"] for a in rank0.aborts] == [False, True] and rank0.aborts[0]["rid"] == "runaway"
    wait_all_handled(guard, pushed)
    assert stops == [] and guard.stats.failures == 0 and journal.kinds().count("memory_stop") == 1


def test_a_failed_abort_is_journalled_as_failed(rig):
    guard, rank0, source, journal, stops, _ = rig(RUNAWAY, abort_status=500)
    assert source.opened.wait(2)
    source.push_ramp(700 * MB, 400 * MB, 1.2)
    event = journal.wait_for("memory_abort")
    assert event["DSV41_OUTCOME"].startswith("failed: POST /abort_request") and "500" in event["DSV41_OUTCOME"]
    assert guard.stats.failures >= 1


def test_streams_run_only_while_serving_and_a_new_serving_period_starts_fresh(rig):
    guard, rank0, source, journal, stops, state = rig(RUNAWAY, serving_key=None)
    wait_until(lambda: state["asked"] >= 3, "three passes of the guard's phase check")
    assert source.streams == []
    state["key"] = 10.0
    assert source.opened.wait(2)
    first = source.streams[-1]
    state["key"] = None
    wait_until(lambda: first.cancelled, "the stream cancelled once no rank runs", 2)
    source.opened.clear()
    state["key"] = 20.0
    assert source.opened.wait(2) and len(source.streams) == 2


def test_no_action_is_carried_out_once_the_cluster_stopped_serving(rig):
    guard, rank0, source, journal, stops, state = rig(RUNAWAY)
    assert source.opened.wait(2)
    rank0.on_inflight = lambda: state.update(key=None)  # the cluster stops serving while the guard decides
    source.push_ramp(700 * MB, 400 * MB, 1.2)
    event = journal.wait_for("memory_abort")
    assert "not carried out" in event["DSV41_OUTCOME"] and rank0.aborts == []


SCHEDULER_VIEW = [
    {"rid": "chat", "prompt_tokens": 500, "prefilled_tokens": 500, "age_s": 9.0, "state": "decoding",
     "cached_tokens": 0, "chunk_tokens": 0, "output_tokens": 40},
    {"rid": "job-1", "prompt_tokens": 40_000, "prefilled_tokens": 3_072, "age_s": 2.0, "state": "prefilling",
     "cached_tokens": 0, "chunk_tokens": 768, "output_tokens": 0},
    {"rid": "job-10", "prompt_tokens": 30_000, "prefilled_tokens": 0, "age_s": 1.0, "state": "waiting",
     "cached_tokens": 0, "chunk_tokens": 0, "output_tokens": 0},
]
WITH_COST = p.GuardSettings(**{**SETTINGS.__dict__, "cost": CostModel(16_384, 0.0, 768, 8192)})


def test_victims_by_their_cost_one_event_each_a_prefix_rid_after_the_rids_it_would_end_and_each_confirmed(rig):
    # job-1 grows and cannot fit; "job-1" would end job-10 too, so job-10 goes first, then job-1
    # once job-10 is seen gone; each abort is confirmed from the in-flight list
    guard, rank0, source, journal, stops, _ = rig([dict(r) for r in SCHEDULER_VIEW], settings=WITH_COST)

    def aborted_ones_leave():
        done = {a["rid"] for a in rank0.aborts}
        rank0.inflight = [r for r in rank0.inflight if r["rid"] not in done]
    rank0.on_inflight = aborted_ones_leave
    assert source.opened.wait(2)
    source.push_ramp(700 * MB, 100 * MB, 1.0)
    deadline = time.monotonic() + 5
    while len(rank0.aborts) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rank0.aborts == [{"rid": "job-10", "abort_all": False}, {"rid": "job-1", "abort_all": False}]
    first, second = [e for e in journal.entries if e["DSV41_EVENT"] == "memory_abort"][:2]
    assert first["DSV41_VICTIM_RID"] == "job-10" and first["DSV41_VICTIM_WHY"] == "unblocks"
    assert first["DSV41_SKIPPED_RIDS"] == "job-1" and "would also end job-10" in first["MESSAGE"]
    assert second["DSV41_VICTIM_RID"] == "job-1" and second["DSV41_VICTIM_WHY"] == "growing"
    assert first["DSV41_BASIS"] == "model" and int(first["DSV41_PROJECTED_LOW_KEPT_BYTES"]) < 150 * MB
    confirmed = journal.wait_for("memory_abort_confirmed")
    assert confirmed["DSV41_VICTIM_RID"] == "job-10"
    deadline = time.monotonic() + 2
    while journal.kinds().count("memory_abort_confirmed") < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [e["DSV41_VICTIM_RID"] for e in journal.entries if e["DSV41_EVENT"] == "memory_abort_confirmed"] == [
        "job-10", "job-1"]
    assert "chat" not in {a["rid"] for a in rank0.aborts} and stops == []


def test_an_abort_that_does_not_take_effect_is_journalled_once(rig):
    guard, rank0, source, journal, stops, _ = rig([dict(r) for r in SCHEDULER_VIEW[:2]])
    assert source.opened.wait(2)
    source.push_ramp(700 * MB, 400 * MB, 1.1)  # the engine ignores the abort; then no more samples
    event = journal.wait_for("memory_abort_unconfirmed", timeout=5)
    assert event["DSV41_VICTIM_RID"] == "job-1" and int(event["DSV41_UNCONFIRMED_AFTER_MS"]) >= 750
    wait_until(confirmations_ended, "the confirmation's reader ended")
    assert journal.kinds().count("memory_abort_unconfirmed") == 1


def test_during_bring_up_a_fall_with_nothing_in_flight_is_a_stop_request(rig):
    guard, rank0, source, journal, stops, state = rig([], serving=False)  # the model loads: health phase
    assert source.opened.wait(2)
    source.push_ramp(700 * MB, 400 * MB, 1.2)
    event = journal.wait_for("memory_stop")
    assert "nothing is in flight" in event["MESSAGE"] and len(stops) == 1 and rank0.aborts == []


# ---------------------------------------------------------------- the engine client and the events

def test_engine_api_reads_the_in_flight_list_and_reports_why_it_has_none():
    rank0 = Rank0(RUNAWAY)
    try:
        api = EngineApi(rank0.url)
        listed = api.inflight()
        assert listed.unavailable == "" and [r.rid for r in listed.requests] == ["small", "runaway"]
        assert listed.requests[1].prefilling and not listed.requests[0].prefilling
        rank0.inflight = None
        assert "404" in api.inflight().unavailable
        api.abort("r1")
        api.abort(None)
        assert rank0.aborts == [{"rid": "r1", "abort_all": False}, {"rid": "", "abort_all": True}]
    finally:
        rank0.close()
    down = EngineApi(rank0.url, timeout_s=0.5)
    assert "GET" in down.inflight().unavailable
    with pytest.raises(EngineError, match="POST"):
        down.abort("x")


def test_engine_api_sends_the_api_key_rank_0_requires():
    rank0 = Rank0(RUNAWAY, api_key="s3cret-key")
    try:
        assert "HTTP 401" in EngineApi(rank0.url).inflight().unavailable
        with pytest.raises(EngineError, match="401"):
            EngineApi(rank0.url).abort("r1")
        api = EngineApi(rank0.url, api_key="s3cret-key")
        assert [r.rid for r in api.inflight().requests] == ["small", "runaway"]
        api.abort("runaway")
        assert rank0.aborts == [{"rid": "runaway", "abort_all": False}]
    finally:
        rank0.close()


def test_parse_inflight_rejects_what_is_not_the_schema():
    with pytest.raises(ValueError):
        parse_inflight({"requests": [{"prompt_tokens": 3}]})
    with pytest.raises(ValueError):
        parse_inflight([])
    assert parse_inflight({"requests": []}).requests == ()
    # when the step listed was launched: a number, or null (not yet, or a route that does not say)
    assert parse_inflight({"requests": [], "step_launched_monotonic_s": 81234.5}).step_launched_at == 81234.5
    assert parse_inflight({"requests": [], "step_launched_monotonic_s": None}).step_launched_at is None
    assert parse_inflight({"requests": []}).step_launched_at is None
    for wrong in ("81234.5", True, [1]):
        with pytest.raises(ValueError, match="step_launched_monotonic_s"):
            parse_inflight({"requests": [], "step_launched_monotonic_s": wrong})
    # the KV pool's high-water mark: whole tokens, or null
    assert parse_inflight({"requests": [], "kv_pool_high_water_tokens": 412032}).kv_high_water_tokens == 412032
    assert parse_inflight({"requests": [], "kv_pool_high_water_tokens": None}).kv_high_water_tokens is None
    for wrong in (-1, 1.5, "7", True):
        with pytest.raises(ValueError, match="kv_pool_high_water_tokens"):
            parse_inflight({"requests": [], "kv_pool_high_water_tokens": wrong})


def test_engine_api_refuses_what_is_not_plain_http():
    with pytest.raises(ValueError, match="plain http"):
        EngineApi("https://10.0.0.1:8888")


def test_an_observed_stop_is_a_warning_and_a_real_stop_critical():
    d = p.Decision(p.Kind.STOP, "spark1", "kept falling", 100 * MB, -2e8, 0.0, "slope", 150 * MB)
    act, observe = event_of(d, "act"), event_of(d, "observe")
    assert act.kind == "memory_stop" and act.priority == "crit"
    assert observe.kind == "memory_stop_observed" and observe.priority == "warning"
    assert observe.fields["predicted_crossing_s"] == 0.0 and "would be stopping the ranks" in observe.message


def test_a_request_that_arrives_and_cannot_fit_is_aborted_by_the_look_before_any_sample_moves(rig):
    # memory is flat (one sample): no fall makes the guard look, the looker reads the list
    fits = {"rid": "fits", "prompt_tokens": 2_000, "prefilled_tokens": 0, "state": "waiting", "age_s": 0.1}
    guard, rank0, source, journal, stops, _ = rig([fits], settings=WITH_COST)
    assert source.opened.wait(2)
    source.streams[-1].q.put(pb.MemorySample(at_monotonic_s=0.0, available_bytes=400 * MB))
    wait_all_handled(guard, 1)
    listed = []
    rank0.on_inflight = lambda: listed.append(1)
    # two whole looks with a request that fits (33 MB of 250): nothing to do
    wait_until(lambda: len(listed) >= 3, "three in-flight reads after the sample")
    assert rank0.aborts == [] and "memory_abort" not in journal.kinds()
    rank0.inflight = [fits, {"rid": "huge", "prompt_tokens": 60_000, "prefilled_tokens": 0, "state": "waiting",
                             "age_s": 0.0}]  # 983 MB of KV on a node with 250 MB above the guard
    assert rank0.arrived.wait(2)
    assert rank0.aborts == [{"rid": "huge", "abort_all": False}]
    event = journal.wait_for("memory_abort")
    assert event["DSV41_BASIS"] == "look" and event["DSV41_VICTIM_WHY"] == "cannot_fit"
    assert "with huge arrived" in event["MESSAGE"] and stops == []
