"""Validation of export and mount requests (agent.nfs.spec, agent.nfs.paths)."""

import pytest

from agent.nfs.errors import Invalid
from agent.nfs.paths import check_path
from agent.nfs.spec import check_export, check_mount, check_mounted_by
from coordinator import config, plan
from tests.configtext import HOME, SEED_TEXT, edited

pytestmark = pytest.mark.unit

RECIPE_EXPORT = "ro,sync,no_subtree_check,no_root_squash,insecure,fsid=0"
RECIPE_MOUNT = "nfsvers=4.2,ro,nconnect=8,rsize=1048576,wsize=1048576,hard,timeo=600"
# What the plan renders: the recipe's mount with nosuid,nodev, and an export that squashes root.
PLAN_EXPORT = "ro,sync,no_subtree_check,root_squash,secure,fsid=0"
PLAN_MOUNT = "nfsvers=4.2,ro,nosuid,nodev,nconnect=8,rsize=1048576,wsize=1048576,hard,timeo=600"


def export(**kw):
    args = dict(path="/home/op/NewModels/DeepSeek-V4.1-Flash", clients=["10.0.0.2", "10.0.22.0/24"],
                options=RECIPE_EXPORT, backend="kernel", name="dsv41-native")
    args.update(kw)
    return check_export(**args)


def mount(**kw):
    args = dict(what="10.0.22.1:/", where="/var/tmp/DeepSeek-V4.1-Flash", type="nfs4", options=PLAN_MOUNT,
                server="10.0.22.1", expected_shards=48)
    args.update(kw)
    return check_mount(**args)


@pytest.mark.parametrize("backend", ["kernel", "ganesha"])
def test_what_the_coordinator_renders_from_the_recipe_is_accepted(backend):
    cfg = config.parse(edited(SEED_TEXT, NFS_BACKEND=backend), "cluster.env", HOME)
    plans = plan.render_cluster(cfg)
    head = plans[0].export
    e = check_export(path=head.path, clients=head.clients, options=head.options, backend=head.backend, name=head.name)
    assert e.path == "/home/op/NewModels/DeepSeek-V4.1-Flash" and len(e.clients) == 5
    assert e.options == tuple(PLAN_EXPORT.split(","))
    for worker in plans[1:]:
        m = worker.mount
        checked = check_mount(what=m.what, where=m.where, type=m.type, options=m.options, server=m.server,
                              expected_shards=m.expected_shards)
        assert checked.where == "/var/tmp/DeepSeek-V4.1-Flash" and checked.expected_shards == 48
        assert checked.server in ("10.0.22.1", "10.0.23.1")


@pytest.mark.parametrize("path", ["/", "/etc", "/etc/exports.d", "/usr", "/usr/share/x", "/var", "/var/tmp", "/home",
                                  "/home/op", "/root", "/root/.ssh/m", "/home/op/.ssh", "/proc/1", "/sys/class",
                                  "/dev/shm/m", "/run/m", "/boot", "/var/lib/dsv41/state", "/var/log/x", "/tmp",
                                  "/lib/modules"])
def test_system_directories_are_refused(path):
    with pytest.raises(Invalid, match="refused"):
        check_path(path, "path")


@pytest.mark.parametrize("path,why", [("relative/m", "absolute"), ("/srv//m", "normalized"), ("/srv/m/", "normalized"),
                                      ("/srv/../etc", "normalized"), ("/srv/./m", "normalized"),
                                      ("/srv/a b", "letters"), ('/srv/a"b', "letters"), ("/srv/a:b", "letters"),
                                      ("/srv/#m", "letters"), ("", "required"), ("/" + "a" * 1100, "longer")])
def test_malformed_paths_are_refused_with_the_reason(path, why):
    with pytest.raises(Invalid, match=why):
        check_path(path, "path")


def test_model_directories_are_accepted():
    for path in ("/var/tmp/DeepSeek-V4.1-Flash", "/home/op/NewModels/DeepSeek-V4.1-Flash", "/srv/models/m",
                 "/mnt/nvme/m"):
        assert check_path(path, "path") == path


