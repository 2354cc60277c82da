"""The worker's mount: unit states, the requested spec kept across agent restarts, refusals while
the rank runs, stale tracking (agent.nfs.mount). The unit's real lifecycle under systemd is in
tests/integration/test_mount_unit.py."""

import json
import os
import sys

import pytest

from agent.nfs.errors import Refused
from agent.nfs.health import ProbeRunner
from agent.nfs.mount import DESCRIPTION_PREFIX, MountManager, mount_properties, unit_verdict
from agent.nfs.spec import check_mount
from agent.nfs.units import UnitState
from tests.unit.test_nfs_exports import Events

pytestmark = pytest.mark.unit


class MountUnits:
    """A systemd that mounts instantly: the unit is 'active' once started, with a new InvocationID."""

    def __init__(self):
        self.units = {}
        self.calls = []

    def state(self, name, iface=None):
        u = self.units.get(name)
        if u is None:
            return UnitState(name, "", "inactive", "", "", False, "", {})
        return UnitState(name, "loaded", u["active"], u.get("sub", ""), u.get("result", ""), u["transient"],
                         u["description"], {"What": u.get("What", ""), "InvocationID": u["invocation"]})

    def start_transient(self, name, props, timeout_s):
        self.calls.append(("start_transient", name, {k: v for k, _, v in props}))
        p = {k: v for k, _, v in props}
        self.units[name] = {"active": "active", "transient": True, "description": p["Description"],
                            "What": p["What"], "invocation": os.urandom(16)}
        return "done"

    def stop(self, name, timeout_s):
        self.calls.append(("stop", name))
        self.units.pop(name, None)
        return "done"

    def reset_failed(self, name):
        self.calls.append(("reset_failed", name))


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def spec(what, where, shards=2):
    return check_mount(what=what, where=where, type="none", options="bind,ro,nosuid,nodev", server="", expected_shards=shards,
                       allowed_types=("none",))


@pytest.fixture
def setup(tmp_path):
    src = tmp_path / "export"
    src.mkdir()
    (src / "config.json").write_text("{}")
    for i in (1, 2):
        (src / f"model-{i:05d}-of-00002.safetensors").write_bytes(b"\x02" + b"\0" * 7 + b"{}" + b"\0" * 8)
    units, events, clock = MountUnits(), Events(), Clock()
    state_file = tmp_path / "state/mount.json"

    def make(probe=None):
        return MountManager(units, probe or ProbeRunner(timeout_s=20), events, str(state_file), monotonic=clock,
                            sleep=lambda s: None)
    # A bind "mount" that the fake systemd does not perform: the probe reads the source itself.
    return make, units, events, clock, src, state_file


def test_unit_states_map_to_mount_states():
    s = spec("/srv/a", "/srv/b")
    unit = "srv-b.mount"
    mine = dict(transient=True, description=f"{DESCRIPTION_PREFIX} (/srv/a)", props={})
    assert unit_verdict(s, UnitState(unit, "", "inactive", "", "", False, "", {})).state == "absent"
    failed = unit_verdict(s, UnitState(unit, "loaded", "failed", "failed", "exit-code", **mine))
    assert failed.state == "failed" and "result exit-code): see journalctl -u srv-b.mount" in failed.detail
    assert unit_verdict(s, UnitState(unit, "loaded", "activating", "mounting", "", **mine)).state == "mounting"
    assert unit_verdict(s, UnitState(unit, "loaded", "deactivating", "unmounting", "", **mine)).state == "mounting"
    foreign = unit_verdict(s, UnitState(unit, "loaded", "active", "mounted", "", False, "/srv/b",
                                        {"What": "/dev/sdb1"}))
    assert foreign.state == "failed" and "What=/dev/sdb1), which dsv41 did not create" in foreign.detail
    assert unit_verdict(s, UnitState(unit, "loaded", "active", "mounted", "", **mine)) is None


def test_mount_unit_properties():
    s = check_mount(what="10.0.22.1:/", where="/var/tmp/DeepSeek-V4.1-Flash", type="nfs4",
                    options="nfsvers=4.2,ro,nosuid,nodev,hard", server="10.0.22.1", expected_shards=48)
    props = {k: (sig, v) for k, sig, v in mount_properties(s, 90)}
    assert props["What"] == ("s", "10.0.22.1:/") and props["Where"] == ("s", "/var/tmp/DeepSeek-V4.1-Flash")
    assert props["Type"] == ("s", "nfs4") and props["Options"] == ("s", "nfsvers=4.2,ro,nosuid,nodev,hard")
    assert props["TimeoutUSec"] == ("t", 90_000_000) and props["LazyUnmount"] == ("b", True)
    assert props["ForceUnmount"] == ("b", True)
    bind = dict((k, v) for k, _, v in mount_properties(spec("/srv/a", "/srv/b"), 90))
    assert bind["ForceUnmount"] is False  # umount -f of a bind onto FUSE would abort the FUSE connection


