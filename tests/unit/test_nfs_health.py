"""Mount health: the probe child on real directories, the runner's deadline and its bookkeeping
of children that will not die, and what each outcome means (agent.nfs.probe, agent.nfs.health)."""

import json
import os
import signal
import struct
import sys
import threading

import pytest

from agent.nfs import probe
from agent.nfs.health import HEALTHY, STALE, WRONG_CONTENT, ProbeOutcome, ProbeRunner, judge

pytestmark = pytest.mark.unit


def shard(path, header=b'{"__metadata__":{}}', payload=b"\0" * 16):
    path.write_bytes(struct.pack("<Q", len(header)) + header + payload)


def model(tmp_path, n=3, total=None, config='{"model_type": "deepseek_v4"}'):
    d = tmp_path / "model"
    d.mkdir()
    if config is not None:
        (d / "config.json").write_text(config)
    for i in range(1, n + 1):
        shard(d / f"model-{i:05d}-of-{total or n:05d}.safetensors")
    (d / "tokenizer.json").write_text("{}")
    return d


def run_probe(path, expected):
    return judge(ProbeOutcome(True, probe.check(str(path), expected), "shards"), str(path), expected, 5.0)


def test_healthy_model_directory(tmp_path):
    d = model(tmp_path)
    h = run_probe(d, 3)
    assert h.state == HEALTHY and h.shards_seen == 3
    assert h.detail == f"config.json and 3 of 3 shards readable in {d}"


def test_missing_shards_are_named(tmp_path):
    d = model(tmp_path, n=3)
    (d / "model-00002-of-00003.safetensors").unlink()
    h = run_probe(d, 3)
    assert h.state == WRONG_CONTENT and h.shards_seen == 2
    assert "2 of 3 model-*-of-00003.safetensors shards visible, missing 00002" in h.detail


def test_another_checkpoint_is_wrong_content(tmp_path):
    d = model(tmp_path, n=47)
    h = run_probe(d, 48)
    assert h.state == WRONG_CONTENT and h.shards_seen == 0
    assert "found shards of another checkpoint (47 of 00047)" in h.detail


def test_config_problems(tmp_path):
    d = model(tmp_path, config=None)
    h = run_probe(d, 3)
    assert h.state == WRONG_CONTENT and f"no config.json in {d}" in h.detail and "tokenizer.json" in h.detail
    (d / "config.json").write_text('{"truncated": ')
    assert "config.json: not valid JSON" in run_probe(d, 3).detail


def test_a_shard_that_is_not_safetensors(tmp_path):
    d = model(tmp_path)
    (d / "model-00003-of-00003.safetensors").write_bytes(b"<html>404</html>")
    h = run_probe(d, 3)
    assert h.state == WRONG_CONTENT
    assert "model-00003-of-00003.safetensors: not a safetensors file" in h.detail


def test_not_there(tmp_path):
    h = run_probe(tmp_path / "nothing", 3)
    assert h.state == WRONG_CONTENT and h.detail.startswith(f"stat of {tmp_path / 'nothing'}: ENOENT")


@pytest.mark.parametrize("errno_name", ["ESTALE", "EIO", "ENOTCONN"])
def test_errors_of_a_dead_server_mean_stale(errno_name):
    result = {"error": {"step": "list", "errno": errno_name, "message": "x"}}
    assert judge(ProbeOutcome(True, result, "list"), "/m", 48, 5.0).state == STALE
    result = {"error": None, "config": {"step": "config", "errno": errno_name, "message": "x"}, "seen": 0}
    assert judge(ProbeOutcome(True, result, "config"), "/m", 48, 5.0).state == STALE


def test_unfinished_probe_says_where_it_blocked():
    h = judge(ProbeOutcome(False, None, "list", stuck_pid=4242), "/var/tmp/m", 48, 5.0)
    assert h.state == STALE
    assert h.detail.startswith("directory listing of /var/tmp/m did not return within 5 s (probe pid 4242 stuck")
    reused = judge(ProbeOutcome(False, None, "stat", 4242, reused=True), "/var/tmp/m", 48, 5.0)
    assert "stat of /var/tmp/m is still blocked (probe pid 4242" in reused.detail


