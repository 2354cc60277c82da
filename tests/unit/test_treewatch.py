"""The rank's first process to end, seen through real processes and a control group's file."""

import subprocess
import time

import pytest

from agent.treewatch import ProcessTreeWatch, process_stopped, process_title, watched

pytestmark = pytest.mark.unit


class Rank:
    def __init__(self, main: int) -> None:
        self.invocation, self.main, self.losses = "run-1", main, []

    def floor(self):
        return self.invocation, None

    def main_pid(self):
        return self.main

    def control_group(self):
        return "/system.slice/dsv41-rank.service"

    def note_first_loss(self, invocation_id, at_unix_s, detail):
        self.losses.append((invocation_id, at_unix_s, detail))


def titled(title: str) -> subprocess.Popen:
    return subprocess.Popen(["bash", "-c", f"exec -a {title} sleep 60"])


@pytest.fixture
def tree(tmp_path):
    made = []

    def start(*titles: str):
        procs = [titled(t) for t in titles]
        made.extend(procs)
        group = tmp_path / "system.slice" / "dsv41-rank.service"
        group.mkdir(parents=True, exist_ok=True)
        (group / "cgroup.procs").write_text("".join(f"{p.pid}\n" for p in procs))
        deadline = time.monotonic() + 5
        while not all(process_title("/proc", p.pid) == t for p, t in zip(procs, titles)):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        return procs

    yield start
    for p in made:
        p.kill()
        p.wait()


def test_the_first_sglang_process_to_end_is_reported_once_with_the_clock_of_its_end(tree, tmp_path):
    main, scheduler, helper = tree("python3", "sglang::scheduler_TP0", "compile-helper")
    rank = Rank(main.pid)
    watch = ProcessTreeWatch(rank, (str(tmp_path),), clock=lambda: 1234.5, scan_s=0.05)
    watch.scan()
    helper.kill()  # a helper that SGLang does not name is not the rank
    helper.wait()
    watch._wait()
    assert rank.losses == []
    scheduler.kill()
    scheduler.wait()
    deadline = time.monotonic() + 5
    while not rank.losses and time.monotonic() < deadline:
        watch.scan()
        watch._wait()
    assert rank.losses == [("run-1", 1234.5, f"sglang::scheduler_TP0 (pid {scheduler.pid})")]
    main.kill()
    main.wait()
    watch.scan()
    watch._wait()
    assert len(rank.losses) == 1  # the rest of the run's end is not news
    rank.invocation = "run-2"  # a new run is watched afresh
    watch.scan()
    assert rank.losses[-1][0] == "run-1"
    watch.stop()


def test_the_main_process_ending_first_is_left_to_systemds_report(tree, tmp_path):
    main, scheduler = tree("python3", "sglang::scheduler_TP1")
    rank = Rank(main.pid)
    watch = ProcessTreeWatch(rank, (str(tmp_path),), clock=lambda: 1.0, scan_s=0.05)
    watch.scan()
    main.kill()
    main.wait()
    rank.main = 0  # systemd's MainPID once the main process is gone
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        watch._wait()
    scheduler.kill()  # what systemd's kill of the rest of the unit would do
    scheduler.wait()
    watch.scan()
    watch._wait()
    assert rank.losses == []
    watch.stop()


def test_what_is_watched():
    assert watched(10, 10, "/opt/dsv41-engine/bin/python")
    assert watched(11, 10, "sglang::detokenizer")
    assert not watched(12, 10, "/opt/dsv41-engine/bin/python")  # a multiprocessing helper


def test_a_stopped_process_is_seen_as_stopped_and_a_running_or_gone_one_is_not(tree):
    (proc,) = tree("sglang::scheduler_TP1")
    assert not process_stopped(proc.pid)
    proc.send_signal(19)  # SIGSTOP
    deadline = time.monotonic() + 5
    while not process_stopped(proc.pid):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(18)  # SIGCONT
    proc.kill()
    proc.wait()
    assert not process_stopped(proc.pid)
