"""The head's export for real: the agent (as its unit, in a booted node) serves a host directory
with nfs-ganesha; other nodes read it over NFSv4 with libnfs (nfs-ls, nfs-cat), and only the
listed clients can. The kernel has no NFS client here, so this tests the export and the
protocol, not a kernel mount (see test_mount_unit.py for the mount unit)."""

from __future__ import annotations

import grpc
import pytest

from dsv41.v1 import agent_pb2 as pb
from tests.integration.agentnode import free_port, wait
from tests.integration.test_mount_unit import install, model_dir, stub_at

pytestmark = pytest.mark.integration
RECIPE_OPTIONS = "ro,sync,no_subtree_check,no_root_squash,insecure,fsid=0"


@pytest.fixture
def nodes(node, bridge, tmp_path):
    model = model_dir(tmp_path / "model", shards=3)
    br = bridge()
    head = node("nfshead", bridge=br, address=br.address(11), binds_ro=[f"{model}:/srv/models/m"],
                syscalls=["open_by_handle_at"])
    worker = node("nfsw1", bridge=br, address=br.address(12))
    outsider = node("nfsw2", bridge=br, address=br.address(13))
    port = free_port()
    install(head, f"{head.address}:{port}")
    return head, worker, outsider, stub_at(head.address, port), model


def nfs(node, tool, head, path=""):
    return node.run([tool, f"nfs://{head.address}/dsv41-native{path}?version=4"], check=False, timeout=30)


def export(clients):
    return pb.ExportSpec(path="/srv/models/m", clients=clients, options=RECIPE_OPTIONS, backend="ganesha",
                         name="dsv41-native")


def test_ganesha_export_serves_the_listed_clients_and_refuses_to_unexport_under_a_mount(nodes):
    head, worker, outsider, stub, model = nodes
    for path in ("/", "/etc", "/var/lib/dsv41"):
        with pytest.raises(grpc.RpcError) as info:
            stub.EnsureExport(pb.ExportSpec(path=path, clients=[worker.address], options="ro", backend="ganesha",
                                            name="x"), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "refused" in info.value.details()
    assert head.run(["test", "-e", "/etc/ganesha/dsv41.conf"], check=False).returncode != 0

    state = stub.EnsureExport(export([worker.address]), timeout=60)
    assert state.exported and state.path == "/srv/models/m" and list(state.clients) == [worker.address]
    assert "nfs-ganesha (dsv41-nfs-ganesha.service, started)" in state.detail
    # Graceless: served at once, no 90 s NFSv4 grace period.
    listing = nfs(worker, "nfs-ls", head)
    assert listing.returncode == 0, listing.stderr
    names = sorted(line.split()[-1] for line in listing.stdout.splitlines())
    assert names == ["config.json", "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                     "model-00003-of-00003.safetensors"]
    assert nfs(worker, "nfs-cat", head, "/config.json").stdout == (model / "config.json").read_text()
    refused = nfs(outsider, "nfs-ls", head)  # not in clients
    assert refused.returncode != 0 and "NFS4ERR_NOENT" in refused.stderr  # the pseudo path is not shown to it

    pid = head.show("dsv41-nfs-ganesha.service", "MainPID")["MainPID"]
    same = stub.EnsureExport(export([worker.address]), timeout=60)
    assert "running" in same.detail and head.show("dsv41-nfs-ganesha.service", "MainPID")["MainPID"] == pid
    wider = stub.EnsureExport(export([worker.address, outsider.address]), timeout=60)
    assert "restarted" in wider.detail
    assert wait(lambda: nfs(outsider, "nfs-ls", head).returncode == 0, timeout=20)

    with pytest.raises(grpc.RpcError) as info:
        stub.RemoveExport(pb.RemoveExportRequest(mounted_by=["nfsw1", "nfsw2"]), timeout=30)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "mounted by nfsw1, nfsw2" in info.value.details() and "or force" in info.value.details()
    assert nfs(worker, "nfs-ls", head).returncode == 0  # still served
    assert head.journal(matches=["DSV41_EVENT=export_remove_refused"])

    removed = stub.RemoveExport(pb.RemoveExportRequest(force=True, mounted_by=["nfsw1"]), timeout=30)
    assert not removed.exported and removed.detail == "removed (forced)"
    assert head.show("dsv41-nfs-ganesha.service", "LoadState")["LoadState"] == "not-found"
    assert head.run(["test", "-e", "/etc/ganesha/dsv41.conf"], check=False).returncode != 0
    assert nfs(worker, "nfs-ls", head).returncode != 0
    assert stub.RemoveExport(pb.RemoveExportRequest(), timeout=30).detail == "was not exported"

