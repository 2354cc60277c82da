"""The node-check RPCs' answers to bad and refused requests (agent.rpc_nodechecks), without systemd."""

import os
from dataclasses import dataclass

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.rpc_nodechecks import NodeCheckRpcs, build_node_checks
from agent.systemd import SystemdError
from dsv41.v1 import agent_pb2 as pb
from tests.unit.test_nfs_exports import Events

pytestmark = pytest.mark.unit


class Aborted(Exception):
    pass


class Context:
    def abort(self, code, details):
        self.code, self.details = code, details
        raise Aborted(details)


@dataclass
class RankStatus:
    running: bool


class Rank:
    def __init__(self, running=False):
        self.running = running

    def status(self):
        return RankStatus(self.running)


@dataclass(frozen=True)
class Settings:
    state_dir: str
    sysfs_root: str = "/sys"
    allowed_paths: tuple = ("/srv", "/var/tmp/DeepSeek-V4.1-Flash")
    allowed_mount_servers: tuple = ("10.0.22.0/24",)


class NoSystemd:
    """Every D-Bus call fails: a request that gets that far is answered UNAVAILABLE."""

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise SystemdError(f"{name}: no systemd in unit tests")
        return fail


def handler(tmp_path, running=False, settings=None) -> NodeCheckRpcs:
    settings = settings or Settings(str(tmp_path))
    systemd, events = NoSystemd(), Events()
    # An empty host view: no request can reach this machine's real directories.
    view = tmp_path / "host"
    (view / "var" / "tmp").mkdir(parents=True, exist_ok=True)
    # Files of this test's user count as root's: the paths' owners are checked, not who runs the test.
    checks = build_node_checks(settings, systemd, events, str(view), owner=os.getuid())
    return NodeCheckRpcs(settings, events, Rank(running), lambda: checks)


def abort_of(call, request):
    ctx = Context()
    with pytest.raises(Aborted):
        call(request, ctx)
    return ctx.code, ctx.details


GOOD_EXPORT = dict(path="/srv/models/m", clients=["10.0.0.2"], options="ro,sync", backend="kernel", name="n")
GOOD_MOUNT = dict(what="10.0.22.1:/", where="/var/tmp/DeepSeek-V4.1-Flash", type="nfs4",
                  options="ro,hard,nosuid,nodev", server="10.0.22.1", expected_shards=48)


@pytest.mark.parametrize("field,value,why", [
    ("path", "/", "refused"), ("path", "/etc", "refused"), ("path", "model", "absolute"),
    ("clients", ["0.0.0.0/0"], "wider"), ("options", "rw", "not allowed"), ("backend", "", "kernel, ganesha"),
    ("name", "", "pseudo path")])
def test_ensure_export_rejects_bad_fields(tmp_path, field, value, why):
    code, details = abort_of(handler(tmp_path).EnsureExport, pb.ExportSpec(**{**GOOD_EXPORT, field: value}))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and why in details


@pytest.mark.parametrize("field,value,why", [
    ("where", "/", "refused"), ("where", "/usr/lib/x", "refused"), ("type", "none", "ALLOWED_MOUNT_TYPES"),
    ("type", "ext4", "not allowed"), ("options", "ro,hard,nosuid,nodev,suid", "not allowed"),
    ("options", "ro,hard", "must include nosuid, nodev"), ("what", "spark1:/", "IP address"),
    ("expected_shards", 0, "expected_shards"), ("server", "10.0.0.9", "must be the address in what")])
def test_ensure_mount_rejects_bad_fields(tmp_path, field, value, why):
    code, details = abort_of(handler(tmp_path).EnsureMount, pb.MountSpec(**{**GOOD_MOUNT, field: value}))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and why in details


def test_a_valid_request_without_systemd_is_unavailable(tmp_path):
    code, details = abort_of(handler(tmp_path).EnsureMount, pb.MountSpec(**GOOD_MOUNT))
    assert code == grpc.StatusCode.UNAVAILABLE and details.startswith("systemd over D-Bus:")
    # the agent made the mount point itself, before anyone else could
    assert (tmp_path / "host/var/tmp/DeepSeek-V4.1-Flash").is_dir()


