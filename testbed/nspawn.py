"""Boot real systemd nodes in systemd-nspawn containers for the test tiers, the demo and the benches.

Needs root on a Linux host with systemd-nspawn, nsenter, ip and overlayfs (PID 1 of the host
need not be systemd). Every node boots the shared base tree from ``tools/rootfs.sh`` through
its own overlayfs, so the base stays pristine; a node boots in ~0.3 s and costs a few MB.

In tests use the fixtures: put ``from tests.harness.fixtures import bridge, cluster, node,
rootfs  # noqa: F401`` in a conftest.py and run ``/usr/bin/python3 -m pytest`` from the
repository root (so that ``tests`` is importable)::

    def test_x(node):
        n = node("spark1")                                   # booted; stopped after the test
        n.run(["systemctl", "is-active", "dbus.service"])    # as root via nsenter, returns
                                                             # CompletedProcess (text), check=True
        r = n.run_service(["python3", "-c", "print(42)"],    # as a transient service
                          properties={"LimitNOFILE": 1024}, env={"X": "1"})
        assert r.stdout == "42\\n"
        n.copy_in("build/dsv41-agent.deb", "/var/tmp/a.deb")  # not /tmp: a tmpfs in the node
        n.write_file("/etc/dsv41/agent.env", "NODE=spark1\\n")
        n.show("dbus.service", "ActiveState")                 # {"ActiveState": "active"}
        n.journal(unit="dbus.service")                        # [{"MESSAGE": ...}, ...]

    def test_y(cluster):
        c = cluster({"spark1": "192.168.241.11", "spark2": "192.168.241.12"})
        c["spark2"].run(["python3", "-c", "..."])
        c["spark1"].address                                  # use this, not the literal:

A Cluster that makes its own bridge takes the first free of 192.168.241-254.0/24 (another test
run may hold 241) and keeps the host part of each address, so always read ``node.address``.
Without fixtures::

    root = build_rootfs()
    with Bridge() as br, Node("a", root, bridge=br, address=br.address(11)) as a: ...
    with Cluster(root, ["a", "b"], memory_writable=True) as c: ...   # .11 and .12

``Node(name, rootfs, ...)`` options: ``bridge`` + ``address`` (static IPv4 on the node's
``host0`` through systemd-networkd; the host is ``bridge.host_address``), ``binds`` /
``binds_ro`` (nspawn ``SRC[:DST[:OPTS]]``; ``"/dev/fuse"`` for FUSE, whose Python module in the
base is ``fusepy``), ``syscalls`` (added to the seccomp allow list, e.g.
``["open_by_handle_at"]`` for nfs-ganesha), ``memory_writable=True`` (MemoryMax= and friends
are enforced inside the node, an OOM kill shows as Result=signal; without it systemd accepts
the limits and enforces nothing), ``extra_args`` (more nspawn arguments), ``boot_timeout``.
``boot()`` returns a ``BootResult`` (also ``node.boot_result``): "degraded" is accepted and
lists the failed units. Useful attributes: ``name``, ``address``, ``root`` (the node's / on the
host), ``leader`` (its PID 1 on the host), ``console()`` (boot output).

Pitfalls handled here: each node is launched from its own cgroup (nspawn creates ``payload/``
and ``supervisor/`` beside itself, so nodes started from one cgroup collide); commands enter
through ``nsenter -t <leader> -a`` (no host systemd, so no ``machinectl``/``systemd-run -M``);
``run()`` bypasses the node's seccomp filter and capability limits and is in no unit, while
``run_service()`` is a real service, so run code under test with ``run_service()`` (or start
a long-running one with ``run(["systemd-run", "--unit=NAME", ...])``). journald writes
asynchronously: poll ``journal()`` when waiting for a message. ``stop()`` powers off, then
always unmounts the overlay, removes the node's cgroups, kills leftovers and removes its veth;
it may be called more than once and raises HarnessError when something is left behind.
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
ROOTFS_SCRIPT = REPO_ROOT / "tools" / "rootfs.sh"
HOST_TOOLS = ("systemd-nspawn", "nsenter", "ip", "mount", "umount")
NODE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Hierarchies a node gets its own cgroup in: unified and name=systemd are where nspawn puts
# payload/ and supervisor/; memory, cpu, cpuacct and pids are where a memory-writable node's
# systemd creates its slices (the cgroup namespace root of a node is its launcher's cgroup).
NODE_HIERARCHIES = ("", "name=systemd", "memory", "cpu", "cpuacct", "pids")
WRITABLE_CONTROLLERS = ("memory", "cpu", "cpuacct", "pids")
PID1_WRAPPER = "/usr/local/sbin/dsv41-pid1"
_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,30}$")
_BUS_RETRY_S = 0.02
_ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class HarnessError(RuntimeError):
    """The harness could not do what was asked (boot, stop, build); the message says why."""


class BootError(HarnessError):
    """A node did not reach running/degraded; the message ends with its console output."""


class CommandError(subprocess.CalledProcessError):
    """A command inside a node failed; str() includes the node, argv, exit status and output."""

    def __init__(self, node: str, returncode: int, cmd: Sequence[str], output: str | bytes,
                 stderr: str | bytes) -> None:
        super().__init__(returncode, list(cmd), output, stderr)
        self.node = node

    def __str__(self) -> str:
        def tail(s: str | bytes | None) -> str:
            if isinstance(s, bytes):
                s = s.decode(errors="replace")
            return (s or "").strip()[-2000:]
        return (f"node {self.node}: {shlex.join(self.cmd)} exited with {self.returncode}\n"
                f"stdout: {tail(self.output)}\nstderr: {tail(self.stderr)}")


@dataclass(frozen=True)
class BootResult:
    state: str                      # "running" or "degraded"
    failed_units: tuple[str, ...]   # empty when state is "running"
    seconds: float                  # from launching nspawn to the state above (and the address)


def host_problems() -> list[str]:
    """Why this host cannot boot nodes (empty when it can)."""
    problems = []
    if not Path("/proc/self/ns/pid").exists():
        problems.append("not a Linux host with namespaces")
    if os.geteuid() != 0:
        problems.append(f"needs root (running as uid {os.geteuid()})")
    missing = [t for t in HOST_TOOLS if shutil.which(t) is None]
    if missing:
        problems.append("missing host tools: " + ", ".join(missing)
                        + " (apt-get install systemd-container util-linux mount iproute2)")
    try:
        if "overlay" not in Path("/proc/filesystems").read_text():
            problems.append("the kernel has no overlayfs (modprobe overlay)")
    except OSError as e:
        problems.append(f"cannot read /proc/filesystems: {e}")
    return problems


def build_rootfs(script: Path = ROOTFS_SCRIPT, timeout: float = 1800.0) -> Path:
    """Run tools/rootfs.sh (cached; instant when built) and return the base tree's path."""
    try:
        r = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise HarnessError(f"{script} did not finish within {timeout:.0f} s") from e
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines or not Path(lines[-1]).is_dir():
        raise HarnessError(f"{script} failed (exit {r.returncode}):\n{r.stderr.strip()[-4000:]}")
    return Path(lines[-1])


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise HarnessError(f"ip {' '.join(args)} failed: {r.stderr.strip()}")
    return r


