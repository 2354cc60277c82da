"""A worker's model mount under a real systemd: the transient mount unit's lifecycle (a bind mount
stands in for NFS, which this kernel lacks), and a stale mount (a FUSE file system whose calls
never return) reported within the deadline while the agent keeps serving.

The agent runs as its real unit (with its PrivateTmp=: the mount is under /var/tmp, as the
recipe's COMMON_MODEL is). Bind mounts need ALLOWED_MOUNT_TYPES=nfs4,none in agent.env.
"""

from __future__ import annotations

import concurrent.futures
import struct
import time

import grpc
import pytest

from dsv41.v1 import agent_pb2 as pb
from testbed.nspawn import Node
from tests.integration.agentnode import DROP_IN, REPO, SRC, STANDIN, channel, copy_source, free_port, spec, wait

pytestmark = pytest.mark.integration

# Where these tests mount and from where they bind (and test_nfs_ganesha.py exports).
ALLOWED_PATHS = "/srv/export,/srv/fuse,/srv/models,/var/tmp/dsv41-model,/var/tmp/dsv41-fuse"


def install(node: Node, listen: str, extra: str = "") -> None:
    """The agent from this tree as its real unit (like agentnode.install_agent), listening on `listen`."""
    copy_source(node)
    node.write_file("/etc/systemd/system/dsv41-agent.service", (REPO / "units/dsv41-agent.service").read_text())
    node.write_file("/etc/systemd/system/dsv41-agent.service.d/source.conf", DROP_IN)
    node.write_file("/etc/dsv41/agent.env",
                    f"NODE_NAME={node.name}\nLISTEN={listen}\nINSECURE_NO_TLS=1\nALLOWED_RUNTIMES=host\n"
                    f"ALLOWED_EXECUTABLES={STANDIN}\nALLOWED_PATHS={ALLOWED_PATHS}\nADAPTER_DIR={SRC}/adapter\n{extra}")
    node.run(["systemctl", "daemon-reload"])
    node.run(["systemctl", "start", "dsv41-agent.service"], timeout=60)


def stub_at(address: str, port: int):
    ch = grpc.insecure_channel(f"{address}:{port}")
    grpc.channel_ready_future(ch).result(timeout=20)
    from dsv41.v1 import agent_pb2_grpc
    return agent_pb2_grpc.AgentStub(ch)


def shard_bytes() -> bytes:
    header = b'{"__metadata__":{}}'
    return struct.pack("<Q", len(header)) + header + b"\0" * 32


def model_dir(path, shards: int = 2):
    path.mkdir(parents=True, exist_ok=True)
    # root's, readable by all: an export squashes root on the clients, and the agent refuses a model
    # directory that anyone but root could write
    path.chmod(0o755)
    (path / "config.json").write_text('{"model_type": "deepseek_v4"}\n')
    for i in range(1, shards + 1):
        (path / f"model-{i:05d}-of-{shards:05d}.safetensors").write_bytes(shard_bytes())
    return path


FUSE_MODEL = '''
import errno, os, stat, sys, time, struct, fusepy as fuse
HANG = "/run/dsv41-fuse-hang"
header = b'{"__metadata__":{}}'
SHARD = struct.pack("<Q", len(header)) + header + bytes(32)
FILES = {"/config.json": b'{"model_type": "deepseek_v4"}', "/model-00001-of-00002.safetensors": SHARD,
         "/model-00002-of-00002.safetensors": SHARD}

class Model(fuse.Operations):
    """A model directory that stops answering (like a dead NFS server) while HANG exists."""
    def _wait(self):
        while os.path.exists(HANG):
            time.sleep(0.05)
    def getattr(self, path, fh=None):
        self._wait()
        if path == "/":
            return {"st_mode": stat.S_IFDIR | 0o755, "st_nlink": 2}
        if path in FILES:
            return {"st_mode": stat.S_IFREG | 0o444, "st_nlink": 1, "st_size": len(FILES[path])}
        raise fuse.FuseOSError(errno.ENOENT)
    def readdir(self, path, fh):
        self._wait()
        return [".", ".."] + [p[1:] for p in FILES]
    def open(self, path, flags):
        self._wait()
        return 0
    def read(self, path, size, offset, fh):
        self._wait()
        return FILES[path][offset:offset + size]

fuse.FUSE(Model(), sys.argv[1], foreground=True, ro=True, allow_other=True)
'''