@pytest.mark.parametrize("field,value,why", [
    ("where", "/var/tmp/Other", "not under this node's ALLOWED_PATHS"),
    ("what", "10.0.99.1:/", "not in this node's ALLOWED_MOUNT_SERVERS")])
def test_mounts_outside_the_allowed_paths_and_servers_are_denied(tmp_path, field, value, why):
    request = {**GOOD_MOUNT, field: value}
    if field == "what":
        request["server"] = "10.0.99.1"
    code, details = abort_of(handler(tmp_path).EnsureMount, pb.MountSpec(**request))
    assert code == grpc.StatusCode.PERMISSION_DENIED and why in details

def test_bind_mounts_only_where_the_settings_allow_them(tmp_path):
    @dataclass(frozen=True)
    class TestSettings(Settings):
        allowed_mount_types: tuple = ("nfs4", "none")

    service = handler(tmp_path, settings=TestSettings(str(tmp_path)))
    bind = pb.MountSpec(what="/srv/src", where="/srv/dst", type="none", options="bind,rw", expected_shards=1)
    code, details = abort_of(service.EnsureMount, bind)  # the type passes; rw still does not
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "'rw' is not allowed" in details


def test_remove_export_validates_and_refuses(tmp_path):
    service = handler(tmp_path)
    code, details = abort_of(service.RemoveExport, pb.RemoveExportRequest(mounted_by=["spark2 && reboot"]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "node name" in details


def test_mount_changes_while_the_rank_runs_are_failed_precondition(tmp_path):
    service = handler(tmp_path, running=True)
    code, details = abort_of(service.Remount, pb.RemountRequest())
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "EnsureMount first" in details
    state = service.GetMount(pb.GetMountRequest(), Context())
    assert state.state == pb.MountState.ABSENT and state.detail == "no mount requested"
    assert service.RemoveMount(pb.RemoveMountRequest(), Context()).state == pb.MountState.ABSENT
    assert service.mount_snapshot_pb().state == pb.MountState.ABSENT
    assert not service.export_snapshot_pb().exported


@pytest.mark.parametrize("field,value,why", [("hcas", ["x/y"], "RDMA device"), ("iface", "a b", "interface name"),
                                             ("address", "::1", "IPv4"), ("mtu", 70000, "68..65536")])
def test_check_fabric_rejects_bad_fields(tmp_path, field, value, why):
    good = dict(hcas=["rocep1s0f0"], iface="enp1s0f0np0", address="10.0.0.2", mtu=9000)
    code, details = abort_of(handler(tmp_path).CheckFabric, pb.FabricSpec(**{**good, field: value}))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and why in details


text = st.text(max_size=80) | st.sampled_from(["/", "/etc", "..", "/srv/a/../b", "ro,²=1", "nconnect=٣", "ro,fsid=²",
                                               "10.0.0.1:/", "none", "nfs4", "bind,ro", "0.0.0.0/0", "rocep1s0f0:9"])


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_hostile_requests_are_invalid_argument_never_a_crash(tmp_path_factory, data):
    """Whatever the fields hold, each RPC answers INVALID_ARGUMENT (or, for well-formed requests that
    reach the node's state, FAILED_PRECONDITION/UNAVAILABLE) and nothing else."""
    service = handler(tmp_path_factory.mktemp("agent"))
    rpc, request = data.draw(st.sampled_from([
        (service.EnsureExport, st.builds(pb.ExportSpec, path=text, clients=st.lists(text, max_size=3), options=text,
                                         backend=text, name=text)),
        (service.EnsureMount, st.builds(pb.MountSpec, what=text, where=text, type=text, options=text, server=text,
                                        expected_shards=st.integers(0, 2**32 - 1))),
        (service.RemoveExport, st.builds(pb.RemoveExportRequest, force=st.just(False),
                                         mounted_by=st.lists(text, min_size=1, max_size=3))),
        (service.CheckFabric, st.builds(pb.FabricSpec, hcas=st.lists(text, max_size=3), iface=text, address=text,
                                        mtu=st.integers(0, 2**32 - 1), socket_ifaces=st.lists(text, max_size=3))),
    ]).map(lambda pair: (pair[0], data.draw(pair[1]))))
    ctx = Context()
    try:
        rpc(request, ctx)
    except Aborted:
        assert ctx.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                            grpc.StatusCode.UNAVAILABLE), (ctx.code, ctx.details)
        assert ctx.details