def test_probe_child_reports_its_steps_and_result(tmp_path):
    d = model(tmp_path)
    outcome = ProbeRunner(timeout_s=20).run(str(d), 3, "k")
    assert outcome.finished and outcome.step == "shards" and outcome.result["seen"] == 3


SLEEPER = "import sys, time; print('step list', flush=True); time.sleep(60)"


def test_a_probe_past_its_deadline_is_killed_and_reported_stale(tmp_path):
    runner = ProbeRunner(argv=[sys.executable, "-c", SLEEPER], timeout_s=0.5)
    outcome = runner.run("/m", 48, "k")
    assert not outcome.finished and outcome.step == "list" and outcome.stuck_pid == 0  # SIGKILL worked
    assert runner.stuck() == []
    assert judge(outcome, "/m", 48, runner.timeout_s).detail.startswith(
        "directory listing of /m did not return within 0.5 s")


def test_a_child_that_survives_sigkill_is_abandoned_remembered_and_reaped():
    # A process blocked in the kernel (D state) ignores SIGKILL; a kill that does nothing stands in.
    runner = ProbeRunner(argv=[sys.executable, "-c", SLEEPER], timeout_s=0.3, kill_wait_s=0.1,
                         kill=lambda pid, sig: None)
    first = runner.run("/m", 48, "mount#1")
    assert not first.finished and first.stuck_pid > 0
    again = runner.run("/m", 48, "mount#1")
    assert again.reused and again.stuck_pid == first.stuck_pid  # no second child on the same mount
    other = runner.run("/m", 48, "mount#2")  # a remount is a new mount instance: probe it
    assert other.stuck_pid not in (0, first.stuck_pid)
    assert {pid for pid, _, _ in runner.stuck()} == {first.stuck_pid, other.stuck_pid}
    assert all(step == "list" for _, step, _ in runner.stuck())
    for pid, _, _ in runner.stuck():
        os.kill(pid, signal.SIGKILL)  # the kernel call "returns": the child dies and is reaped
    for _ in range(100):
        if not runner.stuck():
            break
        threading.Event().wait(0.02)
    assert runner.stuck() == []


def test_probes_stop_multiplying_when_too_many_are_stuck():
    runner = ProbeRunner(argv=[sys.executable, "-c", SLEEPER], timeout_s=0.2, kill_wait_s=0.05,
                         kill=lambda pid, sig: None, max_stuck=2)
    try:
        runner.run("/m", 48, "a")
        runner.run("/m", 48, "b")
        third = runner.run("/m", 48, "c")
        assert third.reused and "2 probes are stuck" in third.error
        assert len(runner.stuck()) == 2
    finally:
        for pid, _, _ in runner.stuck():
            os.kill(pid, signal.SIGKILL)


def test_concurrent_checks_of_one_mount_share_one_child(tmp_path):
    count = tmp_path / "spawned"
    code = (f"import sys, time, json; open({str(count)!r}, 'a').write('x'); time.sleep(0.3); "
            "print('result ' + json.dumps({'error': None, 'config': {'ok': True}, 'seen': 1}), flush=True)")
    runner = ProbeRunner(argv=[sys.executable, "-c", code], timeout_s=10)
    outcomes = []
    threads = [threading.Thread(target=lambda: outcomes.append(runner.run("/m", 1, "k"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert count.read_text() == "x"
    assert len(outcomes) == 4 and all(o.finished and o.result["seen"] == 1 for o in outcomes)


def test_probe_main_prints_steps_then_one_result(tmp_path, capsys):
    d = model(tmp_path, n=2)
    assert probe.main([str(d), "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines[:-1]] == ["stat", "list", "config", "shards"]
    assert json.loads(lines[-1].removeprefix("result "))["seen"] == 2
    assert probe.main(["only-one"]) == 2
