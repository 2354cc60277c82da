"""Applying cluster.env to a running coordinator: the comparison, the store of applied
configurations, and the Coordinator's choices (over stand-in sessions: the parts a Session
builds are tested where they live)."""

from __future__ import annotations

import io
import os

import pytest

from coordinator import config, configdiff
from coordinator.configstore import ConfigStore, Source, choose_at_start, digest
from coordinator.reconfig import Coordinator, first_config
from coordinator.state import Phase
from dsv41.journal import EventLog
from tests.configtext import HOME, SEED_TEXT, edited, line_of

pytestmark = pytest.mark.unit

BASE = edited(INSECURE_NO_TLS="1", API_KEY_FILE="")


def parsed(text: str) -> config.ClusterConfig:
    return config.parse(text, "cluster.env", HOME)


def effects(**changes: str | None) -> dict[str, configdiff.Effect]:
    change = configdiff.diff(parsed(BASE), parsed(edited(BASE, **changes)))
    return {c.key: c.effect for c in change.changes}


# ---------------------------------------------------------------- the comparison


def test_a_guard_threshold_applies_at_once_and_keeps_the_ranks():
    change = configdiff.diff(parsed(BASE), parsed(edited(BASE, MEMORY_GUARD_GB="7")))
    assert [(c.key, c.before, c.after, c.effect) for c in change.changes] == [
        ("MEMORY_GUARD_GB", "1.5", "7", configdiff.Effect.LIVE)]
    assert not change.restarts_ranks and change.rank_keys == ()


def test_keys_in_a_ranks_plan_restart_the_ranks():
    assert effects(NCCL_DEBUG="INFO") == {"NCCL_DEBUG": configdiff.Effect.RANKS}
    assert effects(WORKER1_IP="10.0.0.9") == {"WORKER1_IP": configdiff.Effect.RANKS}
    assert effects(HEAD_IP="10.0.0.7")["HEAD_IP"] is configdiff.Effect.RANKS


def test_the_memory_floor_applies_at_the_ranks_next_start_not_by_restarting_them():
    change = configdiff.diff(parsed(edited(BASE, MEMORY_GUARD_GB="7")),
                             parsed(edited(BASE, MEMORY_GUARD_GB="7", MEMORY_FLOOR_GB="3")))
    assert {c.key: c.effect for c in change.changes} == {"MEMORY_FLOOR_GB": configdiff.Effect.NEXT_START}
    assert not change.restarts_ranks


def test_a_passed_through_key_removed_shows_as_not_set():
    old = parsed(edited(BASE, NCCL_ALGO="Ring"))
    change = configdiff.diff(old, parsed(BASE))
    assert [(c.key, c.before, c.after) for c in change.changes] == [("NCCL_ALGO", "Ring", None)]
    assert "NCCL_ALGO: 'Ring' -> (not set) (restarts the ranks)" in change.describe()


def test_comments_alone_change_nothing():
    change = configdiff.diff(parsed(BASE), parsed(BASE + "\n# a note\n"))
    assert change.changes == () and not change.restarts_ranks


# ---------------------------------------------------------------- the store


def test_the_store_keeps_what_runs_and_what_ran_before(tmp_path):
    store = ConfigStore(str(tmp_path / "config"))
    assert store.applied() is None and store.previous() is None
    store.record_applied("A")
    store.record_applied("A")  # the same again: the previous one is not lost to it
    assert (store.applied(), store.previous()) == ("A", None)
    store.record_applied("B")
    assert (store.applied(), store.previous()) == ("B", "A")
    assert oct(os.stat(tmp_path / "config" / "applied.env").st_mode & 0o777) == "0o600"
    store.record_rolled_back("B", "A", 100.0, "health failed")
    assert (store.applied(), store.previous()) == ("A", "B")
    assert store.rejected().sha256 == digest("B") and store.rejected().why == "health failed"
    store.forget_rejected()
    assert store.rejected() is None