def _link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


class Bridge:
    """A host bridge with a private IPv4 network for test nodes (no NAT, no forwarding).

    By default takes the first free of dsv41br0..13 with 192.168.241.0/24..192.168.254.0/24,
    so concurrent test runs on one host do not collide. The host is ``.1``.
    """

    def __init__(self, name: str | None = None, network: str | None = None) -> None:
        if (name is None) != (network is None):
            raise ValueError("give both name and network, or neither (then both are allocated)")
        self._name = name
        self._network = ipaddress.IPv4Network(network) if network else None
        self._created = False

    @property
    def name(self) -> str:
        if self._name is None:
            raise HarnessError("bridge not created yet; call create() or use it as a context manager")
        return self._name

    @property
    def network(self) -> ipaddress.IPv4Network:
        if self._network is None:
            raise HarnessError("bridge not created yet; call create() or use it as a context manager")
        return self._network

    @property
    def host_address(self) -> str:
        return self.address(1)

    def address(self, index: int) -> str:
        """The index-th address of the bridge's network, e.g. address(11) -> "192.168.241.11"."""
        if not 1 <= index < self.network.num_addresses - 1:
            raise ValueError(f"host index {index} outside 1..{self.network.num_addresses - 2}")
        return str(self.network.network_address + index)

    def create(self) -> Bridge:
        if self._created:
            return self
        candidates = ([(self._name, self._network)] if self._name and self._network else
                      [(f"dsv41br{i}", ipaddress.IPv4Network(f"192.168.{241 + i}.0/24"))
                       for i in range(14)])
        used = self._used_networks()
        for name, net in candidates:
            assert name is not None and net is not None
            if any(net.overlaps(u) for u in used):
                continue
            # `ip link add` is atomic, so two runs racing for one name cannot both win.
            if _ip("link", "add", name, "type", "bridge", check=False).returncode != 0:
                continue
            self._name, self._network, self._created = name, net, True
            try:
                _ip("addr", "add", f"{self.host_address}/{net.prefixlen}", "dev", name)
                _ip("link", "set", name, "up")
            except HarnessError:
                self.delete()
                raise
            return self
        raise HarnessError("no free bridge: tried " + ", ".join(f"{n} ({c})" for n, c in candidates)
                           + "; delete stale ones with `ip link del NAME`")

    @staticmethod
    def _used_networks() -> list[ipaddress.IPv4Network]:
        r = _ip("-j", "-4", "addr", "show")
        nets = []
        for link in json.loads(r.stdout or "[]"):
            for a in link.get("addr_info", []):
                nets.append(ipaddress.IPv4Network(f"{a['local']}/{a['prefixlen']}", strict=False))
        return nets

    def delete(self) -> None:
        if self._created and self._name and _link_exists(self._name):
            _ip("link", "del", self._name)
        self._created = False

    def __enter__(self) -> Bridge:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.delete()


