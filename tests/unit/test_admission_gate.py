"""The admission gate (adapter/admission_gate.py) without SGLang: its rule, its settings, its measure
of the node, its hooks on stand-ins for the scheduler and the PrefillAdder, and the stand-in
engine's copy of the rule (sim/engine.py)."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from adapter import admission_gate as ag
from adapter.boot import build_specs, env_keys
from dsv41 import admission
from dsv41.adapterlog import AdapterLog
from dsv41.ranksettings import SettingError
from sim.allocator import CachingAllocator, CountedMemory
from sim.engine import Engine, EngineConfig, Phase

pytestmark = pytest.mark.unit

MB = 1_000_000
SETTINGS = admission.GateSettings(guard_bytes=150 * MB, token_bytes=16_384, transient_bytes=4.0)
REFUSED = "OTHER"  # stands in for AddReqResult.OTHER


def test_a_piece_costs_its_tokens_and_the_indexer_buffers_over_its_prefix() -> None:
    assert admission.step_bytes(768, 0, 16_384, 4.0) == 768 * 16_384 + 4 * 768 * 768
    # a prefix-cache hit's first piece: few tokens of its own, buffers over the whole cached prefix
    assert admission.step_bytes(768, 60_000, 16_384, 4.0) == 768 * 16_384 + 4 * 768 * 60_768
    assert admission.step_bytes(0, 60_000, 16_384, 4.0) == 0


def test_the_rule_admits_a_piece_that_leaves_at_least_the_guard() -> None:
    assert admission.admits(400 * MB, 100 * MB, 150 * MB, 150 * MB)  # leaves exactly the guard
    assert not admission.admits(400 * MB, 100 * MB, 150 * MB + 1, 150 * MB)


def test_kv_pool_slots_used_before_and_free_now_cost_nothing_and_are_taken_in_order() -> None:
    # 1000 free slots: the first piece's 768 tokens take 768 of them, the second's 500 the 232 left
    needs, left = admission.pieces_bytes([(768, 0), (500, 10_000)], SETTINGS, 1000)
    assert needs == [4 * 768 * 768, 268 * 16_384 + 4 * 500 * 10_500] and left == 0
    assert admission.step_bytes(768, 0, 16_384, 4.0, kv_free_tokens=100) == 668 * 16_384 + 4 * 768 * 768


def test_settings_are_off_unless_the_guard_level_is_given_and_bad_values_say_what_is_allowed() -> None:
    assert ag.settings_from_env({}) is None
    assert ag.settings_from_env({"DSV41_ADMISSION_GUARD_BYTES": "0"}) is None
    got = ag.settings_from_env({"DSV41_ADMISSION_GUARD_BYTES": "1500000000", "DSV41_ADMISSION_TOKEN_BYTES": "12000",
                                "DSV41_ADMISSION_TRANSIENT_BYTES": "20.0"})
    assert got == admission.GateSettings(1_500_000_000, 12_000, 20.0, admission.LONE_WAIT_S)
    assert ag.settings_from_env({"DSV41_ADMISSION_GUARD_BYTES": "1", "DSV41_ADMISSION_LONE_WAIT_S": "0"}).lone_wait_s == 0
    with pytest.raises(SettingError, match=r"DSV41_ADMISSION_LONE_WAIT_S='soon'.*a number in \[0, 600\]"):
        ag.settings_from_env({"DSV41_ADMISSION_GUARD_BYTES": "1", "DSV41_ADMISSION_LONE_WAIT_S": "soon"})
    with pytest.raises(SettingError, match=r"DSV41_ADMISSION_LONE_WAIT_S='601'.*\[0, 600\]"):
        ag.settings_from_env({"DSV41_ADMISSION_GUARD_BYTES": "1", "DSV41_ADMISSION_LONE_WAIT_S": "601"})
    with pytest.raises(SettingError, match=r"DSV41_ADMISSION_GUARD_BYTES='lots'.*integer"):
        ag.settings_from_env({"DSV41_ADMISSION_GUARD_BYTES": "lots"})
    with pytest.raises(SettingError, match=r"DSV41_ADMISSION_TRANSIENT_BYTES='-1'.*\[0, 1000000\]"):
        ag.settings_from_env({"DSV41_ADMISSION_GUARD_BYTES": "1", "DSV41_ADMISSION_TRANSIENT_BYTES": "-1"})


def test_boot_builds_it_from_the_coordinators_variables_and_a_bad_value_keeps_only_it_out() -> None:
    assert env_keys()["DSV41_ADMISSION_GUARD_BYTES"] == ("admission_gate",)
    out = io.StringIO()
    specs = build_specs({"DSV41_ADMISSION_GUARD_BYTES": "150000000", "DSV41_ADMISSION_TOKEN_BYTES": "16384",
                         "DSV41_ADMISSION_TRANSIENT_BYTES": "4.0"}, AdapterLog(out))
    gate = next(s for s in specs if s.name == "admission_gate")
    assert {p.target for p in gate.patches} == {
        "sglang.srt.managers.scheduler.Scheduler._get_new_batch_prefill_raw",
        "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req"}
    specs = build_specs({"DSV41_ADMISSION_GUARD_BYTES": "x", "DSV41_PREFILL_EMPTY_CACHE_TOKENS": "8192"}, AdapterLog(out))
    names = [s.name for s in specs]
    assert "admission_gate" not in names and "prefill_empty_cache" in names
    assert "admission_gate" in out.getvalue() and "DSV41_ADMISSION_GUARD_BYTES='x'" in out.getvalue()


def test_the_node_room_is_the_tighter_of_memavailable_and_the_cgroups_room(tmp_path) -> None:
    proc, cg = tmp_path / "proc", tmp_path / "cg"
    proc.mkdir()
    cg.mkdir()
    (proc / "meminfo").write_text("MemTotal:       125000000 kB\nMemFree:  1000 kB\nMemAvailable:    2000000 kB\n")
    assert ag.NodeRoom(str(proc), str(cg))() == 2_000_000 * 1024  # no cgroup files: MemAvailable
    (cg / "memory.max").write_text("max\n")
    room = ag.NodeRoom(str(proc), str(cg))
    (cg / "memory.current").write_text("5\n")
    assert room() == 2_000_000 * 1024
    (cg / "memory.max").write_text("1000000000\n")
    (cg / "memory.current").write_text("400000000\n")
    assert room() == 600_000_000
    (cg / "memory.current").write_text("1200000000\n")
    assert room() == 0
    assert ag.NodeRoom(str(tmp_path / "none"), str(tmp_path / "none"))() == ag.UNLIMITED
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (v1 / "memory" / "memory.usage_in_bytes").write_text("100\n")
    assert ag.NodeRoom(str(proc), str(v1))() == 2_000_000 * 1024
    (v1 / "memory" / "memory.limit_in_bytes").write_text("700000000\n")
    assert ag.NodeRoom(str(proc), str(v1))() == 700_000_000 - 100


class Running:
    def __init__(self, n: int) -> None:
        self.reqs = [object()] * n

    def is_empty(self) -> bool:
        return not self.reqs


def req(rid: str, extend: int, prefix: int = 0) -> SimpleNamespace:
    """A waiting request as SGLang 0.5.23's Req is before add_one_req: its fill ids (prompt) and
    the prefix matched in the cache; extend_end is set only once the adder takes it."""
    return SimpleNamespace(rid=rid, prefix_len=prefix, full_untruncated_fill_ids=range(prefix + extend),
                           extend_end=None)


def taken(r: SimpleNamespace, rem: int | None = None) -> SimpleNamespace:
    """What PrefillAdder.add_one_req leaves on a request it took: its piece ends at extend_end (cut
    to the chunk left)."""
    piece = len(r.full_untruncated_fill_ids) - r.prefix_len
    r.extend_end = r.prefix_len + (piece if rem is None else min(piece, rem))
    return r


class Harness:
    """The two hooks as SGLang calls them: a scheduling pass (around _get_new_batch_prefill_raw)
    in which the PrefillAdder is offered the waiting requests one by one."""

    def __init__(self, headroom, settings: admission.GateSettings = SETTINGS, tp_size: int = 1,
                 kv: tuple[int, int] | None = None) -> None:
        self.out = io.StringIO()
        self.collectives: list[tuple[int, ...]] = []
        self.now = 100.0
        self.kv = kv  # the scheduler's KV pool: (size, available), or none
        self.gate = ag.AdmissionGate(settings, AdapterLog(self.out), headroom=headroom,
                                     group_min=self.group_min, refused=lambda: REFUSED, clock=lambda: self.now)
        self.scheduler = SimpleNamespace(tp_size=tp_size, chunked_req=None)

    def group_min(self, scheduler, values: tuple[int, ...]) -> tuple[int, ...]:
        self.collectives.append(values)
        return values

    def run_pass(self, adder, candidates) -> list:
        results = []

        def body(scheduler):
            for r in candidates:
                res = self.gate.around_add_one_req(self.add_one_req, adder, r, has_chunked_req=False)
                results.append(res)
                if res != "CONTINUE":
                    break
            return results
        if self.kv is not None:  # SGLang's allocator, as adapter/scheduler_requests.kv_in_use reads it
            size, available = self.kv
            self.scheduler.token_to_kv_pool_allocator = SimpleNamespace(size=size, available_size=lambda: available)
        return self.gate.around_prefill(body, self.scheduler)

    @staticmethod
    def add_one_req(adder, r, **_kwargs) -> str:
        adder.can_run_list.append(taken(r, adder.rem_chunk_tokens))
        return "CONTINUE"


def adder(*planned, running: int = 0, rem: int | None = 768) -> SimpleNamespace:
    return SimpleNamespace(can_run_list=[r if r.extend_end is not None else taken(r) for r in planned],
                           running_batch=Running(running), rem_chunk_tokens=rem)


def test_a_prefix_cache_hit_waits_while_a_chunk_is_running_and_those_behind_it_wait_too() -> None:
    h = Harness(headroom=lambda: 400 * MB)  # 400 - 76 - 199 < 150
    chunked = req("long", 768, 20_000)  # its chunk: 12.6 MB of KV, 63.8 MB of buffers
    hit = req("hit", 1_000, 60_000)  # a piece of 768 tokens over 60k: 12.6 + 186.7 MB
    short = req("short", 300)
    a = adder(chunked)
    assert h.run_pass(a, [hit, short]) == [REFUSED]
    assert a.can_run_list == [chunked] and h.gate.refusals == 1
    line = h.out.getvalue()
    assert "request hit waits" in line and "768 tokens over a 60000-token prefix, 199 MB" in line
    assert "below the guard's 150 MB" in line
    # the next pass refuses it again, without a second line; then memory came back: it goes in
    assert h.run_pass(adder(chunked), [hit]) == [REFUSED]
    assert h.out.getvalue().count("waits") == 1
    h.gate._headroom = lambda: 800 * MB
    a = adder(chunked)
    assert h.run_pass(a, [hit, short]) == ["CONTINUE", "CONTINUE"]
    assert a.can_run_list == [chunked, hit, short]
    assert "request hit admitted after waiting" in h.out.getvalue()


def test_a_request_alone_that_does_not_fit_waits_for_the_guard_at_most_lone_wait_s() -> None:
    h = Harness(headroom=lambda: 160 * MB)
    assert h.run_pass(adder(running=1), [req("b", 2_000, 10_000)]) == [REFUSED]
    # the others ended, and memory did not come back: nothing will come back for it now, so it
    # waits for the guard's look to abort it, not into a first step that takes the node below
    assert h.run_pass(adder(), [req("b", 2_000, 10_000)]) == [REFUSED]
    assert h.collectives[-1] == (160 * MB, 1)
    h.now += admission.LONE_WAIT_S - 0.1
    assert h.run_pass(adder(), [req("b", 2_000, 10_000)]) == [REFUSED]
    h.now += 0.1  # the guard did not abort it (it may not be running): it goes in
    assert h.run_pass(adder(), [req("b", 2_000, 10_000)]) == ["CONTINUE"]
    assert h.collectives[-1] == (160 * MB, 0)  # the wait was over on this rank: told to the others
    lines = h.out.getvalue().splitlines()
    assert len(lines) == 2 and "request b waits: its first step (768 tokens over a 10000-token prefix, 45 MB)" in lines[0]
    assert lines[0].endswith("it goes in when memory comes back")  # reported once, while others were in flight
    assert lines[1].endswith("admission_gate: request b admitted waited 5 s with nothing else in flight and was not "
                             "aborted (headroom 160 MB, this step 45 MB)")


def test_a_request_alone_goes_in_at_once_when_it_fits_and_its_wait_alone_says_why() -> None:
    h = Harness(headroom=lambda: 400 * MB)
    assert h.run_pass(adder(), [req("fits", 768, 1_000)]) == ["CONTINUE"]
    assert h.out.getvalue() == ""
    h = Harness(headroom=lambda: 160 * MB)
    assert h.run_pass(adder(), [req("hit", 768, 60_000)]) == [REFUSED]
    assert "nothing else is in flight, so nothing will come back for it: it waits for the guard to abort it, " \
           "at most 5 s" in h.out.getvalue()


def test_with_no_lone_wait_a_request_alone_goes_in_at_once_without_measuring() -> None:
    calls = []
    h = Harness(headroom=lambda: calls.append(1) or 0, settings=admission.GateSettings(150 * MB, 16_384, 4.0, 0.0))
    assert h.run_pass(adder(), [req("huge", 768, 900_000)]) == ["CONTINUE"]
    assert calls == [] and h.collectives == [] and h.out.getvalue() == ""
    assert h.run_pass(adder(running=1), [req("huge2", 768, 900_000)]) == [REFUSED]  # with others: held as ever


def test_another_ranks_wait_being_over_decides_for_every_rank() -> None:
    h = Harness(headroom=lambda: 160 * MB, tp_size=3)
    h.gate._group_min = lambda scheduler, values: (values[0], 0)  # another rank's clock: its wait is over
    assert h.run_pass(adder(), [req("hit", 768, 60_000)]) == ["CONTINUE"]
    # with others in flight, a wait over elsewhere changes nothing: memory comes back when they end
    assert h.run_pass(adder(running=1), [req("hit2", 768, 60_000)]) == [REFUSED]


def test_with_the_kv_pool_the_slots_used_before_and_free_now_are_not_charged() -> None:
    # 20000 slots ever in use (seen at a pass), 18000 of them free now: a 768-token cold piece's KV
    # is in pages the pool has, only its 2.4 MB of buffers count
    h = Harness(headroom=lambda: 155 * MB, kv=(100_000, 80_000))
    assert h.run_pass(adder(running=1), []) == []  # a pass that sees 20000 slots in use
    h.kv = (100_000, 98_000)
    assert h.run_pass(adder(running=1), [req("cold", 768)]) == ["CONTINUE"]
    h = Harness(headroom=lambda: 155 * MB, kv=(100_000, 98_000))  # never more in use: 12.6 MB of new pages
    assert h.run_pass(adder(running=1), [req("cold", 768)]) == [REFUSED]


def test_decoding_requests_count_as_in_flight_and_one_measurement_serves_the_pass() -> None:
    calls = []
    h = Harness(headroom=lambda: calls.append(1) or 200 * MB)
    a = adder(running=2)
    # the first fits (13 MB + 2 MB), the second would leave 200 - 15 - 40 < 150: held
    assert h.run_pass(a, [req("a", 768), req("b", 2_000, 10_000)]) == ["CONTINUE", REFUSED]
    assert calls == [1] and h.collectives == [(200 * MB, 1)]
    assert h.run_pass(adder(running=2), [req("a2", 768)]) == ["CONTINUE"]
    assert calls == [1, 1]  # a new pass measures again


def test_a_failed_measurement_still_takes_part_in_the_collective_and_admits() -> None:
    def broken() -> int:
        raise OSError("no /proc")
    h = Harness(headroom=broken, tp_size=3)
    assert h.run_pass(adder(running=1), [req("a", 768, 500_000)]) == ["CONTINUE"]
    assert h.collectives == [(ag.UNLIMITED, 1)]


def test_the_group_minimum_decides_so_every_rank_schedules_the_same_batch() -> None:
    h = Harness(headroom=lambda: 10**12, tp_size=3)
    h.gate._group_min = lambda scheduler, values: (min(values[0], 160 * MB), values[1])  # another rank is tight
    assert h.run_pass(adder(running=1), [req("a", 768)]) == [REFUSED]


def test_outside_a_scheduling_pass_the_original_runs() -> None:
    h = Harness(headroom=lambda: 0)
    a = adder(running=5)
    assert h.gate.around_add_one_req(Harness.add_one_req, a, req("x", 768)) == "CONTINUE"


# --- the stand-in engine's copy of the rule ------------------------------------------------------------

def engine(base: int, gate: admission.GateSettings | None, log=lambda line: None) -> tuple[Engine, CountedMemory]:
    backing = CountedMemory()
    config = EngineConfig(chunk_tokens=768, max_running=8, prefill_tokens_per_s=20_000.0, decode_tokens_per_s=10.0,
                          bytes_per_token=16_384, max_total_tokens=0, context_length=None, transient_bytes=4.0,
                          empty_cache_tokens=8192, admission=gate)
    return Engine(config, on_fatal=lambda why: None, allocator=CachingAllocator(backing),
                  node_room=lambda: base - backing.mapped, log=log), backing


def prefill_all(eng: Engine, until) -> list[list[str]]:
    """Steps the engine's prefills until `until()`; the rids of each step."""
    steps = []
    while not until():
        batch = eng.next_prefill()
        if batch is None:
            break
        steps.append([r.rid for r, _ in batch])
        eng.end_chunk(batch, eng.allocate_chunk(batch))
    return steps


