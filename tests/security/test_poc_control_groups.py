"""Finding 6 on a booted head, with real users: every member of the dsv41 group could stop, restart
and force-unexport, and the journal did not say who. Now members of dsv41-read only read (through
status.sock), members of dsv41 control, and every action is a journal event with the caller's uid,
taken from the kernel (SO_PEERCRED), not from anything the caller says."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from testbed.nspawn import Node
from tests.integration.agentnode import REPO, SRC, free_port, wait
from tests.integration.simcluster import cluster_env
from tests.integration.test_security import ctl

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def head(rootfs):
    node = Node("sec-poc4", rootfs)
    node.boot()
    try:
        node.run(["groupadd", "--system", "dsv41"])
        node.run(["groupadd", "--system", "dsv41-read"])
        node.run(["useradd", "--no-create-home", "--groups", "dsv41-read", "watcher"])
        node.run(["useradd", "--no-create-home", "--groups", "dsv41", "operator1"])
        node.run(["useradd", "--no-create-home", "passerby"])
        for part in ("coordinator", "dsv41", "adapter"):  # adapter/: dsv41-coordinator depends on dsv41-adapter
            node.copy_in(REPO / part, f"{SRC}/{part}")
        nodes = {"spark1": SimpleNamespace(address="127.0.0.1"), "spark2": SimpleNamespace(address="127.0.0.2")}
        node.write_file("/etc/dsv41/cluster.env", cluster_env(nodes, AGENT_PORT=str(free_port())))
        node.run(["systemd-run", "--unit=dsv41-coordinator", f"--setenv=PYTHONPATH={SRC}",
                  f"--property=WorkingDirectory={SRC}", "/usr/bin/python3", "-m", "coordinator.daemon",
                  "--config", "/etc/dsv41/cluster.env", "--no-autostart"])
        assert wait(lambda: node.run(["test", "-S", "/run/dsv41/status.sock"], check=False).returncode == 0,
                    timeout=30), node.journal(unit="dsv41-coordinator")
        yield node
    finally:
        node.stop()


def uid(node: Node, user: str) -> str:
    return node.run(["id", "-u", user]).stdout.strip()


def test_the_sockets_belong_to_their_groups(head):
    modes = head.run(["stat", "-c", "%n %a %U %G", "/run/dsv41/control.sock", "/run/dsv41/status.sock",
                      "/run/dsv41/private"]).stdout.splitlines()
    assert modes == ["/run/dsv41/control.sock 660 root dsv41", "/run/dsv41/status.sock 660 root dsv41-read",
                     "/run/dsv41/private 700 root root"]


def test_a_reader_reads_and_cannot_act(head):
    # "starting" until the coordinator's search for running ranks ends, then "stopped" (--no-autostart)
    assert wait(lambda: "CLUSTER: STARTING" not in ctl(head, "status", user="watcher").stdout.upper(), timeout=60)
    status = ctl(head, "status", user="watcher")
    assert status.returncode == 1 and "STOPPED" in status.stdout.upper(), (status.stdout, status.stderr)
    events = ctl(head, "events", user="watcher")
    assert events.returncode == 0, events.stderr
    for action in (("stop",), ("restart",), ("share", "unexport", "--force"), ("autotune", "reset"),
                   ("config", "apply"), ("config", "rollback"), ("config", "diff")):
        refused = ctl(head, *action, user="watcher")
        assert refused.returncode == 4, (action, refused.stdout, refused.stderr)
        assert "add yourself to the dsv41 group" in refused.stderr and "dsv41-read may only read" in refused.stderr
    outsider = ctl(head, "status", user="passerby")
    assert outsider.returncode == 4 and "dsv41-read group" in outsider.stderr


def test_every_action_names_the_callers_uid(head):
    def control_calls():
        return head.journal(unit="dsv41-coordinator.service", fields=None, matches=["DSV41_EVENT=control_call"])

    before = len(control_calls())
    stopped = ctl(head, "stop", user="operator1")
    assert stopped.returncode == 0 and "stop requested (by operator1)" in stopped.stdout, stopped.stderr
    forced = ctl(head, "share", "unexport", "--force", user="operator1")
    assert forced.returncode in (0, 1), forced.stderr  # whatever the head's agent answers, the caller is named
    deadline = time.monotonic() + 10
    while True:
        calls = control_calls()
        if len(calls) >= before + 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    new = calls[before:]
    assert [c["DSV41_METHOD"] for c in new] == ["Stop", "UnexportShare(force)"], new
    assert {c["DSV41_CALLER_UID"] for c in new} == {uid(head, "operator1")}
    assert {c["DSV41_CALLER_USER"] for c in new} == {"operator1"}
    assert all(c["PRIORITY"] == "5" and c["DSV41_SOCKET"] == "control" for c in new)
    root = ctl(head, "stop")
    assert root.returncode == 0
    assert wait(lambda: any(c.get("DSV41_CALLER_UID") == "0" for c in control_calls()), timeout=10)
