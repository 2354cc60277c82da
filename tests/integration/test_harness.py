"""The systemd-nspawn harness itself: nodes boot a real systemd, run services, enforce memory
limits when asked, talk TCP over a bridge, and leave nothing behind on the host."""
from __future__ import annotations

import os
import secrets
import subprocess
import time
from pathlib import Path

import pytest

from tests.harness.fixtures import bridge, cluster, node, rootfs  # noqa: F401
from testbed.nspawn import BootError, Cluster, Node

pytestmark = pytest.mark.integration


def _host_pids_in_cgroups_named(fragment: str) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if fragment in (d / "cgroup").read_text():
                    found.append(int(d.name))
            except OSError:
                pass
    return found


def _alive(pid: int, started: str | None = None) -> bool:
    """pid runs (not a zombie) and, if given, is the process that started at `started`
    (so a pid reused by another process after teardown does not count)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return stat[0] != "Z" and (started is None or stat[19] == started)


def _started(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


def _ifindex(name: str) -> str | None:
    try:
        return Path(f"/sys/class/net/{name}/ifindex").read_text().strip()
    except OSError:
        return None


def test_node_boots_and_runs_commands_and_services(node, record_property, capsys):
    n = node("h1")
    result = n.boot_result
    assert result.state in ("running", "degraded")
    # "degraded" must come with the units that caused it, "running" with none.
    assert (result.state == "degraded") == bool(result.failed_units), result
    assert result.failed_units == tuple(n.failed_units())
    record_property("node_boot_seconds", round(result.seconds, 3))
    with capsys.disabled():
        print(f"\n[harness] one node booted to {result.state!r} in {result.seconds:.2f} s")

    assert n.run(["hostname"]).stdout.strip() == "h1"
    r = n.run_service(["systemctl", "show", "--property=ActiveState", "dbus.service"])
    assert r.stdout.strip() == "ActiveState=active"
    # run_service runs under the node's systemd as a transient unit; run() does not.
    assert "/system.slice/run-" in n.run_service(["cat", "/proc/self/cgroup"]).stdout
    assert "/system.slice/" not in n.run(["cat", "/proc/self/cgroup"]).stdout
    failing = n.run_service(["sh", "-c", "echo out; echo err >&2; exit 3"], check=False)
    assert (failing.returncode, failing.stdout, failing.stderr) == (3, "out\n", "err\n")
    assert n.run_service(["cat"], input="piped\n").stdout == "piped\n"
    r = n.run_service(["sh", "-c", "echo $DSV41_X; ulimit -n"],
                      properties={"LimitNOFILE": 1234}, env={"DSV41_X": "set"})
    assert r.stdout == "set\n1234\n"

    token = secrets.token_hex(8)
    src = n.tmpdir / "host-file"
    src.write_text(token)
    n.copy_in(src, "/var/tmp/harness/copied")
    assert n.run_service(["cat", "/var/tmp/harness/copied"]).stdout == token
    assert not (n.rootfs / "var/tmp/harness").exists()  # the base tree stays pristine
    with pytest.raises(ValueError, match="tmpfs"):
        n.copy_in(src, "/tmp/copied")

    # Services run under the node's seccomp filter; run() bypasses it (it is nsenter).
    assert n.run_service(["python3", "-c", OPEN_BY_HANDLE_ERRNO]).stdout.strip() == "EPERM"
    assert n.run(["python3", "-c", OPEN_BY_HANDLE_ERRNO]).stdout.strip() != "EPERM"

    assert n.show("dbus.service", "ActiveState", "SubState") == \
        {"ActiveState": "active", "SubState": "running"}
    messages = [e["MESSAGE"] for e in n.journal(unit="dbus.service")]
    assert any(m.startswith("Started dbus.service") for m in messages), messages


# open_by_handle_at (nfs-ganesha needs it) with bad arguments: EPERM when seccomp filters it,
# EFAULT/EBADF when the kernel gets to look at the arguments.
OPEN_BY_HANDLE_ERRNO = """
import ctypes, errno, platform
nr = {"x86_64": 304, "aarch64": 265}[platform.machine()]
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall(nr, -1, None, 0)
print(errno.errorcode[ctypes.get_errno()])
"""

FUSE_HELLO = """
import errno, stat, sys, fusepy as fuse
class Hello(fuse.Operations):
    def getattr(self, path, fh=None):
        if path == "/":
            return {"st_mode": stat.S_IFDIR | 0o755, "st_nlink": 2}
        if path == "/hello":
            return {"st_mode": stat.S_IFREG | 0o444, "st_nlink": 1, "st_size": len(sys.argv[2])}
        raise fuse.FuseOSError(errno.ENOENT)
    def readdir(self, path, fh):
        return [".", "..", "hello"]
    def read(self, path, size, offset, fh):
        return sys.argv[2].encode()[offset:offset + size]