def test_at_start_the_file_runs_unless_invalid_or_rolled_back(tmp_path):
    store = ConfigStore(str(tmp_path))
    assert choose_at_start(True, "B", "A", None).source is Source.FILE
    assert choose_at_start(False, "bad", None, None) is None  # nothing to fall back on: refused as before
    invalid = choose_at_start(False, "bad", "A", None, "cluster.env:39: TP_SIZE: defined twice")
    assert invalid.source is Source.APPLIED and "cluster.env:39: TP_SIZE: defined twice" in invalid.why
    store.record_rolled_back("B", "A", 1.0, "launch failed")
    again = choose_at_start(True, "B", "A", store.rejected())
    assert again.source is Source.APPLIED and "launch failed" in again.why
    assert choose_at_start(True, "C", "A", store.rejected()).source is Source.FILE  # edited since


def test_first_config_falls_back_on_the_applied_one_with_the_files_errors(tmp_path):
    path = tmp_path / "cluster.env"
    store = ConfigStore(str(tmp_path / "state"))
    path.write_text(BASE)
    store.record_applied(BASE)
    broken = BASE + "TP_SIZE=3\n"
    path.write_text(broken)
    cfg, text, why = first_config(str(path), store)
    assert text == BASE and cfg.integer("TP_SIZE") == 3
    assert f"cluster.env:{len(broken.splitlines())}: TP_SIZE: defined twice" in why
    store.record_applied(BASE)
    with pytest.raises(config.ConfigInvalid):
        first_config(str(path), ConfigStore(str(tmp_path / "empty")))


# ---------------------------------------------------------------- the Coordinator


class Snap:
    def __init__(self, phase):
        self.phase = phase


class StandInRuntime:
    def __init__(self, phase):
        self.phase = phase
        self.listeners = []

    def snapshot(self):
        return Snap(self.phase)

    def on_incident(self, listener):
        self.listeners.append(listener)


class StandInSession:
    """What the Coordinator asks of a Session: start, stop, and the phase it runs in."""
    made: list["StandInSession"] = []

    def __init__(self, cfg, text, creds, log, listeners, state_dir, started_unix_s=None, phase=Phase.SERVING):
        self.cfg, self.text, self.api_key = cfg, text, creds.api_key
        self.runtime = StandInRuntime(phase)
        self.started = None
        self.stopped = None
        self.made.append(self)

    def start(self, autostart, restart_for=(), rollout=None):
        self.started = (autostart, restart_for, rollout)

    def stop(self, stop_cluster):
        self.stopped = stop_cluster


@pytest.fixture
def coordinator(tmp_path):
    StandInSession.made = []
    path = tmp_path / "cluster.env"
    path.write_text(BASE)
    journal = io.StringIO()
    log = EventLog("dsv41-coordinator", {"DSV41_NODE": "spark1"}, stream=journal, use_journal=False)
    spawned = []
    c = Coordinator(str(path), ConfigStore(str(tmp_path / "config")), log, str(tmp_path), clock=lambda: 1000.0,
                    session_factory=StandInSession, spawn=spawned.append)
    cfg, text, _ = first_config(str(path), c._store)
    from coordinator.session import Credentials
    c.start(cfg, text, Credentials(None, None), autostart=True)
    return c, path, journal, spawned


def test_an_invalid_file_is_refused_with_its_line_and_nothing_changes(coordinator):
    c, path, journal, _ = coordinator
    first = c.session
    text = BASE + "TP_SIZE=3\n"
    path.write_text(text)
    outcome = c.apply("root")
    assert not outcome.ok
    assert f"cluster.env:{len(text.splitlines())}: TP_SIZE: defined twice (first on line {line_of(BASE, 'TP_SIZE')})" \
        in outcome.message
    assert c.session is first and first.stopped is None
    assert "DSV41_EVENT=config_refused" in journal.getvalue()
    assert not c.diff().ok