@pytest.fixture(scope="module")
def worker(rootfs, tmp_path_factory):
    export = model_dir(tmp_path_factory.mktemp("export") / "m")
    node = Node("mount1", rootfs, binds=["/dev/fuse"], binds_ro=[f"{export}:/srv/export"])
    node.boot()
    port = free_port()
    try:
        install(node, f"127.0.0.1:{port}", "ALLOWED_MOUNT_TYPES=nfs4,none\n")
        yield node, channel(port), port
    finally:
        node.stop()


def bind(what: str, where: str, shards: int = 2) -> pb.MountSpec:
    return pb.MountSpec(what=what, where=where, type="none", options="bind,ro,nosuid,nodev", expected_shards=shards)


def mounted(node: Node, where: str) -> bool:
    return node.run(["mountpoint", "-q", where], check=False).returncode == 0


def test_mount_unit_lifecycle(worker):
    node, stub, _ = worker
    where, unit = "/var/tmp/dsv41-model", "var-tmp-dsv41\\x2dmodel.mount"
    state = stub.EnsureMount(bind("/srv/export", where), timeout=30)
    assert state.state == pb.MountState.HEALTHY, state
    assert state.unit == unit and state.shards_seen == 2 and "config.json and 2 of 2 shards" in state.detail
    props = node.show(unit, "ActiveState", "Transient", "Where", "Options", "Description", "TimeoutUSec")
    assert props["ActiveState"] == "active" and props["Transient"] == "yes" and props["Where"] == where
    assert props["Description"].startswith("dsv41 model weights") and props["TimeoutUSec"] == "1min 30s"
    assert mounted(node, where)
    assert node.run(["cat", f"{where}/config.json"]).stdout.startswith('{"model_type"')
    assert stub.GetMount(pb.GetMountRequest(), timeout=30).state == pb.MountState.HEALTHY

    # Another spec (here: another expected shard count) replaces the unit; the content does not match.
    wrong = stub.EnsureMount(bind("/srv/export", where, shards=3), timeout=30)
    assert wrong.state == pb.MountState.WRONG_CONTENT and wrong.shards_seen == 0
    assert "found shards of another checkpoint (2 of 00002)" in wrong.detail

    # The agent restarts: the mount stays (it belongs to PID 1) and the agent still knows it.
    node.run(["systemctl", "restart", "dsv41-agent.service"], timeout=60)
    again = wait(lambda: _get_mount(stub))
    assert again.state == pb.MountState.WRONG_CONTENT and again.unit == unit and mounted(node, where)

    # A running rank reads from the mount: neither remount nor removal under it.
    stub.StartRank(pb.StartRankRequest(spec=spec(fingerprint="e1")), timeout=30)
    try:
        with pytest.raises(grpc.RpcError) as info:
            stub.RemoveMount(pb.RemoveMountRequest(), timeout=30)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "the rank is running" in info.value.details()
    finally:
        stub.StopRank(pb.StopRankRequest(deadline_s=5), timeout=30)

    removed = stub.RemoveMount(pb.RemoveMountRequest(), timeout=30)
    assert removed.state == pb.MountState.ABSENT and removed.detail == "removed"
    assert not mounted(node, where)
    assert node.show(unit, "LoadState")["LoadState"] == "not-found"  # the transient unit is gone
    assert stub.GetMount(pb.GetMountRequest(), timeout=30).detail == "no mount requested"
    events = node.journal(matches=["DSV41_EVENT=mount_created"])
    assert events, "the agent logs the mount it created"


def _get_mount(stub):
    try:
        return stub.GetMount(pb.GetMountRequest(), timeout=30)
    except grpc.RpcError:
        return None


