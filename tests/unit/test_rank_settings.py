"""One declaration per rank-side setting (dsv41/rankadapters.py): the coordinator's cluster.env key
and the rank's reading of the variable accept and refuse the same values (but the flag words only the
rank reads), and default alike."""

from __future__ import annotations

import pytest

from coordinator import schema
from coordinator.values import Invalid
from dsv41 import rankadapters
from dsv41.ranksettings import Kind, SettingError

pytestmark = pytest.mark.unit

CONFIG_SETTINGS = [s for s in rankadapters.settings().values() if s.in_cluster_env]
SAMPLES = ("0", "1", "2", "-1", "3", "4", "x", "yes", "off", "0.5", "1.5", "16", "17", "64", "1000", "1001",
           "1024", "1025", "4096", "4097", "10000", "10001", "86400", "86401", "1048576", "1048577", "nvme", "host",
           "disk", "b12x", "cutlass", "/srv/engram", "engram", "conf:0.1", "conf:2", "high", "max", "101", "nan")


def test_every_declared_cluster_env_setting_is_a_key_passed_to_the_rank_as_declared() -> None:
    for setting in CONFIG_SETTINGS:
        key = schema.BY_NAME[setting.name]
        assert (key.default, key.doc, key.to_rank_env) == (setting.default, setting.help, True), setting.name
    # The plan's own variables are not keys an operator writes.
    assert "DSV41_ADMISSION_GUARD_BYTES" not in schema.BY_NAME and "DSV41_PROGRESS_DIR" not in schema.BY_NAME


@pytest.mark.parametrize("setting", [s for s in CONFIG_SETTINGS if s.kind not in
                                     (Kind.VERIFY_CAP, Kind.REASONING_EFFORT)], ids=lambda s: s.name)
def test_the_coordinator_refuses_exactly_what_the_rank_refuses(setting) -> None:
    parse = schema.BY_NAME[setting.name].parse
    for raw in SAMPLES:
        try:
            parse(raw)
            config_ok = True
        except Invalid:
            config_ok = False
        try:
            setting.read({setting.name: raw})
            rank_ok = True
        except SettingError:
            rank_ok = False
        # A flag in cluster.env is 1 or 0; the rank also reads the words (true/false, yes/no, on/off)
        # a hand-written environment may hold. Otherwise both sides draw the same line.
        words = setting.kind is Kind.FLAG and raw in ("yes", "off")
        assert config_ok == rank_ok or (words and rank_ok and not config_ok), (setting.name, raw)
    # cluster.env's default is a value the rank accepts
    setting.read({setting.name: setting.default})


def test_an_absent_variable_reads_as_declared() -> None:
    assert rankadapters.DSV41_WO_A_W8.read({}) is False and rankadapters.DSV41_WO_A_W8.read({"DSV41_WO_A_W8": "1"})
    assert rankadapters.DSV41_LOOP_NGRAM.read({"DSV41_LOOP_NGRAM": " "}) == 32
    assert rankadapters.OFFLOAD_MODE.read({}) == "" and rankadapters.DSV41_PACKED_DIR.read({}) == "/engram"
    with pytest.raises(SettingError, match=r"DSV41_DRAFT_TAU='0': outside the allowed range \(0, 1\]"):
        rankadapters.DSV41_DRAFT_TAU.read({"DSV41_DRAFT_TAU": "0"})