def _cgroup_mounts() -> dict[str, Path]:
    """Hierarchy key ("" for cgroup2, "memory", "name=systemd", ...) -> mount point."""
    controllers = {line.split()[0] for line in Path("/proc/cgroups").read_text().splitlines()
                   if line and not line.startswith("#")}
    mounts: dict[str, Path] = {}
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, where, fstype, opts, *_ = line.split()
        if fstype == "cgroup2":
            mounts.setdefault("", Path(where))
        elif fstype == "cgroup":
            for o in opts.split(","):
                if o in controllers or o.startswith("name="):
                    mounts.setdefault(o, Path(where))
    return mounts


def _own_cgroups() -> dict[str, str]:
    """Hierarchy key -> this process's cgroup path, from /proc/self/cgroup."""
    own: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            own[c] = path
    return own


class _NodeCgroups:
    """One cgroup per node in each hierarchy of NODE_HIERARCHIES, under the caller's own."""

    def __init__(self, leaf: str) -> None:
        mounts, own = _cgroup_mounts(), _own_cgroups()
        self.dirs: list[Path] = []
        for h in NODE_HIERARCHIES:
            if h in mounts and h in own:
                self.dirs.append(mounts[h] / own[h].lstrip("/") / leaf)
        if not any(h in mounts and h in own for h in ("", "name=systemd")):
            raise HarnessError("neither a cgroup2 nor a name=systemd hierarchy is mounted "
                               "under /sys/fs/cgroup; systemd-nspawn needs one")

    def create(self) -> None:
        for d in self.dirs:
            d.mkdir()

    def join_script(self) -> str:
        """sh code that moves the shell into every node cgroup before exec'ing nspawn."""
        return "".join(f'echo $$ > {shlex.quote(str(d / "cgroup.procs"))} || '
                       f'{{ echo "harness: cannot move nspawn into {d}" >&2; exit 97; }}\n'
                       for d in self.dirs)

    def pids(self) -> set[int]:
        found: set[int] = set()
        for d in self.dirs:
            if d.is_dir():
                for procs in d.rglob("cgroup.procs"):
                    try:
                        found.update(int(p) for p in procs.read_text().split())
                    except OSError:
                        pass
        return found

    def kill_all(self, tries: int) -> bool:
        """SIGKILL every process in the node's cgroups until none is left (True), or `tries` rounds
        20 ms apart have passed (False)."""
        for _ in range(tries):
            pids = self.pids()
            if not pids:
                return True
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.02)
        return not self.pids()

    def remove(self) -> list[str]:
        """Remove the cgroup trees (deepest first); returns what could not be removed."""
        left = []
        for d in self.dirs:
            if not d.is_dir():
                continue
            for sub in sorted((p for p in d.rglob("*") if p.is_dir()),
                              key=lambda p: len(p.parts), reverse=True) + [d]:
                for _ in range(50):
                    try:
                        sub.rmdir()
                        break
                    except FileNotFoundError:
                        break
                    except OSError:
                        time.sleep(0.02)  # a just-killed process leaves the cgroup a moment later
                else:
                    left.append(str(sub))
        return left


def _proc_comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            kids += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    except OSError:
        pass
    return kids