def test_nfs_types_are_the_only_ones_by_default_and_bad_mounts_are_refused(worker):
    _, stub, _ = worker
    for request, why in [(bind("/srv/export", "/etc/x"), "refused"),
                         (pb.MountSpec(what="/srv/export", where="/var/tmp/m", type="ext4", options="ro",
                                       expected_shards=1), "not allowed"),
                         (pb.MountSpec(what="10.0.22.1:/", where="/var/tmp/m", type="nfs4", options="rw",
                                       server="10.0.22.1", expected_shards=48), "'rw' is not allowed")]:
        with pytest.raises(grpc.RpcError) as info:
            stub.EnsureMount(request, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in info.value.details()


def test_stale_mount_is_reported_within_the_deadline_while_the_agent_keeps_serving(worker):
    node, stub, _ = worker
    where = "/var/tmp/dsv41-fuse"
    node.run(["mkdir", "-p", "/srv/fuse"])
    node.write_file("/var/tmp/fuse_model.py", FUSE_MODEL)
    node.run(["systemd-run", "--quiet", "--unit=dsv41-fuse-model", "python3", "/var/tmp/fuse_model.py", "/srv/fuse"])
    assert wait(lambda: node.run(["test", "-f", "/srv/fuse/config.json"], check=False).returncode == 0)
    try:
        healthy = stub.EnsureMount(bind("/srv/fuse", where), timeout=30)
        assert healthy.state == pb.MountState.HEALTHY, healthy

        node.run(["touch", "/run/dsv41-fuse-hang"])  # from now on every call into the file system blocks
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(stub.GetMount, pb.GetMountRequest(), timeout=60)
            status = stub.GetStatus(pb.GetStatusRequest(), timeout=10)  # answered while the check is blocked
            assert status.node == "mount1" and not pending.done()
            stale = pending.result()
        assert stale.state == pb.MountState.STALE, stale
        assert "did not return within 5 s" in stale.detail and "stuck in the kernel" in stale.detail
        pid = int(stale.detail.split("probe pid ")[1].split()[0])
        # The abandoned probe is really in uninterruptible sleep, SIGKILL pending and ignored.
        assert node.run(["sh", "-c", f"grep ^State: /proc/{pid}/status"]).stdout.split()[1] == "D"

        later = stub.GetMount(pb.GetMountRequest(), timeout=30)  # no new probe: the stuck one is remembered
        assert later.state == pb.MountState.STALE and f"probe pid {pid} stuck" in later.detail
        assert later.stale_for_s > stale.stale_for_s
        assert stub.GetStatus(pb.GetStatusRequest(), timeout=10).node == "mount1"
        assert node.journal(matches=["DSV41_EVENT=mount_stale"])
    finally:
        node.run(["rm", "-f", "/run/dsv41-fuse-hang"])
    # The file system answers again: the stuck probe finishes and the mount is healthy again.
    recovered = wait(lambda: (s := stub.GetMount(pb.GetMountRequest(), timeout=30)).state == pb.MountState.HEALTHY
                     and s, timeout=30, step=0.2)
    assert recovered and recovered.stale_for_s == 0.0
    assert node.run(["test", "-d", f"/proc/{pid}"], check=False).returncode != 0  # reaped
    assert stub.RemoveMount(pb.RemoveMountRequest(), timeout=30).state == pb.MountState.ABSENT
    node.run(["systemctl", "stop", "dsv41-fuse-model.service"])


def test_check_fabric_in_the_agent_unit_reports_no_rdma_devices(worker):
    _, stub, port = worker
    report = stub.CheckFabric(pb.FabricSpec(hcas=["rocep1s0f0"], iface="lo", address="127.0.0.1", mtu=65536,
                                            socket_ifaces=["lo"],
                                            peers=[pb.Peer(name="self", address="127.0.0.1", port=port)]),
                              timeout=60)
    checks = {c.name: c for c in report.checks}
    assert not report.ok and report.roce_gid_index == -1
    assert checks["rdma devices"].detail.startswith("no RDMA devices on this node")
    assert checks["lo link"].ok and checks["lo mtu"].ok  # the netlink probe ran inside the hardened unit
    assert checks[f"peer self 127.0.0.1:{port}"].ok
