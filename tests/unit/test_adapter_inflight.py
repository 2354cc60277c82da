"""/dsv41/inflight: the tokenizer manager's request states joined with the scheduler's snapshot
(adapter/reqstate.py, written by adapter/scheduler_requests.py), and its JSON."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import os

from adapter import reqstate
from adapter.inflight import InflightRoute, SchedulerSnapshot, merge, payload, record_prompt_length, snapshot
from adapter.scheduler_requests import SchedulerRequests, WaitingMatches, kv_in_use, prefix_match, snapshot_records

pytestmark = pytest.mark.unit


def state(*, created: float, prompt=None, prompt_ids=None, out=False, finished=False, recorded=None):
    s = SimpleNamespace(
        finished=finished,
        out_list=[{"text": "x"}] if out else [],
        output_ids=[],
        obj=SimpleNamespace(input_ids=prompt),
        prompt_token_ids=prompt_ids,
        time_stats=SimpleNamespace(created_time=created, first_token_time=0.0),
    )
    if recorded is not None:
        s.dsv41_prompt_tokens = recorded
    return s


def test_snapshot_lists_unfinished_requests_oldest_first() -> None:
    states = {
        "small": state(created=90.0, prompt=list(range(10)), out=True),
        "huge": state(created=50.0, recorded=200_000),
        "done": state(created=10.0, prompt=list(range(5)), finished=True),
        "text": state(created=99.5, prompt="a text prompt"),  # not tokenized yet
        "ids": state(created=80.0, prompt_ids=list(range(3000))),
    }
    reqs = snapshot(states, now=100.0)
    assert [r.rid for r in reqs] == ["huge", "ids", "small", "text"]  # arrival order
    huge, ids, small, text = reqs
    assert (huge.prompt_tokens, huge.prefilled_tokens, huge.age_s) == (200_000, 0, 50.0)
    assert (ids.prompt_tokens, ids.prefilled_tokens) == (3000, 0)
    assert (small.prompt_tokens, small.prefilled_tokens) == (10, 10)  # output arrived: prefilled
    assert (text.prompt_tokens, text.prefilled_tokens, text.age_s) == (0, 0, 0.5)


def test_payload_schema() -> None:
    body = payload(snapshot({"r1": state(created=1.0, recorded=7)}, now=3.25))
    assert json.loads(json.dumps(body)) == {
        "requests": [{"rid": "r1", "prompt_tokens": 7, "prefilled_tokens": 0, "age_s": 2.25}],
        "source": "tokenizer_manager",
    }


def test_prompt_length_is_recorded_at_dispatch() -> None:
    st = state(created=1.0, prompt="text")
    manager = SimpleNamespace(rid_to_state={"r": st})
    record_prompt_length(manager, SimpleNamespace(rid="r", input_ids=list(range(1234))))
    record_prompt_length(manager, SimpleNamespace(rid="gone", input_ids=[1]))
    assert st.dsv41_prompt_tokens == 1234
    route = InflightRoute(states=lambda: manager.rid_to_state, clock=lambda: 2.0)
    route.before_send_batch(manager, [SimpleNamespace(rid="r", input_ids=list(range(99)))])
    assert route.body() == (200, {"requests": [{"rid": "r", "prompt_tokens": 99, "prefilled_tokens": 0, "age_s": 1.0}], "source": "tokenizer_manager"})


def test_unreadable_states_answer_503() -> None:
    status, body = InflightRoute(states=lambda: None).body()
    assert status == 503 and "not available" in body["error"]


class Mode:
    def __init__(self, extend: bool):
        self._extend = extend

    def is_extend(self) -> bool:
        return self._extend


def req(rid, prompt, prefix_len=0, extend_end=None, output=0, cached=0, finished=False):
    return SimpleNamespace(rid=rid, origin_input_ids=list(range(prompt)), prefix_len=prefix_len,
                           extend_end=extend_end, output_ids=list(range(output)), cached_tokens=cached,
                           finished=lambda: finished)


def test_the_scheduler_snapshot_says_who_waits_who_is_chunk_prefilled_and_who_decodes() -> None:
    growing = req("grow", 30_000, prefix_len=6144, extend_end=6912, cached=1024)
    short = req("short", 200, prefix_len=0, extend_end=200)  # whole, in the same batch
    decoding = req("dec", 5000, prefix_len=5000, output=17)
    queued = req("wait", 20_000)
    gone = req("gone", 10, finished=True)
    batch = SimpleNamespace(forward_mode=Mode(True), reqs=[short, growing])
    records = snapshot_records(batch, growing, [decoding, gone], [queued, gone])
    assert [(r.rid, r.state, r.prefilled_tokens, r.chunk_tokens) for r in records] == [
        ("short", "prefilling", 0, 200), ("grow", "prefilling", 6144, 768), ("dec", "decoding", 5000, 0),
        ("wait", "waiting", 0, 0)]
    assert records[1].cached_tokens == 1024 and records[2].output_tokens == 17
    # a decode step instead: the chunked request keeps its progress, with no chunk running
    decode = SimpleNamespace(forward_mode=Mode(False), reqs=[decoding])
    records = snapshot_records(decode, growing, [decoding], [queued])
    assert [(r.rid, r.state, r.prefilled_tokens, r.chunk_tokens) for r in records] == [
        ("grow", "prefilling", 6144, 0), ("dec", "decoding", 5000, 0), ("wait", "waiting", 0, 0)]


def test_a_waiting_request_is_listed_with_its_prefix_cache_match_made_once(capsys) -> None:
    calls = []

    def match(tree, r):
        calls.append(r.rid)
        return {"hit": 12_000, "whole": 900, "cold": 0}[r.rid]

    matches = WaitingMatches(match)
    hit, whole, cold = req("hit", 20_000), req("whole", 900), req("cold", 3000)
    for _ in range(3):  # three scheduler steps: each request matched at the first only
        matched = matches.refresh("tree", [hit, whole, cold])
        records = snapshot_records(None, None, [], [hit, whole, cold], matched)
    assert calls == ["hit", "whole", "cold"]
    # prefilled and cached: the match, a whole prompt's less its last token (which is computed)
    assert [(r.rid, r.state, r.prefilled_tokens, r.cached_tokens) for r in records] == [
        ("hit", "waiting", 12_000, 12_000), ("whole", "waiting", 899, 899), ("cold", "waiting", 0, 0)]
    # "hit" started (out of the queue: forgotten); a retry under its rid is another request, matched anew
    matches.refresh("tree", [whole, cold])
    retry = req("hit", 20_000)
    matches.refresh("tree", [retry, whole, cold])
    assert calls == ["hit", "whole", "cold", "hit"]
    # a match that raises stops the matching, said once; the queue is listed unmatched
    def broken(tree, r):
        raise AttributeError("no match_prefix")
    failing = WaitingMatches(broken)
    for _ in range(2):
        matched = failing.refresh("tree", [hit, cold])
        assert [r.prefilled_tokens for r in snapshot_records(None, None, [], [hit, cold], matched)] == [0, 0]
    err = capsys.readouterr().err
    assert err.count("the prefix-cache match failed: AttributeError: no match_prefix") == 1, err
    assert failing.failed == "AttributeError: no match_prefix"


def test_no_tree_or_a_disabled_one_matches_nothing_without_importing_sglang() -> None:
    assert prefix_match(None, req("a", 5000)) == 0
    assert prefix_match(SimpleNamespace(disable=True), req("a", 5000)) == 0
    assert prefix_match(SimpleNamespace(disable=False), req("a", 1)) == 0


def test_the_shared_snapshot_round_trips_and_a_long_rid_is_marked_incomplete(tmp_path) -> None:
    writer = reqstate.RequestsWriter(0, str(tmp_path), clock_ns=lambda: 5_000_000_000)
    long_rid = "x" * 300
    writer.write([reqstate.Record("a", "prefilling", 100, 50, 10, 25, 0),
                  reqstate.Record(long_rid, "waiting", 7, 0, 0, 0, 0)])
    snap = reqstate.read(writer.path)
    assert snap.pid == os.getpid() and snap.written_ns == 5_000_000_000 and snap.unlisted == 0
    first, second = snap.records
    assert first == reqstate.Record("a", "prefilling", 100, 50, 10, 25, 0)
    assert second.rid == "x" * reqstate.RID_BYTES and not second.complete
    assert second.digest == reqstate.rid_digest(long_rid) and first.digest == b""
    writer.write([reqstate.Record(f"r{i}", "waiting", 1, 0, 0, 0, 0) for i in range(reqstate.MAX_RECORDS + 5)])
    snap = reqstate.read(writer.path)
    assert len(snap.records) == reqstate.MAX_RECORDS and snap.unlisted == 5
    os.chmod(writer.path, 0o666)
    with pytest.raises(reqstate.Unreadable, match="only the rank's own user may write it"):
        reqstate.read(writer.path)
    assert reqstate.read(str(tmp_path / "absent")) is None


def test_a_snapshot_says_when_its_step_was_launched_and_the_next_one_starts_unlaunched(tmp_path) -> None:
    clock = iter([1, 5_000_000_000, 5_030_000_000, 5_100_000_000])  # creation, write, launch, write
    writer = reqstate.RequestsWriter(0, str(tmp_path), clock_ns=lambda: next(clock, 0))
    record = reqstate.Record("a", "prefilling", 100, 50, 0, 25, 0)
    writer.write([record])
    assert reqstate.read(writer.path).launched_ns == 0  # listed, not launched yet
    writer.mark_launched()
    snap = reqstate.read(writer.path)
    assert snap.launched_ns == 5_030_000_000 and snap.written_ns == 5_000_000_000 and snap.records == (record,)
    writer.write([record])
    assert reqstate.read(writer.path).launched_ns == 0


def test_the_kv_pools_high_water_mark_covers_the_iterations_before_the_one_listed(tmp_path) -> None:
    writer = reqstate.RequestsWriter(0, str(tmp_path))
    record = reqstate.Record("a", "prefilling", 100, 50, 0, 25, 0)
    assert reqstate.read(writer.path).kv_high_water == 0  # nothing known yet
    writer.write([record], kv_in_use=800)
    # the batch listed has its slots already but may not have written them: not counted yet
    assert reqstate.read(writer.path).kv_high_water == 0
    writer.mark_launched()
    assert reqstate.read(writer.path).kv_high_water == 0
    writer.write([record], kv_in_use=300)  # slots given back: the mark stays
    assert reqstate.read(writer.path).kv_high_water == 800
    writer.write([record], kv_in_use=None)  # a scheduler without the allocator's figures
    assert reqstate.read(writer.path).kv_high_water == 800
    writer.write([record], kv_in_use=1500)
    writer.write([record])
    assert reqstate.read(writer.path).kv_high_water == 1500


def test_the_kv_in_use_is_the_allocators_size_less_what_is_free() -> None:
    pool = SimpleNamespace(size=750_000, available_size=lambda: 749_000)
    assert kv_in_use(SimpleNamespace(token_to_kv_pool_allocator=pool)) == 1000
    assert kv_in_use(SimpleNamespace()) is None  # an older scheduler without one: not known
    assert kv_in_use(SimpleNamespace(token_to_kv_pool_allocator=SimpleNamespace(size=None))) is None


def test_a_write_under_way_is_never_read_half_done(tmp_path) -> None:
    writer = reqstate.RequestsWriter(0, str(tmp_path))
    writer.write([reqstate.Record("a", "waiting", 1, 0, 0, 0, 0)])
    with open(writer.path, "r+b") as f:  # a writer stopped between the two sequence bumps
        f.seek(8)
        f.write((99).to_bytes(8, "little"))
    with pytest.raises(reqstate.Unreadable, match="always being written"):
        reqstate.read(writer.path, attempts=3)


def test_records_seen_before_their_stores_landed_are_read_again_not_returned(tmp_path, monkeypatch) -> None:
    # A weakly ordered CPU may show the reader the new header (an even, unchanged sequence word)
    # with a record still the previous write's: the CRC tells, and the read is tried again.
    writer = reqstate.RequestsWriter(0, str(tmp_path))
    writer.write([reqstate.Record("a", "waiting", 1, 0, 0, 0, 0)])
    with open(writer.path, "rb") as f:
        stale = f.read()
    new = [reqstate.Record("a", "prefilling", 1, 1, 0, 1, 0)]
    writer.write(new)
    real_pread, reads = os.pread, []

    def pread(fd, n, offset):
        reads.append(offset)
        if offset > 8 and len(reads) == 2:  # the first read of the records: the stale ones
            return stale[offset:offset + n]
        return real_pread(fd, n, offset)
    monkeypatch.setattr(reqstate.os, "pread", pread)
    assert reqstate.read(writer.path).records == tuple(new)
    assert len(reads) == 6  # header, records, sequence word: twice


def test_a_file_whose_checksum_never_matches_is_unreadable_and_says_so(tmp_path) -> None:
    writer = reqstate.RequestsWriter(0, str(tmp_path))
    writer.write([reqstate.Record("a", "waiting", 1, 0, 0, 0, 0)])
    with open(writer.path, "r+b") as f:
        f.seek(reqstate._HEADER.size + 4)  # a count of the first record
        f.write(b"\x07")
    with pytest.raises(reqstate.Unreadable, match="checksum never matched in 3 reads"):
        reqstate.read(writer.path, attempts=3)


def test_the_route_joins_the_tokenizer_view_with_the_scheduler_snapshot(tmp_path) -> None:
    tracker = SchedulerRequests(str(tmp_path))
    growing = req("grow", 30_000, prefix_len=6144, extend_end=6912)
    scheduler = SimpleNamespace(tp_rank=0, chunked_req=growing, waiting_queue=[req("wait", 20_000)])
    plan = SimpleNamespace(batch_to_run=SimpleNamespace(forward_mode=Mode(True), reqs=[growing]),
                           running_batch=SimpleNamespace(reqs=[req("dec", 900, prefix_len=900, output=3)]))
    tracker.after_next_batch(plan, scheduler, None, None)
    scheduler.token_to_kv_pool_allocator = SimpleNamespace(size=10_000, available_size=lambda: 2_956)
    tracker.after_next_batch(plan, scheduler, None, None)  # 7044 slots held: listed from the next snapshot on
    states = {"dec": state(created=10.0, recorded=900, out=True), "grow": state(created=20.0, recorded=30_000),
              "wait": state(created=30.0, recorded=20_000), "new": state(created=39.0, recorded=5)}
    route = InflightRoute(states=lambda: states, clock=lambda: 40.0, scheduler=SchedulerSnapshot(str(tmp_path)),
                          monotonic_ns=lambda: reqstate.read(str(tmp_path / "dsv41-requests-tp0")).written_ns + 12_000_000)
    status, body = route.body()
    assert status == 200 and body["source"] == "scheduler" and body["scheduler_age_s"] == 0.012
    assert body["step_launched_monotonic_s"] is None  # run_batch has not returned yet
    assert body["kv_pool_high_water_tokens"] is None  # the first snapshot with it lists its own step
    tracker.after_next_batch(plan, scheduler, None, None)
    status, body = route.body()
    assert body["kv_pool_high_water_tokens"] == 7044
    tracker.after_run_batch(None, scheduler, plan.batch_to_run)
    launched = reqstate.read(str(tmp_path / "dsv41-requests-tp0")).launched_ns
    assert launched > 0 and route.body()[1]["step_launched_monotonic_s"] == round(launched / 1e9, 6)
    rows = {r["rid"]: (r["state"], r["prefilled_tokens"], r["chunk_tokens"]) for r in body["requests"]}
    # "new" has not reached the scheduler's snapshot yet: it waits and holds nothing
    assert rows == {"dec": ("decoding", 900, 0), "grow": ("prefilling", 6144, 768), "wait": ("waiting", 0, 0),
                    "new": ("waiting", 0, 0)}
    assert [r["rid"] for r in body["requests"]] == ["dec", "grow", "wait", "new"]
    assert set(body["requests"][0]) == {"rid", "prompt_tokens", "prefilled_tokens", "age_s", "state", "cached_tokens",
                                        "chunk_tokens", "output_tokens"}
    # a scheduler that is gone leaves the tokenizer's view alone (no state: the guard cannot tell)
    dead = InflightRoute(states=lambda: states, clock=lambda: 40.0,
                         scheduler=SchedulerSnapshot(str(tmp_path), alive=lambda pid: False))
    status, body = dead.body()
    assert body["source"] == "tokenizer_manager" and "state" not in body["requests"][0]


def test_an_untrusted_snapshot_is_not_used_and_the_route_says_why(tmp_path) -> None:
    writer = reqstate.RequestsWriter(0, str(tmp_path))
    writer.write([])
    os.chmod(writer.path, 0o646)
    route = InflightRoute(states=lambda: {"r": state(created=1.0, recorded=3)}, clock=lambda: 2.0,
                          scheduler=SchedulerSnapshot(str(tmp_path)))
    status, body = route.body()
    assert status == 200 and body["source"] == "tokenizer_manager" and "mode 0646" in body["scheduler_problem"]


def test_a_long_rid_cut_inside_a_character_is_still_a_prefix_of_it(tmp_path) -> None:
    # 159 ASCII bytes, then two-byte characters: the 160-byte cut falls inside the first of them
    rid = "a" * 159 + "\u00e9" * 20
    writer = reqstate.RequestsWriter(0, str(tmp_path), clock_ns=lambda: 1)
    writer.write([reqstate.Record(rid, "prefilling", 9, 4, 0, 2, 0)])
    (record,) = reqstate.read(writer.path).records
    assert not record.complete and record.rid == "a" * 159 and rid.startswith(record.rid)
    merged = merge(snapshot({rid: state(created=1.0, recorded=9)}, now=2.0), [record])
    assert merged[0].state == "prefilling" and merged[0].prefilled_tokens == 4


def long_record(rid: str, state_name: str, prefilled: int) -> reqstate.Record:
    return reqstate.Record(rid[:reqstate.RID_BYTES], state_name, 9, prefilled, 0, 0, 0, complete=False,
                           digest=reqstate.rid_digest(rid))


def test_long_rids_that_share_their_first_bytes_each_get_their_own_record(tmp_path) -> None:
    shared = "job-" + "p" * 200  # longer than a record keeps
    rid_a, rid_b = shared + "-a", shared + "-b"
    writer = reqstate.RequestsWriter(0, str(tmp_path), clock_ns=lambda: 1)
    writer.write([reqstate.Record(rid_a, "prefilling", 9, 4, 0, 2, 0)])
    records = list(reqstate.read(writer.path).records)
    both = snapshot({rid_a: state(created=1.0, recorded=9), rid_b: state(created=2.0, recorded=9)}, now=3.0)
    # only rid_a is listed by the scheduler: rid_b, same first bytes, is not given rid_a's record
    assert {r.rid: r.state for r in merge(both, records)} == {rid_a: "prefilling", rid_b: "waiting"}
    writer.write([reqstate.Record(rid_a, "prefilling", 9, 4, 0, 2, 0),
                  reqstate.Record(rid_b, "decoding", 9, 9, 0, 0, 3)])
    records = list(reqstate.read(writer.path).records)
    assert records[0].rid == records[1].rid  # the same first bytes
    merged = {r.rid: (r.state, r.prefilled_tokens) for r in merge(both, records)}
    assert merged == {rid_a: ("prefilling", 4), rid_b: ("decoding", 9)}


def test_a_long_rid_is_matched_only_by_a_record_of_its_own_digest() -> None:
    rid_a, rid_b = "a" * 200, "a" * 170
    merged = merge(snapshot({rid_a: state(created=1.0, recorded=9)}, now=2.0), [long_record(rid_a, "prefilling", 4)])
    assert merged[0].state == "prefilling" and merged[0].prefilled_tokens == 4
    # a record with the right first bytes and another rid's digest is not this rid's
    stray = [reqstate.Record(rid_a[:reqstate.RID_BYTES], "decoding", 9, 9, 0, 0, 1, complete=False,
                             digest=reqstate.rid_digest(rid_b))]
    assert merge(snapshot({rid_a: state(created=1.0, recorded=9)}, now=2.0), stray)[0].state == "waiting"
    # the same rid listed twice is ambiguous: not from the scheduler
    twice = snapshot({rid_a: state(created=1.0, recorded=9)}, now=2.0)
    assert merge(twice, [long_record(rid_a, "prefilling", 4), long_record(rid_a, "decoding", 9)])[0].state == "waiting"