@pytest.mark.parametrize("gated", [True, False])
def test_the_stand_in_holds_a_hit_back_while_a_long_prompt_prefills_and_admits_it_when_memory_is_back(gated) -> None:
    lines: list[str] = []
    eng, backing = engine(600 * MB, SETTINGS if gated else None, log=lines.append)
    other = eng.submit("other", 300)
    long = eng.submit("long", 20_000)
    first = eng.next_prefill()
    eng.end_chunk(first, eng.allocate_chunk(first))
    hit = eng.submit("hit", 61_000, 60_000)  # its first piece: ~190 MB of buffers over the cached prefix
    steps = prefill_all(eng, lambda: long.phase is Phase.DECODE)
    if not gated:
        # it shares the long prompt's last step (32 tokens of it), 327 MB of KV already taken
        assert steps[-1] == ["long", "hit"]
        assert lines == []
        return
    assert all("hit" not in step for step in steps) and steps[-1] == ["long"]
    assert other.phase is Phase.DECODE and hit.phase is Phase.WAITING
    assert eng.next_prefill() is None  # the others are in flight and memory is not back: it waits
    # the adapter's line, once for the whole wait
    assert len(lines) == 1 and lines[0].startswith("admission_gate: request hit waits: its first step (436 tokens "
                                                   "over a 60000-token prefix, 112 MB)")  # beside long's last 332
    assert "below the guard's 150 MB" in lines[0]
    eng.finish(long, "stop")  # its KV goes back to the allocator's cache, which the headroom counts
    assert other.phase is Phase.DECODE  # still in flight: admitted because memory is back, not idle
    assert [r.rid for r, _ in eng.next_prefill()] == ["hit"]
    assert len(lines) == 2 and lines[1].startswith("admission_gate: request hit admitted after waiting (headroom ")


