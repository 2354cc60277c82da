"""The rank container's processes (agent/container.py): found by the id the client wrote, under
either of docker's cgroup drivers, and signalled beside the rank unit by the node floor (the real
/proc and systemd scope: tests/integration/test_guard_memory.py, the node floor case)."""

import signal

import pytest

from agent import container as c

pytestmark = pytest.mark.unit

CID = "3f" * 32
OTHER = "a1" * 32
SYSTEMD_DRIVER = f"0::/system.slice/docker-{CID}.scope\n"
CGROUPFS_DRIVER = f"12:memory:/docker/{CID}\n11:pids:/docker/{CID}\n0::/docker/{CID}\n"


def proc_tree(tmp_path, processes):
    """A /proc with a cgroup file per pid, and the cidfile the client writes."""
    proc = tmp_path / "proc"
    proc.mkdir()
    for pid, text in processes.items():
        (proc / str(pid)).mkdir()
        (proc / str(pid) / "cgroup").write_text(text)
    (proc / "self").mkdir()  # not a pid: skipped
    (proc / "meminfo").write_text("MemTotal: 1 kB\n")
    return proc


def processes(tmp_path, tree, cid=CID, cgroup_root=None):
    cidfile = tmp_path / "container.id"
    if cid is not None:
        cidfile.write_text(cid + "\n")
    sent = []
    found = c.ContainerProcesses(str(cidfile), str(proc_tree(tmp_path, tree)),
                                 str(cgroup_root or tmp_path / "cgroup"), lambda pid, sig: sent.append((pid, sig)))
    return found, sent


@pytest.mark.parametrize("driver", [SYSTEMD_DRIVER, CGROUPFS_DRIVER])
def test_the_containers_processes_are_signalled_and_no_other(tmp_path, driver):
    found, sent = processes(tmp_path, {
        41: driver, 42: driver,
        7: "0::/system.slice/dsv41-rank.service\n",  # the docker client in the rank unit
        9: f"0::/system.slice/docker-{OTHER}.scope\n",  # another container
        11: f"0::/user.slice/x-{CID}.scope\n",  # the id inside a name that is not docker's
    })
    done = found.signal(signal.SIGTERM)
    assert sorted(sent) == [(41, signal.SIGTERM), (42, signal.SIGTERM)]
    assert done == c.Signalled(CID, (41, 42))
    assert done.note() == f"; sent also to the 2 process(es) of container {CID[:12]}"


def test_sigkill_also_writes_the_containers_cgroup_kill(tmp_path):
    scope = tmp_path / "cgroup" / "system.slice" / f"docker-{CID}.scope"
    scope.mkdir(parents=True)
    (scope / "cgroup.kill").write_text("")
    found, sent = processes(tmp_path, {41: SYSTEMD_DRIVER})
    found.signal(signal.SIGTERM)
    assert (scope / "cgroup.kill").read_text() == ""  # only SIGKILL: SIGTERM leaves the launcher its handler
    found.signal(signal.SIGKILL)
    assert (scope / "cgroup.kill").read_text() == "1"
    assert sent == [(41, signal.SIGTERM), (41, signal.SIGKILL)]


def test_without_cgroup_kill_the_scans_sigkills_stand(tmp_path):
    found, sent = processes(tmp_path, {41: CGROUPFS_DRIVER})  # no cgroup directory at all
    assert found.signal(signal.SIGKILL).pids == (41,)
    assert sent == [(41, signal.SIGKILL)]


def test_no_cidfile_is_no_container_and_nothing_is_scanned(tmp_path):
    found, sent = processes(tmp_path, {41: SYSTEMD_DRIVER}, cid=None)
    done = found.signal(signal.SIGKILL)
    assert done == c.Signalled("") and done.note() == "" and sent == []


def test_a_cidfile_that_is_not_an_id_is_an_error_not_a_scan(tmp_path):
    found, sent = processes(tmp_path, {41: SYSTEMD_DRIVER}, cid="../../etc")
    with pytest.raises(ValueError, match="not a container id .*expected 64 hex digits"):
        found.signal(signal.SIGTERM)
    assert sent == []


def test_a_process_that_ends_during_the_scan_or_before_its_signal_is_skipped(tmp_path):
    def send(pid, sig):
        if pid == 41:
            raise ProcessLookupError(pid)
        sent.append(pid)
    sent = []
    cidfile = tmp_path / "container.id"
    cidfile.write_text(CID)
    proc = proc_tree(tmp_path, {41: SYSTEMD_DRIVER, 42: SYSTEMD_DRIVER})
    (proc / "43").mkdir()  # its cgroup file already gone
    assert c.ContainerProcesses(str(cidfile), str(proc), str(tmp_path), send).signal(signal.SIGTERM).pids == (41, 42)
    assert sent == [42]


def test_a_container_with_no_process_left_signals_nothing(tmp_path):
    found, sent = processes(tmp_path, {7: "0::/system.slice/dsv41-rank.service\n"})
    done = found.signal(signal.SIGTERM)
    assert done == c.Signalled(CID, ()) and sent == []
    assert "0 process(es)" in done.note()


class Container:
    def __init__(self, result=None, error=None):
        self.result, self.error, self.signals = result or c.Signalled(""), error, []

    def signal(self, signum):
        self.signals.append(signum)
        if self.error:
            raise self.error
        return self.result


def test_the_floor_signal_reaches_the_unit_and_the_container():
    unit, box = [], Container(c.Signalled(CID, (41, 42)))
    note = c.signal_rank(unit.append, box, signal.SIGTERM)
    assert unit == [signal.SIGTERM] and box.signals == [signal.SIGTERM]
    assert "2 process(es) of container" in note


def test_a_unit_that_cannot_be_signalled_does_not_spare_the_container():
    def unit(signum):
        raise RuntimeError("systemd busy")
    box = Container(c.Signalled(CID, (41,)))
    with pytest.raises(RuntimeError, match="systemd busy"):
        c.signal_rank(unit, box, signal.SIGKILL)
    assert box.signals == [signal.SIGKILL]


def test_a_container_that_cannot_be_read_is_raised_after_the_unit_was_signalled():
    unit, box = [], Container(error=ValueError("not a container id"))
    with pytest.raises(ValueError, match="not a container id"):
        c.signal_rank(unit.append, box, signal.SIGTERM)
    assert unit == [signal.SIGTERM]