def test_a_coordinator_side_change_replaces_the_session_and_keeps_the_ranks(coordinator):
    c, path, journal, _ = coordinator
    first = c.session
    path.write_text(edited(BASE, MEMORY_GUARD_GB="7"))
    preview = c.diff()
    assert preview.ok and "MEMORY_GUARD_GB: '1.5' -> '7' (applies at once)" in preview.message
    assert c.session is first  # diff changes nothing
    outcome = c.apply("root")
    assert outcome.ok and "the ranks kept running" in outcome.message
    assert first.stopped is False  # the old session let go of the ranks without stopping them
    assert c.session.started == (True, (), None)  # it re-adopts them
    assert c.session.cfg.number("MEMORY_GUARD_GB") == 7.0
    assert c._store.applied() == path.read_text() and c._store.previous() == BASE
    assert "DSV41_EVENT=config_applied" in journal.getvalue()
    assert c.apply("root").message == "cluster.env is what runs: nothing to apply"


def test_a_rank_side_change_restarts_the_ranks_once_under_a_rollout_that_brings_the_old_one_back(coordinator):
    c, path, journal, spawned = coordinator
    new_text = edited(BASE, NCCL_DEBUG="INFO")
    path.write_text(new_text)
    outcome = c.apply("root")
    assert outcome.ok and outcome.diff.rank_keys == ("NCCL_DEBUG",)
    autostart, restart_for, rollout = c.session.started
    assert autostart and restart_for == ("NCCL_DEBUG",) and rollout.keys == ("NCCL_DEBUG",)
    assert rollout.confirm_s == 300.0
    rollout.roll_back("the bring-up failed at health: rank 0 did not answer")
    assert len(spawned) == 1 and c.session.text == new_text  # the rollback runs beside the supervisor
    spawned[0]()
    assert c.session.text == BASE
    assert c.session.started[0] is True and c.session.started[2] is None  # no rollout of the rollback
    assert c._store.applied() == BASE and c._store.rejected().sha256 == digest(new_text)
    assert "health" in c._store.rejected().why


def test_a_rank_side_change_to_a_stopped_cluster_starts_nothing(coordinator):
    c, path, _, _ = coordinator
    c.session.runtime.phase = Phase.STOPPED
    path.write_text(edited(BASE, NCCL_DEBUG="INFO"))
    outcome = c.apply("root")
    assert outcome.ok and "next `dsv41ctl start`" in outcome.message
    assert c.session.started == (False, (), None)


def test_rollback_on_request_and_refused_with_nothing_before(coordinator):
    c, path, _, _ = coordinator
    refused = c.rollback("root")
    assert not refused.ok and "nothing to roll back to" in refused.message
    new_text = edited(BASE, NCCL_DEBUG="INFO")
    path.write_text(new_text)
    c.apply("root")
    outcome = c.rollback("root")
    assert outcome.ok and c.session.text == BASE
    assert c.session.started[1] == ("NCCL_DEBUG",) and c.session.started[2] is None
    assert c._store.rejected().sha256 == digest(new_text)  # a restart does not bring the change back
    assert first_config(str(path), c._store)[1] == BASE


def test_status_notes_a_file_edited_but_not_applied_and_one_that_was_rolled_back(coordinator):
    c, path, _, spawned = coordinator
    assert c.note() == ""
    new_text = edited(BASE, NCCL_DEBUG="INFO")
    path.write_text(new_text)
    assert "differs from the running configuration: `dsv41ctl config diff`" in c.note()
    c.apply("root")
    assert c.note() == ""
    c.session.started[2].roll_back("the bring-up failed at launch: rank 0 exited")
    spawned[0]()
    note = c.note()
    assert "holds a change that was rolled back (the bring-up failed at launch: rank 0 exited)" in note, note


def test_dsv41ctl_status_shows_the_configuration_note():
    from coordinator.ctl_cluster import render_status
    from dsv41.v1 import control_pb2 as pb
    out = io.StringIO()
    render_status(pb.ClusterStatus(phase="serving", coordinator_running=True,
                                   config_note="/etc/dsv41/cluster.env differs from the running configuration"),
                  out, now=0.0, width=120)
    assert "  /etc/dsv41/cluster.env differs from the running configuration" in out.getvalue()
    quiet = io.StringIO()
    render_status(pb.ClusterStatus(phase="serving", coordinator_running=True), quiet, now=0.0, width=120)
    assert "differs" not in quiet.getvalue()
