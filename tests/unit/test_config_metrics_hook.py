"""The keys of metrics and alerts (METRICS_LISTEN, INCIDENT_HOOK ...), and $HOME from the environment."""

import os

import pytest

from coordinator import config, hook
from tests.configtext import HOME, SEED_TEXT, edited, line_of

pytestmark = pytest.mark.unit


def errors_of(text, environ=HOME, file_problem=None):
    with pytest.raises(config.ConfigInvalid) as info:
        config.parse(text, "/etc/dsv41/cluster.env", environ, file_problem)
    return [str(e) for e in info.value.errors]


def test_defaults_serve_metrics_on_9441_and_run_no_hook():
    cfg = config.parse(SEED_TEXT, "/etc/dsv41/cluster.env", HOME)
    assert str(cfg.optional_listen("METRICS_LISTEN")) == "0.0.0.0:9441" and cfg.number("METRICS_POLL_S") == 5.0
    assert cfg.optional_text("INCIDENT_HOOK") is None
    assert cfg.number("INCIDENT_HOOK_TIMEOUT_S") == 10.0


@pytest.mark.parametrize("value, host, port", [("127.0.0.1:9100", "127.0.0.1", 9100), ("[::]:9441", "::", 9441),
                                               ("[::1]:1", "::1", 1)])
def test_metrics_listen_accepts_ipv4_and_bracketed_ipv6(value, host, port):
    cfg = config.parse(edited(METRICS_LISTEN=value), "/etc/dsv41/cluster.env", HOME)
    assert (cfg.optional_listen("METRICS_LISTEN").host, cfg.optional_listen("METRICS_LISTEN").port) == (host, port)


def test_an_empty_metrics_listen_turns_metrics_off():
    cfg = config.parse(edited(METRICS_LISTEN=""), "/etc/dsv41/cluster.env", HOME)
    assert not cfg.optional_listen("METRICS_LISTEN")


@pytest.mark.parametrize("value", ["9441", "localhost:9441", "0.0.0.0:0", "0.0.0.0:70000", "::1:9441", "0.0.0.0:x"])
def test_a_bad_metrics_listen_says_what_is_allowed(value):
    text = edited(METRICS_LISTEN=value)
    (error,) = errors_of(text)
    assert error.startswith(f"cluster.env:{line_of(text, 'METRICS_LISTEN')}: METRICS_LISTEN={value}: ")
    assert "ADDRESS:PORT" in error and "0.0.0.0:9441" in error


def test_metrics_port_may_not_be_a_port_the_head_already_uses():
    (error,) = errors_of(edited(METRICS_LISTEN="0.0.0.0:8888"))
    assert "METRICS_LISTEN=0.0.0.0:8888: port 8888 is already PORT on the head" in error


@pytest.mark.parametrize("key, value", [("METRICS_POLL_S", "0.1"), ("METRICS_POLL_S", "301"),
                                        ("INCIDENT_HOOK_TIMEOUT_S", "0"), ("INCIDENT_HOOK_TIMEOUT_S", "601"),
                                        ("INCIDENT_HOOK", "hooks/alert")])
def test_ranges_of_the_new_keys(key, value):
    (error,) = errors_of(edited(**{key: value}))
    assert f"{key}={value}: must be" in error


def test_the_hook_file_is_checked_with_its_line(tmp_path):
    text = edited(INCIDENT_HOOK="/etc/dsv41/alert")
    (error,) = errors_of(text, file_problem=lambda path: f"{path}: no such file")
    assert error == f"cluster.env:{line_of(text, 'INCIDENT_HOOK')}: INCIDENT_HOOK=/etc/dsv41/alert: " \
                    "/etc/dsv41/alert: no such file"


def test_load_checks_the_hook_file_on_disk(tmp_path):
    script = tmp_path / "alert"
    script.write_text("#!/bin/sh\nexit 0\n")
    path = tmp_path / "cluster.env"
    path.write_text(edited(INCIDENT_HOOK=str(script)))
    script.chmod(0o644)
    with pytest.raises(config.ConfigInvalid) as info:
        config.load(path, HOME)
    assert "is not executable (mode 0644): chmod 755 it" in str(info.value)
    script.chmod(0o755)
    if os.geteuid() == 0:
        assert config.load(path, HOME).optional_text("INCIDENT_HOOK") == str(script)
    else:
        with pytest.raises(config.ConfigInvalid, match="must be owned by root"):
            config.load(path, HOME)


def test_file_problem_refuses_what_another_user_could_change(tmp_path):
    script = tmp_path / "alert"
    script.write_text("#!/bin/sh\n")
    root_owned = lambda mode: lambda path: os.stat_result((mode, 0, 0, 1, 0, 0, 10, 0, 0, 0))  # noqa: E731
    assert hook.file_problem(str(script), root_owned(0o100755)) is None
    assert "writable by group or other (mode 0775)" in hook.file_problem(str(script), root_owned(0o100775))
    assert "writable by group or other (mode 0757)" in hook.file_problem(str(script), root_owned(0o100757))
    assert "must be a regular file" in hook.file_problem(str(script), root_owned(0o040755))
    other = lambda path: os.stat_result((0o100755, 0, 0, 1, 1000, 0, 10, 0, 0, 0))  # noqa: E731
    assert "owned by uid 1000" in hook.file_problem(str(script), other)
    assert hook.file_problem(str(tmp_path / "missing")) == "no such file"


def test_home_from_the_environment_is_a_warning_that_names_the_fix():
    cfg = config.parse(SEED_TEXT, "/etc/dsv41/cluster.env", {"HOME": "/home/op"})
    (warning,) = [w for w in cfg.warnings if "$HOME" in w]
    assert "comes from the environment of the process reading the file (here '/home/op')" in warning
    assert "define HOME=/home/USER as the first line" in warning
    assert cfg.text("MODEL_DIR") == "/home/op/NewModels/DeepSeek-V4.1-Flash"  # the recipe's file still loads


def test_home_defined_in_the_file_gives_no_warning():
    cfg = config.parse("HOME=/home/spark\n" + SEED_TEXT, "/etc/dsv41/cluster.env", {"HOME": "/root"})
    assert not [w for w in cfg.warnings if "$HOME" in w]
    assert cfg.text("MODEL_DIR") == "/home/spark/NewModels/DeepSeek-V4.1-Flash"


def test_home_undefined_everywhere_is_an_error_that_names_the_fix():
    errors = errors_of(SEED_TEXT, environ={})
    home = [e for e in errors if "$HOME" in e]
    assert home and all("define HOME=/home/USER as the first line" in e for e in home)