def test_the_stand_in_reads_the_gate_from_the_same_variables_as_the_adapter() -> None:
    from sim import main as sim_main
    from sim.args import parse as parse_args
    from sim.settings import from_env

    env = {"DSV41_ADMISSION_GUARD_BYTES": "150000000", "DSV41_ADMISSION_TOKEN_BYTES": "16384",
           "DSV41_ADMISSION_TRANSIENT_BYTES": "4.0"}
    settings = from_env(env)
    assert settings.admission == SETTINGS and from_env({}).admission is None
    assert sim_main.engine_config(parse_args(["--model-path", "/m"]), settings).admission == SETTINGS
    with pytest.raises(ValueError, match="DSV41_ADMISSION_GUARD_BYTES=-5"):
        from_env({"DSV41_ADMISSION_GUARD_BYTES": "-5"})


def test_the_allocators_free_cache_from_the_nested_statistics_or_the_public_ones() -> None:
    nested = {"reserved_bytes": {"all": {"current": 900}}, "allocated_bytes": {"all": {"current": 600}}}
    fast = SimpleNamespace(_C=SimpleNamespace(_cuda_memoryStats=lambda device: nested))
    assert ag._allocator_free(fast, 0) == 300
    flat = {"reserved_bytes.all.current": 50, "allocated_bytes.all.current": 80}  # never negative
    public = SimpleNamespace(_C=SimpleNamespace(), cuda=SimpleNamespace(memory_stats=lambda device: flat))
    assert ag._allocator_free(public, 0) == 0