class Node:
    """One booted systemd container. See the module docstring for usage."""

    def __init__(self, name: str, rootfs: Path | str, *, bridge: Bridge | None = None,
                 address: str | None = None, binds: Sequence[str] = (),
                 binds_ro: Sequence[str] = (), syscalls: Sequence[str] = (),
                 memory_writable: bool = False, extra_args: Sequence[str] = (),
                 tmp_parent: Path | str = "/var/tmp", boot_timeout: float = 60.0) -> None:
        if not _NAME_RE.match(name):
            raise ValueError(f"node name {name!r}: use 1-31 of a-z, 0-9, '-', starting with a letter")
        if address is not None and bridge is None:
            raise ValueError(f"node {name}: an address needs a bridge")
        self.name = name
        self.rootfs = Path(rootfs)
        if not (self.rootfs / "usr/lib/systemd/systemd").exists():
            raise ValueError(f"{self.rootfs} is not a root file system with systemd "
                             "(build one with tools/rootfs.sh)")
        self.bridge = bridge
        self.address = address
        self.binds, self.binds_ro, self.syscalls = list(binds), list(binds_ro), list(syscalls)
        self.memory_writable = memory_writable
        self.extra_args = list(extra_args)
        self.tmp_parent = Path(tmp_parent)
        self.boot_timeout = boot_timeout
        # Unique per boot: the machine name names the veth and nspawn's lock files, and other
        # test runs on this host may boot a node with the same name at the same time.
        self.machine = f"{name}-{secrets.token_hex(3)}"
        self.tmpdir: Path | None = None
        self.root: Path | None = None          # the node's / as seen from the host
        self.host_veth: str | None = None
        self.leader: int | None = None
        self.nspawn_pid: int | None = None
        self.boot_result: BootResult | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._cgroups: _NodeCgroups | None = None
        self._mounted = False
        self._root_lock: str | None = None
        self.stop_forced = False    # stop() had to kill the node after its timeout

    # --- lifecycle ---------------------------------------------------------------------------

    def boot(self) -> BootResult:
        if self._proc is not None:
            raise HarnessError(f"node {self.name} was already booted; make a new Node to boot again")
        try:
            return self._boot()
        except BaseException as e:
            try:
                # A systemd still starting up may not handle the poweroff signal yet.
                self.stop(timeout=5.0)
            except HarnessError as cleanup:
                e.add_note(str(cleanup))
            raise

    def _boot(self) -> BootResult:
        t0 = time.monotonic()
        deadline = t0 + self.boot_timeout
        self.tmpdir = Path(tempfile.mkdtemp(prefix=f"dsv41-{self.machine}-", dir=self.tmp_parent))
        upper, work, self.root = (self.tmpdir / d for d in ("upper", "work", "root"))
        for d in (upper, work, self.root):
            d.mkdir()
        r = subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                            f"lowerdir={self.rootfs},upperdir={upper},workdir={work}",
                            str(self.root)], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise HarnessError(f"node {self.name}: overlay mount failed: {r.stderr.strip()}")
        self._mounted = True
        st = os.stat(self.root)
        self._root_lock = f"/run/systemd/nspawn/locks/inode-{st.st_dev}:{st.st_ino}"
        self._write_config()
        self._cgroups = _NodeCgroups(f"dsv41-{self.machine}")
        self._cgroups.create()
        return self._launch(t0, deadline)

    def _launch(self, t0: float, deadline: float) -> BootResult:
        """Start nspawn on the node's mounted root, from the node's own cgroups, and wait for it."""
        console = open(self.tmpdir / "console.log", "wb")
        with console:
            self._proc = subprocess.Popen(
                ["/bin/sh", "-c", self._cgroups.join_script() + 'exec "$@"', "sh",
                 *self._nspawn_argv()],
                stdin=subprocess.DEVNULL, stdout=console, stderr=subprocess.STDOUT,
                start_new_session=True, env={"PATH": os.environ.get("PATH", NODE_PATH)})
        self.nspawn_pid = self._proc.pid
        self.leader = self._wait_leader(deadline)
        state = self._wait_running(deadline)
        failed = tuple(self.failed_units()) if state == "degraded" else ()
        if self.bridge is not None:
            self.host_veth = self._find_host_veth()
            if self.address is not None:
                self._wait_address(deadline)
        self.boot_result = BootResult(state, failed, time.monotonic() - t0)
        if failed:
            warnings.warn(f"node {self.name} booted degraded; failed units: {', '.join(failed)}",
                          stacklevel=3)
        return self.boot_result

    def _nspawn_argv(self) -> list[str]:
        assert self.root is not None
        argv = ["systemd-nspawn", "--quiet", "--keep-unit", "--register=no",
                f"--machine={self.machine}", f"--hostname={self.name}",
                f"--directory={self.root}", "--console=read-only"]
        if self.bridge is not None:
            argv.append(f"--network-bridge={self.bridge.name}")
        argv += [f"--bind={b}" for b in self.binds] + [f"--bind-ro={b}" for b in self.binds_ro]
        if self.syscalls:
            argv.append("--system-call-filter=" + " ".join(self.syscalls))
        argv += self.extra_args
        if self.memory_writable:
            # Not --boot: nspawn would exec systemd itself. The wrapper is PID 1 and execs it,
            # so nspawn must be told the signal that makes systemd shut down.
            argv += ["--kill-signal=SIGRTMIN+3", PID1_WRAPPER]
        else:
            argv.append("--boot")
        return argv

    def _write_config(self) -> None:
        # systemd prefers /etc/hostname over the name nspawn gives the container.
        self.write_file("/etc/hostname", self.name + "\n")
        if self.address is not None:
            assert self.bridge is not None
            iface = ipaddress.IPv4Interface(self.address if "/" in self.address else
                                            f"{self.address}/{self.bridge.network.prefixlen}")
            # Sorts before the packaged 80-container-host0.network, which would ask for DHCP.
            self.write_file("/etc/systemd/network/10-dsv41-host0.network",
                            "[Match]\nName=host0\n\n[Network]\n"
                            f"Address={iface.with_prefixlen}\n"
                            "LinkLocalAddressing=no\nIPv6AcceptRA=no\nDHCP=no\n")
            self.address = str(iface.ip)
        if self.memory_writable:
            remounts = "".join(
                f"mount -o remount,bind,rw /sys/fs/cgroup/{c} || "
                f"{{ echo 'dsv41-pid1: cannot make /sys/fs/cgroup/{c} writable' >&2; exit 1; }}\n"
                for c in WRITABLE_CONTROLLERS)
            self.write_file(PID1_WRAPPER,
                            "#!/bin/sh\n# nspawn mounts the v1 controllers read-only: systemd "
                            "would accept MemoryMax= and enforce nothing.\n"
                            f"{remounts}exec /lib/systemd/systemd \"$@\"\n", mode=0o755)

    def _wait_leader(self, deadline: float) -> int:
        """The container's PID 1: the nspawn child not itself named systemd-nspawn, once it
        runs systemd (before that its mounts may not be set up yet)."""
        assert self._proc is not None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise BootError(self._boot_failure(f"nspawn exited with {self._proc.returncode}"))
            todo = [self._proc.pid]
            while todo:
                pid = todo.pop()
                for kid in _children(pid):
                    comm = _proc_comm(kid)
                    if comm == "systemd-nspawn":
                        todo.append(kid)
                    elif comm == "systemd":
                        return kid
            time.sleep(_BUS_RETRY_S)
        raise BootError(self._boot_failure("systemd did not start as the container's PID 1"))

    def _wait_running(self, deadline: float) -> str:
        last = ""
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise BootError(self._boot_failure(f"nspawn exited with {self._proc.returncode}"))
            try:
                r = self.run(["systemctl", "is-system-running", "--wait"], check=False,
                             timeout=max(0.5, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
            state = r.stdout.strip()
            if state in ("running", "degraded"):
                return state
            if state in ("maintenance", "stopping"):
                raise BootError(self._boot_failure(f"system state {state!r}"))
            last = (state + " " + r.stderr.strip()).strip()
            # Early in the boot D-Bus is not up ("Failed to connect to bus") and systemctl may
            # even see the node's /proc not yet mounted ("offline"): both pass within ~0.1 s.
            time.sleep(_BUS_RETRY_S)
        raise BootError(self._boot_failure(
            f"not running/degraded within {self.boot_timeout:.0f} s (last: {last!r})"))

    def _find_host_veth(self) -> str | None:
        r = self.run(["cat", "/sys/class/net/host0/iflink"], check=False)
        if r.returncode != 0:
            return None
        index = r.stdout.strip()
        for link in Path("/sys/class/net").iterdir():
            try:
                if (link / "ifindex").read_text().strip() == index:
                    return link.name
            except OSError:
                continue
        return None

    def _wait_address(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            r = self.run(["ip", "-4", "-o", "addr", "show", "dev", "host0"], check=False)
            if f" {self.address}/" in r.stdout:
                return
            time.sleep(_BUS_RETRY_S)
        raise BootError(self._boot_failure(f"host0 did not get {self.address}"))

    def _boot_failure(self, why: str) -> str:
        return (f"node {self.name} ({self.machine}) failed to boot: {why}\n"
                f"--- console (last 3000 chars) ---\n{self.console()[-3000:]}")

    def console(self) -> str:
        """What the node wrote to its console so far (boot messages, nspawn errors)."""
        try:
            raw = (self.tmpdir / "console.log").read_text(errors="replace") if self.tmpdir else ""
        except OSError:
            return ""
        return _ANSI_RE.sub("", raw.replace("\r", ""))

    def stop(self, timeout: float = 15.0) -> None:
        """Power off (SIGKILL after `timeout`), then remove everything the node left on the host.
        Safe to call more than once and after a failed boot. Raises HarnessError listing what
        could not be cleaned up."""
        problems: list[str] = []
        proc = self._proc
        if proc is not None and proc.poll() is None:
            leader_alive = self.leader is not None and _proc_comm(self.leader) is not None
            try:
                if leader_alive:
                    os.kill(self.leader, signal.SIGRTMIN + 4)  # systemd: poweroff
                else:
                    proc.terminate()
                proc.wait(timeout)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                # Not an error by itself (a unit may have a long stop timeout); what matters
                # is that nothing is left behind, checked below.
                self.stop_forced = True
                # Kill the node's PID 1 first: nspawn then reaps it, cleans up and exits.
                if leader_alive:
                    try:
                        os.kill(self.leader, signal.SIGKILL)
                        proc.wait(5)
                    except (ProcessLookupError, subprocess.TimeoutExpired):
                        pass
                if proc.poll() is None:
                    proc.kill()
        if self._cgroups is not None and not self._cgroups.kill_all(tries=100):
            problems.append(f"processes left in the node cgroups: {sorted(self._cgroups.pids())}")
        if proc is not None:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                problems.append(f"nspawn (pid {proc.pid}) does not exit")
        if self._root_lock is not None and proc is not None and proc.poll() is not None:
            # nspawn removes its lock on the root directory unless it was killed.
            Path(self._root_lock).unlink(missing_ok=True)
        if self._cgroups is not None:
            left = self._cgroups.remove()
            if left:
                problems.append("cgroups not removed: " + ", ".join(left))
        if self.host_veth and _link_exists(self.host_veth):
            if _ip("link", "del", self.host_veth, check=False).returncode != 0 \
                    and _link_exists(self.host_veth):
                problems.append(f"veth {self.host_veth} not removed")
        if self._mounted and self.root is not None:
            if not self._umount(self.root):
                problems.append(f"overlay {self.root} still mounted")
            else:
                self._mounted = False
        if self.tmpdir is not None and not self._mounted:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
        # /run is not a tmpfs on every test host; nspawn leaves this directory behind.
        shutil.rmtree(f"/run/systemd/nspawn/propagate/{self.machine}", ignore_errors=True)
        self.leader = None
        if problems:
            raise HarnessError(f"node {self.name} ({self.machine}) teardown: " + "; ".join(problems))

    @staticmethod
    def _umount(path: Path) -> bool:
        for _ in range(20):
            if subprocess.run(["umount", str(path)], capture_output=True).returncode == 0:
                return True
            if not os.path.ismount(path):
                return True
            time.sleep(0.05)
        return subprocess.run(["umount", "--lazy", str(path)], capture_output=True).returncode == 0

    @property
    def cgroup_dirs(self) -> list[Path]:
        """The node's own cgroups on the host (one per hierarchy); removed by stop()."""
        return list(self._cgroups.dirs) if self._cgroups else []

    # --- faults a real node has --------------------------------------------------------------

    def _freeze_file(self) -> Path:
        unified = next((d for d, h in zip(self.cgroup_dirs, NODE_HIERARCHIES) if h == ""), None)
        if unified is None or not (unified / "cgroup.freeze").exists():
            raise HarnessError(f"node {self.name}: no cgroup2 freezer on this host")
        return unified / "cgroup.freeze"

    def freeze(self) -> None:
        """Every process of the node stops where it is (cgroup2 freezer), as on a node wedged by
        memory exhaustion: its kernel still takes TCP connections, nothing answers them."""
        path = self._freeze_file()
        path.write_text("1")
        events = path.with_name("cgroup.events")
        deadline = time.monotonic() + 10
        while "frozen 1" not in events.read_text():
            if time.monotonic() > deadline:
                raise HarnessError(f"node {self.name} did not freeze within 10 s")
            time.sleep(0.01)

    def thaw(self) -> None:
        self._freeze_file().write_text("0")

    def link(self, up: bool) -> None:
        """The node's cable: its veth on the host's bridge down (nothing gets through) or up."""
        if self.host_veth is None:
            raise HarnessError(f"node {self.name} has no network to cut")
        _ip("link", "set", self.host_veth, "up" if up else "down")

    def power_cut(self) -> None:
        """The node loses power: every process of it dies at once (nspawn too), nothing shuts down,
        writes anything or says goodbye on the network. Its disk (the overlay) stays; power_on()
        boots it again."""
        if self._proc is None or self._cgroups is None:
            raise HarnessError(f"node {self.name} is not running")
        # Silent: the link goes first. A killed process's sockets are closed by its kernel, which
        # sends FIN or RST to every peer; a node without power sends nothing, so its peers wait
        # (TCP retransmits, NCCL's collectives) instead of seeing their connections end.
        if self.host_veth and _link_exists(self.host_veth):
            _ip("link", "set", self.host_veth, "down", check=False)
        # At once: frozen first, so that no process of the node runs between the first SIGKILL and
        # the last (a rank killed before its agent would otherwise be reported by that agent, as a
        # real power cut never lets it). A frozen task dies of SIGKILL without running again.
        try:
            self.freeze()
        except (HarnessError, OSError):
            pass
        for pid in self._cgroups.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.thaw()
        except (HarnessError, OSError):
            pass
        if not self._cgroups.kill_all(tries=250):
            raise HarnessError(f"node {self.name}: processes left after the power cut: {sorted(self._cgroups.pids())}")
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            raise HarnessError(f"node {self.name}: nspawn (pid {self._proc.pid}) does not exit") from None
        if self._root_lock is not None:
            Path(self._root_lock).unlink(missing_ok=True)  # nspawn was killed: its lock stays
        if self.host_veth and _link_exists(self.host_veth):
            _ip("link", "del", self.host_veth, check=False)
        self._proc, self.leader, self.nspawn_pid, self.host_veth = None, None, None, None
        shutil.rmtree(f"/run/systemd/nspawn/propagate/{self.machine}", ignore_errors=True)

    def power_on(self) -> BootResult:
        """Boots the node again from its disk after power_cut(): a fresh systemd that knows none of
        the old units (/run is new), with everything written to disk before the cut."""
        if self._proc is not None:
            raise HarnessError(f"node {self.name} is running")
        if not self._mounted or self._cgroups is None:
            raise HarnessError(f"node {self.name} was never booted")
        t0 = time.monotonic()
        return self._launch(t0, t0 + self.boot_timeout)

    def __enter__(self) -> Node:
        self.boot()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- inside the node -------------------------------------------------------------------

    def _require_running(self) -> int:
        if self.leader is None or self._proc is None or self._proc.poll() is not None:
            raise HarnessError(f"node {self.name} is not running")
        return self.leader

    def run(self, argv: Sequence[str], *, check: bool = True, timeout: float = 60.0,
            input: str | bytes | None = None, env: Mapping[str, str] | None = None,
            text: bool = True) -> subprocess.CompletedProcess:
        """Run argv as root in all of the node's namespaces (not as a unit: no seccomp,
        no cgroup limits). Raises CommandError (check) or subprocess.TimeoutExpired."""
        leader = self._require_running()
        cmd = ["nsenter", "-t", str(leader), "-a", "--", *argv]
        full_env = {"PATH": NODE_PATH, "LANG": "C.UTF-8", "HOME": "/root", **(env or {})}
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=text,
                                env=full_env, start_new_session=True)
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            # nsenter forks into the node's PID namespace: kill the whole group, not just it.
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
        if check and proc.returncode != 0:
            raise CommandError(self.name, proc.returncode, list(argv), out, err)
        return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)

    def run_service(self, argv: Sequence[str], *, properties: Mapping[str, str | int] | None = None,
                    env: Mapping[str, str] | None = None, unit: str | None = None,
                    check: bool = True, timeout: float = 60.0, input: str | bytes | None = None,
                    text: bool = True) -> subprocess.CompletedProcess:
        """Run argv as a transient service of the node's systemd and wait for it; stdin/stdout/
        stderr are piped, the exit status is the service's. The unit is collected afterwards
        even when it fails (use systemd-run through run() to inspect a failed unit)."""
        cmd = ["systemd-run", "--wait", "--pipe", "--quiet", "--collect"]
        if unit:
            cmd.append(f"--unit={unit}")
        cmd += [f"--property={k}={v}" for k, v in (properties or {}).items()]
        cmd += [f"--setenv={k}={v}" for k, v in (env or {}).items()]
        r = self.run([*cmd, "--", *argv], check=False, timeout=timeout, input=input, text=text)
        if check and r.returncode != 0:
            raise CommandError(self.name, r.returncode, list(argv), r.stdout, r.stderr)
        return r

    def show(self, unit: str, *props: str) -> dict[str, str]:
        """`systemctl show -p ...` of a unit as a dict (all properties when none are named)."""
        args = ["systemctl", "show", unit] + [f"--property={p}" for p in props]
        out = self.run(args).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def failed_units(self) -> list[str]:
        out = self.run(["systemctl", "list-units", "--failed", "--plain", "--no-legend",
                        "--no-pager"]).stdout
        return [line.split()[0] for line in out.splitlines() if line.split()]

    def journal(self, unit: str | None = None, fields: Sequence[str] | None = ("MESSAGE",),
                matches: Sequence[str] = ()) -> list[dict[str, str]]:
        """Journal entries of this boot, oldest first, as dicts of the requested fields (all
        fields when fields is None). matches are journalctl matches such as "DSV41_NODE=x".
        journald writes asynchronously: poll when waiting for a message."""
        args = ["journalctl", "--no-pager", "--boot", "--output=json", *matches]
        if unit:
            args.append(f"--unit={unit}")
        out = self.run(args).stdout
        entries = []
        for line in out.splitlines():
            raw = json.loads(line)
            keep = raw if fields is None else {f: raw[f] for f in fields if f in raw}
            entries.append({k: bytes(v).decode(errors="replace") if isinstance(v, list) else str(v)
                            for k, v in keep.items()})
        return entries

    # --- files -------------------------------------------------------------------------------

    def host_path(self, node_path: str) -> Path:
        """Where node_path of the node lives on the host (through the overlay)."""
        if self.root is None or not self._mounted:
            raise HarnessError(f"node {self.name} has no root file system (not booted)")
        p = Path(node_path)
        if not p.is_absolute() or ".." in p.parts:
            raise ValueError(f"node path {node_path!r}: must be absolute, without '..'")
        if p.parts[1:2] == ("tmp",):
            raise ValueError(f"node path {node_path!r}: nspawn mounts a tmpfs on /tmp, so files "
                             "put there from the host are hidden; use /var/tmp")
        return self.root.joinpath(*p.parts[1:])

    def copy_in(self, host_path: Path | str, node_path: str) -> None:
        """Copy a file or directory tree from the host to node_path (parents are created)."""
        dst, src = self.host_path(node_path), Path(host_path)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True)
        else:
            shutil.copy2(src, dst)

    def write_file(self, node_path: str, data: str | bytes, mode: int = 0o644) -> None:
        dst = self.host_path(node_path)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(data.encode() if isinstance(data, str) else data)
        dst.chmod(mode)