fuse.FUSE(Hello(), sys.argv[1], foreground=True, ro=True)
"""


def test_node_options_binds_syscalls_and_fuse(node, tmp_path):
    rw, ro = tmp_path / "rw", tmp_path / "ro"
    rw.mkdir()
    ro.mkdir()
    (ro / "given").write_text("from the host")
    n = node("o1", binds=[f"{rw}:/srv/rw", "/dev/fuse"], binds_ro=[f"{ro}:/srv/ro"],
             syscalls=["open_by_handle_at"])
    assert n.run_service(["python3", "-c", OPEN_BY_HANDLE_ERRNO]).stdout.strip() != "EPERM"
    n.run_service(["sh", "-c", "echo from the node > /srv/rw/made"])
    assert (rw / "made").read_text() == "from the node\n"
    assert n.run_service(["cat", "/srv/ro/given"]).stdout == "from the host"
    denied = n.run_service(["touch", "/srv/ro/x"], check=False)
    assert denied.returncode != 0 and "Read-only file system" in denied.stderr

    token = secrets.token_hex(4)
    n.run(["mkdir", "-p", "/mnt/hello"])
    n.run(["systemd-run", "--quiet", "--unit=dsv41-fuse-hello", "python3", "-c", FUSE_HELLO,
           "/mnt/hello", token])
    deadline = time.monotonic() + 10
    while (r := n.run_service(["cat", "/mnt/hello/hello"], check=False)).returncode != 0 \
            and time.monotonic() < deadline:
        time.sleep(0.05)  # the file system appears once the service has mounted it
    assert r.stdout == token, (r, n.run(["systemctl", "status", "dsv41-fuse-hello"], check=False))


def test_memory_limit_kills_the_unit_not_the_node(node):
    n = node("m1", memory_writable=True)
    hog = ["python3", "-c", "x = 'x' * (200 << 20); print(len(x))"]
    ok = n.run(["systemd-run", "--wait", "--quiet", "--unit=dsv41-roomy",
                "--property=MemoryMax=512M", *hog], check=False)
    assert ok.returncode == 0, ok.stderr  # the allocation itself works when it fits

    r = n.run(["systemd-run", "--wait", "--quiet", "--unit=dsv41-hog",
               "--property=MemoryMax=64M", *hog], check=False)
    assert r.returncode != 0
    props = n.show("dsv41-hog.service", "Result", "ActiveState", "ExecMainStatus", "MemoryMax")
    assert props["MemoryMax"] == str(64 << 20)
    assert props["ActiveState"] == "failed"
    assert props["Result"] in ("oom-kill", "signal"), props
    if props["Result"] == "signal":
        assert props["ExecMainStatus"] == "9", props  # SIGKILL from the OOM killer

    # The node and its host side survive: only the unit was killed.
    n.run(["systemctl", "reset-failed", "dsv41-hog.service"])
    assert n.run(["systemctl", "is-system-running"], check=False).stdout.strip() == "running"
    assert _alive(n.nspawn_pid) and _alive(n.leader)


SERVER = """
import socket, sys
s = socket.create_server(("0.0.0.0", 7441))
c, _ = s.accept()
data = c.recv(100)
c.sendall(socket.gethostname().encode() + b":" + data)
c.close()
"""

# Connects to PORT on argv[1] as `c` (the server's unit may not listen yet); the scripts below go on.
CONNECT = """
import pathlib, socket, sys, time
deadline = time.monotonic() + 10
while True:
    try:
        c = socket.create_connection((sys.argv[1], PORT), timeout=2)
        break
    except ConnectionRefusedError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