def test_ensure_creates_the_unit_and_reports_health(setup, tmp_path):
    make, units, events, _, src, state_file = setup
    m = make()
    where = str(src)  # the fake does not mount; probing Where finds the export's content
    state = m.ensure(spec("/srv/nfs-export", where), rank_running=False)
    assert state.state == "healthy" and state.shards_seen == 2 and state.unit.endswith(".mount")
    assert [c[0] for c in units.calls] == ["start_transient"]
    assert json.loads(state_file.read_text())["what"] == "/srv/nfs-export"
    assert oct(state_file.stat().st_mode & 0o777) == "0o600"
    again = m.ensure(spec("/srv/nfs-export", where), rank_running=True)  # same spec: nothing to do
    assert again.state == "healthy" and len(units.calls) == 1
    assert ("info", "mount_healthy") in [(p, k) for p, k, _ in events.seen]
    # The agent restarts: the spec comes back from the state directory.
    restarted = make()
    assert restarted.snapshot().state == "unchecked" and restarted.snapshot().where == where
    calls = len(units.calls)
    assert restarted.get().state == "healthy" and restarted.snapshot().state == "healthy"
    assert len(units.calls) == calls


def test_changes_under_a_running_rank_are_refused(setup):
    make, units, _, _, src, state_file = setup
    m = make()
    m.ensure(spec("/srv/nfs-export", str(src)), rank_running=False)
    with pytest.raises(Refused, match="the rank is running and reads its weights from .*: stop the rank first"):
        m.ensure(spec("/srv/other-export", str(src)), rank_running=True)
    with pytest.raises(Refused, match="stop the rank first, then remount"):
        m.remount(rank_running=True)
    with pytest.raises(Refused, match="stop the rank first, then unmount it"):
        m.remove(rank_running=True)
    assert [c[0] for c in units.calls] == ["start_transient"]
    replaced = m.ensure(spec("/srv/other-export", str(src)), rank_running=False)
    assert replaced.what == "/srv/other-export" and [c[0] for c in units.calls][-2:] == ["stop", "start_transient"]
    removed = m.remove(rank_running=False)
    assert removed.state == "absent" and removed.detail == "removed" and not state_file.exists()
    assert units.units == {}
    assert m.get().detail == "no mount requested"
    with pytest.raises(Refused, match="EnsureMount first"):
        m.remount(rank_running=False)


def test_a_foreign_mount_on_where_is_not_touched(setup):
    make, units, _, _, src, _ = setup
    m = make()
    from agent.nfs.paths import unit_name_for_path
    units.units[unit_name_for_path(str(src))] = {"active": "active", "transient": False, "description": "x",
                                                 "What": "/dev/sdb1", "invocation": b"1"}
    with pytest.raises(Refused, match="already a mount point .*What=/dev/sdb1.*dsv41 did not create"):
        m.ensure(spec("/srv/nfs-export", str(src)), rank_running=False)
    assert units.calls == []


def test_stale_mount_reports_how_long_and_remount_clears_it(setup):
    make, units, events, clock, src, _ = setup
    hang = [sys.executable, "-c", "import time; print('step stat', flush=True); time.sleep(60)"]
    m = make(ProbeRunner(argv=hang, timeout_s=0.3))
    first = m.ensure(spec("/srv/nfs-export", str(src)), rank_running=False)
    assert first.state == "stale" and first.stale_for_s == 0.0
    assert "stat of " + str(src) + " did not return within 0.3 s" in first.detail
    clock.now += 7.5
    later = m.get()
    assert later.state == "stale" and later.stale_for_s == pytest.approx(7.5)
    clock.now += 1.0
    assert m.snapshot().stale_for_s == pytest.approx(8.5)  # GetStatus: no probe, age kept current
    assert [k for _, k, _ in events.seen].count("mount_stale") == 1
    remounted = m.remount(rank_running=False)
    assert remounted.state == "stale" and remounted.stale_for_s == 0.0  # a new mount instance: counted afresh
    assert [c[0] for c in units.calls] == ["start_transient", "stop", "start_transient"]
