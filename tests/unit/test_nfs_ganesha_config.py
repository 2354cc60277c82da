"""The nfs-ganesha backend's configuration and its start/restart decisions (agent.nfs.ganesha).
Serving for real: tests/integration/test_nfs_ganesha.py."""

import re

import pytest

from agent.nfs.errors import Refused
from agent.nfs.ganesha import GaneshaExporter, render_ganesha, unit_properties
from agent.nfs.spec import check_export
from tests.unit.test_nfs_exports import Units

pytestmark = pytest.mark.unit


def spec(options="ro,sync,no_subtree_check,no_root_squash,insecure,fsid=0", clients=("10.0.0.2", "10.0.22.0/24")):
    return check_export(path="/srv/models/m", clients=list(clients), options=options, backend="ganesha",
                        name="dsv41-native")


def blocks(text):
    """{block name: body} of the top-level blocks; checks the braces balance."""
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert body.count("{") == body.count("}")
    return {m.group(1): m.group(2) for m in re.finditer(r"^(\w+) \{\n(.*?)^\}", body, re.S | re.M)}


def test_config_serves_one_read_only_export_at_its_pseudo_path_without_grace():
    b = blocks(render_ganesha(spec()))
    assert set(b) == {"NFS_CORE_PARAM", "NFSV4", "EXPORT_DEFAULTS", "EXPORT"}
    assert "Graceless = true;" in b["NFSV4"]
    assert "Protocols = 4;" in b["NFS_CORE_PARAM"] and "Enable_NLM = false;" in b["NFS_CORE_PARAM"]
    export = b["EXPORT"]
    assert 'Path = "/srv/models/m";' in export and 'Pseudo = "/dsv41-native";' in export
    assert "Name = VFS;" in export and "Squash = No_Root_Squash;" in export
    assert "PrivilegedPort = false;" in export  # `insecure`
    # Only the listed clients get access, and only read-only.
    assert re.search(r"^    Access_Type = None;", export, re.M)
    client = re.search(r"CLIENT \{(.*?)\}", export, re.S).group(1)
    assert "Clients = 10.0.0.2, 10.0.22.0/24;" in client and "Access_Type = RO;" in client
    assert "RW" not in render_ganesha(spec())


def test_config_follows_the_export_options():
    b = blocks(render_ganesha(spec(options="ro,root_squash,secure,anonuid=1000,sec=sys:krb5")))["EXPORT"]
    assert "Squash = Root_Squash;" in b and "PrivilegedPort = true;" in b
    assert "Anonymous_Uid = 1000;" in b and "SecType = sys, krb5;" in b


def test_unit_runs_ganesha_in_the_foreground_on_the_dsv41_config():
    props = dict((k, v) for k, _, v in unit_properties("/etc/ganesha/dsv41.conf"))
    (binary, argv, ignore_failure), = props["ExecStart"]
    assert binary == "/usr/bin/ganesha.nfsd" and not ignore_failure
    assert argv[argv.index("-f") + 1] == "/etc/ganesha/dsv41.conf" and "-F" in argv
    assert props["Type"] == "exec" and props["Restart"] == "on-failure"


def exporter(tmp_path, units, port_open=lambda *_: True):
    (tmp_path / "ganesha").mkdir(exist_ok=True)
    return GaneshaExporter(units, config_file=str(tmp_path / "ganesha/dsv41.conf"), port_open=port_open,
                           listen_timeout_s=0.2, sleep=lambda s: None)


def test_start_restart_and_no_op(tmp_path):
    units = Units()
    g = exporter(tmp_path, units)
    assert "started" in g.ensure(spec()).detail
    assert units.calls == [("start_transient", "dsv41-nfs-ganesha.service")]
    assert "running" in g.ensure(spec()).detail and len(units.calls) == 1  # same config: nothing to do
    assert "restarted" in g.ensure(spec(clients=("10.0.0.3",))).detail
    assert units.calls[-1] == ("restart", "dsv41-nfs-ganesha.service")
    assert g.configured().clients == ("10.0.0.3",)
    assert g.remove() and not (tmp_path / "ganesha/dsv41.conf").exists()
    assert units.calls[-1] == ("stop", "dsv41-nfs-ganesha.service")


def test_refuses_beside_another_nfs_server(tmp_path):
    with pytest.raises(Refused, match="nfs-ganesha.service is active and would hold NFS port 2049: stop and disable"):
        exporter(tmp_path, Units(nfs_ganesha="active")).ensure(spec())


def test_a_server_that_never_listens_is_reported_with_where_to_look(tmp_path):
    units = Units()
    g = exporter(tmp_path, units, port_open=lambda *_: False)
    with pytest.raises(Refused, match="does not listen on port 2049: see journalctl -u dsv41-nfs-ganesha.service"):
        g.ensure(spec())
    with pytest.raises(Refused, match="directory is missing"):
        GaneshaExporter(units, config_file=str(tmp_path / "nope/dsv41.conf")).ensure(spec())