def test_the_stand_in_holds_a_request_alone_that_does_not_fit_until_the_guard_aborts_it_or_its_wait_is_over() -> None:
    lines: list[str] = []
    now = [10.0]
    backing = CountedMemory()
    config = EngineConfig(chunk_tokens=768, max_running=8, prefill_tokens_per_s=20_000.0, decode_tokens_per_s=10.0,
                          bytes_per_token=16_384, max_total_tokens=0, context_length=None, transient_bytes=4.0,
                          empty_cache_tokens=8192, admission=SETTINGS)
    eng = Engine(config, on_fatal=lambda why: None, allocator=CachingAllocator(backing), clock=lambda: now[0],
                 node_room=lambda: 300 * MB - backing.mapped, log=lines.append)
    hit = eng.submit("hit", 61_000, 60_000)  # its first piece: 199 MB, on a node with 300 MB
    assert eng.next_prefill() is None and hit.phase is Phase.WAITING
    assert "nothing else is in flight" in lines[0]
    eng.abort("hit")  # the guard's look: it never took a byte
    assert hit.phase is Phase.FINISHED and backing.mapped == 0
    late = eng.submit("late", 61_000, 60_000)
    assert eng.next_prefill() is None
    now[0] += admission.LONE_WAIT_S  # no guard came: it goes in
    assert [r.rid for r, _ in eng.next_prefill()] == ["late"] and late.phase is Phase.PREFILL
    assert lines[-1].startswith("admission_gate: request late admitted waited 5 s with nothing else in flight")