def test_export_options_are_limited_to_a_read_only_set():
    with pytest.raises(Invalid, match="'rw' is not allowed; allowed: .*no_root_squash"):
        export(options="rw,sync")
    with pytest.raises(Invalid, match="must include ro"):
        export(options="sync,no_subtree_check")
    with pytest.raises(Invalid, match="given twice"):
        export(options="ro,sync,sync")
    with pytest.raises(Invalid, match="not allowed"):
        export(options="ro,mp=/x")
    with pytest.raises(Invalid, match="value not allowed"):
        export(options="ro,fsid=../x")
    with pytest.raises(Invalid, match="without blanks"):
        export(options="ro, sync")
    assert export(options="ro,fsid=7,sec=sys:krb5").options == ("ro", "fsid=7", "sec=sys:krb5")


def test_export_clients_are_addresses_or_networks():
    assert export(clients=["10.0.0.2", "10.0.22.0/24", "10.0.0.3/32"]).clients == ("10.0.0.2", "10.0.22.0/24",
                                                                                   "10.0.0.3")
    for bad, why in [("spark2", "IP address or network"), ("10.0.22.1/24", "host bits"), ("0.0.0.0/0", "wider"),
                     ("*", "IP address"), ("10.0.0.2(rw)", "IP address")]:
        with pytest.raises(Invalid, match=why):
            export(clients=[bad])
    with pytest.raises(Invalid, match="at least one"):
        export(clients=[])
    with pytest.raises(Invalid, match="listed twice: 10.0.0.2"):
        export(clients=["10.0.0.2", "10.0.0.2/32"])


def test_export_backend_and_name():
    with pytest.raises(Invalid, match="kernel, ganesha"):
        export(backend="knfsd")
    with pytest.raises(Invalid, match="pseudo path"):
        export(name="a/b")
    with pytest.raises(Invalid, match="refused"):
        export(path="/")


def test_mount_types_come_from_the_node_settings():
    with pytest.raises(Invalid, match="type 'none': not allowed on this node; allowed: nfs4"):
        mount(what="/srv/m", type="none", options="bind,ro,nosuid,nodev", server="")
    bind = mount(what="/srv/m", type="none", options="bind,ro,nosuid,nodev", server="", allowed_types=("nfs4", "none"))
    assert bind.options == ("bind", "ro", "nosuid", "nodev") and bind.server == ""
    with pytest.raises(Invalid, match="must include bind"):
        mount(what="/srv/m", type="none", options="ro", server="", allowed_types=("none",))
    with pytest.raises(Invalid, match="refused"):
        mount(what="/etc", type="none", options="bind,ro,nosuid,nodev", server="", allowed_types=("none",))
    with pytest.raises(Invalid, match="only nfs4"):
        mount(type="cifs", allowed_types=("cifs",))


def test_mount_fields():
    for what in ("spark1:/", "10.0.22.1", "10.0.22.1:relative", "10.0.22.1:/a/../b", "fd00::1:/"):
        with pytest.raises(Invalid, match="what"):
            mount(what=what)
    assert mount(what="[fd00::1]:/dsv41-native", server="fd00::1").server == "fd00::1"
    with pytest.raises(Invalid, match="server '10.0.23.1': must be the address in what"):
        mount(server="10.0.23.1")
    with pytest.raises(Invalid, match="expected_shards 0"):
        mount(expected_shards=0)
    with pytest.raises(Invalid, match="'rw' is not allowed"):
        mount(options="rw,hard")
    with pytest.raises(Invalid, match="nconnect=64.*value not allowed"):
        mount(options="ro,nosuid,nodev,nconnect=64")
    with pytest.raises(Invalid, match="nfsvers=3.*value not allowed"):
        mount(options="ro,nosuid,nodev,nfsvers=3")
    with pytest.raises(Invalid, match="must include nosuid, nodev"):
        mount(options="ro,hard")
    with pytest.raises(Invalid, match="nfs needs nfsvers"):
        mount(type="nfs", options="ro,nosuid,nodev", allowed_types=("nfs",))
    with pytest.raises(Invalid, match="refused"):
        mount(where="/usr/lib")
    with pytest.raises(Invalid, match="mount unit name"):
        mount(where="/srv/" + "-" * 200)


def test_mounted_by_names():
    assert check_mounted_by(["spark2", "spark3", "spark2"]) == ("spark2", "spark3")
    with pytest.raises(Invalid, match="node name"):
        check_mounted_by(["spark2; rm -rf /"])