"""

CLIENT = CONNECT.replace("PORT", "7441") + """
c.sendall(sys.argv[2].encode())
print(c.recv(100).decode())
"""


def test_two_nodes_on_a_bridge_talk_tcp(cluster):
    c = cluster({"a": "192.168.241.11", "b": "192.168.241.12"})
    a, b = c["a"], c["b"]
    assert a.address != b.address and {a.address, b.address} <= \
        {str(ip) for ip in c.bridge.network.hosts()}
    a.run(["systemd-run", "--quiet", "--unit=dsv41-tcp-server", "python3", "-c", SERVER])
    token = secrets.token_hex(8)
    r = b.run_service(["python3", "-c", CLIENT, a.address, token], timeout=30)
    assert r.stdout.strip() == f"a:{token}"


def test_teardown_leaves_no_mounts_bridge_or_processes(rootfs):
    c = Cluster(rootfs, ["t1", "t2"], memory_writable=True)
    c.boot()
    try:
        nodes = list(c)
        pids = [(p, _started(p)) for n in nodes for p in (n.nspawn_pid, n.leader)]
        bridge_ifindex = _ifindex(c.bridge.name)
        tmpdirs = [str(n.tmpdir) for n in nodes]
        cgroups = [d for n in nodes for d in n.cgroup_dirs]
        veths = [n.host_veth for n in nodes]
        machines = [n.machine for n in nodes]
        # Something for teardown to clean: a service with state in the memory cgroup, and on
        # t1 one that ignores SIGTERM with a long stop timeout, so poweroff cannot finish.
        for n in nodes:
            n.run(["systemd-run", "--quiet", "--unit=dsv41-sleeper", "--property=MemoryMax=32M",
                   "sleep", "600"])
        nodes[0].run(["systemd-run", "--quiet", "--unit=dsv41-stubborn",
                      "--property=TimeoutStopSec=300", "sh", "-c", "trap '' TERM; sleep 600"])
        assert all(_alive(p, t) for p, t in pids)
        assert all(Path(f"/sys/class/net/{v}").exists() for v in veths)
        assert all(d.is_dir() for d in cgroups)
        assert all(_host_pids_in_cgroups_named(m) for m in machines)
    finally:
        c.stop(timeout=3)
    c.stop()  # idempotent
    assert [n.stop_forced for n in nodes] == [True, False]

    mounts = Path("/proc/mounts").read_text()
    assert not [t for t in tmpdirs if t in mounts]
    assert not [t for t in tmpdirs if os.path.exists(t)]
    # Another test run may already have made a new bridge of the same name.
    assert bridge_ifindex is not None and _ifindex(c.bridge.name) != bridge_ifindex
    assert not [v for v in veths if Path(f"/sys/class/net/{v}").exists()]
    assert not [p for p, t in pids if _alive(p, t)]
    assert not [d for d in cgroups if d.exists()]
    assert not [m for m in machines if _host_pids_in_cgroups_named(m)]
    assert subprocess.run(["pgrep", "-f", "|".join(machines)]).returncode == 1  # none matched


def test_boot_failure_says_why_and_cleans_up(rootfs):
    n = Node("broken", rootfs, binds=["/nonexistent/dsv41-harness-test"], boot_timeout=20)
    with pytest.raises(BootError, match="nspawn exited") as e:
        n.boot()
    assert "dsv41-harness-test" in str(e.value)  # nspawn's own complaint is in the message
    assert n.tmpdir is not None and not n.tmpdir.exists()
    assert str(n.tmpdir) not in Path("/proc/mounts").read_text()
    assert not _host_pids_in_cgroups_named(n.machine)


REACH = ("import socket, sys\n"
         "try:\n    socket.create_connection((sys.argv[1], 9), timeout=float(sys.argv[2])).close(); print('open')\n"
         "except ConnectionRefusedError: print('refused')\n"
         "except OSError as e: print('no answer')\n")


def reach(node, address, timeout=1.0) -> str:
    """What a TCP connect from `node` to a closed port of `address` gets: 'refused' from a kernel
    that is there, 'no answer' when nothing gets through."""
    return node.run(["python3", "-c", REACH, address, str(timeout)], timeout=30).stdout.strip()


def test_a_power_cut_kills_everything_at_once_and_power_on_boots_the_same_disk_fresh(cluster):
    c = cluster({"a": "192.168.241.21", "b": "192.168.241.22"})
    a, b = c["a"], c["b"]
    a.write_file("/var/lib/kept", "on disk\n")
    a.run(["systemd-run", "--unit=held.service", "sleep", "600"])
    a.run(["sh", "-c", "echo in-memory > /run/gone"])
    started = a.run(["cat", "/proc/1/stat"]).stdout.split(")")[1].split()[19]
    a.power_cut()
    assert a.leader is None and not a.cgroup_dirs[0].joinpath("cgroup.procs").read_text().strip()
    assert reach(b, a.address) == "no answer"  # its address is gone with it
    result = a.power_on()
    assert result.state in ("running", "degraded")
    assert a.run(["cat", "/var/lib/kept"]).stdout == "on disk\n"
    assert a.run(["test", "-e", "/run/gone"], check=False).returncode != 0  # RAM is lost
    assert a.show("held.service", "LoadState")["LoadState"] == "not-found"  # a fresh systemd
    assert a.run(["cat", "/proc/1/stat"]).stdout.split(")")[1].split()[19] != started
    assert reach(b, a.address, 5.0) == "refused"


HOLDER = """
import socket, sys
s = socket.create_server(("0.0.0.0", 7442))
c, _ = s.accept()
c.recv(100)
"""

# Connects to the holder, says it is connected, then waits for the connection to end.
WATCHER = CONNECT.replace("PORT", "7442") + """
pathlib.Path("/run/watcher-connected").touch()
c.settimeout(float(sys.argv[2]))
try:
    print("closed" if c.recv(100) == b"" else "data")