class Cluster:
    """Nodes on one bridge, booted and stopped concurrently.

    nodes: name -> IPv4 address ("192.168.241.11"; a bare host index such as "11" also works),
    or a list of names (addresses .11, .12, ... of the bridge). Without a bridge, one is
    created (and its network replaces the one in the addresses' first three octets, so the
    default 192.168.241.x addresses keep working when another run holds that bridge).
    node_options go to every Node (e.g. memory_writable=True)."""

    def __init__(self, rootfs: Path | str, nodes: Mapping[str, str] | Sequence[str], *,
                 bridge: Bridge | None = None, **node_options: object) -> None:
        self.rootfs = Path(rootfs)
        self._spec = (dict(nodes) if isinstance(nodes, Mapping)
                      else {n: str(11 + i) for i, n in enumerate(nodes)})
        self._own_bridge = bridge is None
        self.bridge = bridge or Bridge()
        self._options = node_options
        self.nodes: dict[str, Node] = {}

    def _address(self, spec: str) -> str:
        if spec.isdigit():
            return self.bridge.address(int(spec))
        addr = ipaddress.IPv4Address(spec)
        if self._own_bridge:
            return self.bridge.address(int(addr) & 0xFF)  # own bridges are /24
        if addr not in self.bridge.network:
            raise ValueError(f"address {spec} is not in the bridge's network {self.bridge.network}")
        return str(addr)

    def boot(self) -> dict[str, BootResult]:
        self.bridge.create()
        try:
            self.nodes = {name: Node(name, self.rootfs, bridge=self.bridge,
                                     address=self._address(spec), **self._options)  # type: ignore[arg-type]
                          for name, spec in self._spec.items()}
            with ThreadPoolExecutor(max_workers=len(self.nodes) or 1) as pool:
                futures = {name: pool.submit(n.boot) for name, n in self.nodes.items()}
                return {name: f.result() for name, f in futures.items()}
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout: float = 15.0) -> None:
        """Stop every node (see Node.stop) and delete the bridge if the cluster made it."""
        errors: list[str] = []
        with ThreadPoolExecutor(max_workers=len(self.nodes) or 1) as pool:
            for f in [pool.submit(n.stop, timeout) for n in self.nodes.values()]:
                try:
                    f.result()
                except HarnessError as e:
                    errors.append(str(e))
        if self._own_bridge:
            try:
                self.bridge.delete()
            except HarnessError as e:
                errors.append(str(e))
        if errors:
            raise HarnessError("cluster teardown: " + " | ".join(errors))

    def __getitem__(self, name: str) -> Node:
        return self.nodes[name]

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes.values())

    def __enter__(self) -> Cluster:
        self.boot()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