except socket.timeout:
    print("silence")
except OSError as exc:
    print(f"reset: {exc}")
"""


def test_a_power_cut_says_nothing_to_the_peers_connections_which_stay_open(cluster):
    # A rank killed by its kernel closes its sockets (a FIN); one whose node lost power does not,
    # and its peers wait for it (TCP retransmits, NCCL's collectives block).
    c = cluster({"a": "192.168.241.21", "b": "192.168.241.22"})
    a, b = c["a"], c["b"]
    a.run(["systemd-run", "--quiet", "--unit=dsv41-holder", "python3", "-c", HOLDER])
    b.run(["systemd-run", "--quiet", "--unit=dsv41-watcher", "--property=StandardOutput=file:/run/watcher.out",
           "python3", "-c", WATCHER, a.address, "4"])
    deadline = time.monotonic() + 15
    while b.run(["test", "-e", "/run/watcher-connected"], check=False).returncode != 0:
        assert time.monotonic() < deadline, "the watcher never connected"
        time.sleep(0.05)
    a.power_cut()
    deadline = time.monotonic() + 15
    while b.show("dsv41-watcher.service", "ActiveState")["ActiveState"] in ("active", "activating"):
        assert time.monotonic() < deadline, "the watcher never ended"
        time.sleep(0.1)
    assert b.run(["cat", "/run/watcher.out"]).stdout.strip() == "silence"


def test_a_frozen_node_answers_nothing_but_its_kernel_and_a_cut_link_passes_nothing(cluster):
    c = cluster({"a": "192.168.241.21", "b": "192.168.241.22"})
    a, b = c["a"], c["b"]
    a.run(["systemd-run", "--quiet", "--unit=dsv41-tcp-server", "python3", "-c", SERVER])
    a.freeze()
    try:
        assert reach(b, a.address) == "refused"  # its kernel still answers
        r = b.run_service(["python3", "-c", CLIENT, a.address, "frozen"], timeout=30, check=False,
                          properties={"RuntimeMaxSec": 3})
        assert r.returncode != 0  # connected, but the server never answers
    finally:
        a.thaw()
    a.run(["systemctl", "stop", "dsv41-tcp-server"], check=False)  # it served the dead connection, if at all
    a.run(["systemd-run", "--quiet", "--unit=dsv41-tcp-server-2", "python3", "-c", SERVER])
    assert b.run_service(["python3", "-c", CLIENT, a.address, "t"], timeout=30).stdout.strip() == "a:t"
    a.link(up=False)
    try:
        assert reach(b, a.address) == "no answer"
    finally:
        a.link(up=True)
    assert reach(b, a.address, 5.0) == "refused"
