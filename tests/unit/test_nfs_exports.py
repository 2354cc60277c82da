"""The head's export: exports(5) rendering, the kernel backend's files and exportfs, the
unexport policy (agent.nfs.kernel, agent.nfs.exports). The ganesha backend is exercised for
real in tests/integration/test_nfs_ganesha.py."""

import os
import sys

import pytest

from agent.nfs.errors import Invalid, Refused
from agent.nfs.exports import ExportManager
from agent.nfs.ganesha import GaneshaExporter
from agent.nfs.kernel import KernelExporter, nfsd_clients, parse_header, render_exports
from agent.nfs.spec import check_export
from agent.nfs.units import UnitState

pytestmark = pytest.mark.unit


class Units:
    """Records what would go to systemd; `states` says what each unit is."""

    def __init__(self, **states):
        self.states = {name.replace("_", "-") + ".service": s for name, s in states.items()}
        self.calls = []

    def state(self, name, iface=None):
        loaded = name in self.states
        return UnitState(name, "loaded" if loaded else "", self.states.get(name, "inactive"), "", "", True, "", {})

    def start(self, name, timeout_s):
        self.calls.append(("start", name))
        self.states[name] = "active"
        return "done"

    def stop(self, name, timeout_s):
        self.calls.append(("stop", name))
        self.states.pop(name, None)
        return "done"

    def restart(self, name, timeout_s):
        self.calls.append(("restart", name))
        return "done"

    def start_transient(self, name, props, timeout_s):
        self.calls.append(("start_transient", name))
        self.states[name] = "active"
        return "done"

    def reset_failed(self, name):
        self.calls.append(("reset_failed", name))


class Events:
    def __init__(self):
        self.seen = []

    def info(self, kind, message, **fields):
        self.seen.append(("info", kind, message))

    def warning(self, kind, message, **fields):
        self.seen.append(("warning", kind, message))

    def error(self, kind, message, **fields):
        self.seen.append(("error", kind, message))


def spec(path, clients=("10.0.0.2", "10.0.0.3", "10.0.22.0/24"), backend="kernel"):
    return check_export(path=path, clients=list(clients), options="ro,sync,no_subtree_check,no_root_squash,insecure,"
                        "fsid=0", backend=backend, name="dsv41-native")


@pytest.fixture
def host(tmp_path):
    """A fake host: /etc/exports.d, a model directory, a recording exportfs, a /proc."""
    (tmp_path / "etc/exports.d").mkdir(parents=True)
    (tmp_path / "etc/ganesha").mkdir(parents=True)
    model = tmp_path / "srv/models/m"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    log = tmp_path / "exportfs.log"
    exportfs = [sys.executable, "-c", f"import sys; open({str(log)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')",
                "-ra"]
    return tmp_path, exportfs, log


def kernel(host, units, exportfs=None):
    root, default, _ = host
    return KernelExporter(units, exports_file=str(root / "etc/exports.d/dsv41.exports"),
                          exportfs=exportfs or default, proc_root=str(root / "proc"))


def manager(host, units, events=None, exportfs=None):
    root = host[0]
    ganesha = GaneshaExporter(units, config_file=str(root / "etc/ganesha/dsv41.conf"),
                              port_open=lambda *_: True)
    return ExportManager(kernel(host, units, exportfs), ganesha, events or Events(), view_root=str(root))


def test_exports_file_has_one_line_per_client_and_describes_itself():
    e = spec("/srv/models/m")
    text = render_exports(e)
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    assert lines == ["/srv/models/m 10.0.0.2(ro,sync,no_subtree_check,no_root_squash,insecure,fsid=0)",
                     "/srv/models/m 10.0.0.3(ro,sync,no_subtree_check,no_root_squash,insecure,fsid=0)",
                     "/srv/models/m 10.0.22.0/24(ro,sync,no_subtree_check,no_root_squash,insecure,fsid=0)"]
    back = parse_header(text)
    assert (back.path, back.clients, back.options, back.name) == (e.path, e.clients, e.options, e.name)


def test_kernel_export_writes_atomically_runs_exportfs_and_starts_the_server(host):
    root, _, log = host
    units = Units(nfs_server="inactive")
    k = kernel(host, units)
    status = k.ensure(spec("/srv/models/m"))
    written = (root / "etc/exports.d/dsv41.exports").read_text()
    assert written == render_exports(spec("/srv/models/m"))
    assert oct((root / "etc/exports.d/dsv41.exports").stat().st_mode & 0o777) == "0o644"
    assert os.listdir(root / "etc/exports.d") == ["dsv41.exports"]  # no temporary file left behind
    assert log.read_text() == "-ra\n"
    assert ("start", "nfs-server.service") in units.calls
    assert status.exported and "3 client line(s)" in status.detail and "updated" in status.detail
    again = k.ensure(spec("/srv/models/m"))
    assert "unchanged" in again.detail and log.read_text() == "-ra\n-ra\n"  # exportfs re-syncs every time
    assert k.configured() == spec("/srv/models/m")


def test_kernel_export_failures_say_what_to_do(host):
    root = host[0]
    failing = [sys.executable, "-c", "import sys; sys.stderr.write('exportfs: /srv/models/m does not support NFS "
               "export'); sys.exit(1)"]
    with pytest.raises(Refused, match="failed \\(exit 1\\): exportfs: /srv/models/m does not support NFS export"):
        kernel(host, Units(nfs_server="active"), failing).ensure(spec("/srv/models/m"))
    with pytest.raises(Refused, match="not found: install nfs-kernel-server"):
        kernel(host, Units(nfs_server="active"), ["/nonexistent/exportfs"]).ensure(spec("/srv/models/m"))
    with pytest.raises(Refused, match="nfs-server.service is not installed"):
        kernel(host, Units()).ensure(spec("/srv/models/m"))
    (root / "etc/exports.d/dsv41.exports").unlink()
    (root / "etc/exports.d").rmdir()
    with pytest.raises(Refused, match="exports.d does not exist: install nfs-kernel-server"):
        kernel(host, Units(nfs_server="active")).ensure(spec("/srv/models/m"))


def test_nfsd_clients_are_read_from_proc(tmp_path):
    for n, (address, name) in enumerate([('"10.0.0.2:872"', "spark2"), ('"[fd00::3]:700"', "spark3")]):
        d = tmp_path / f"fs/nfsd/clients/{n + 5}"
        d.mkdir(parents=True)
        (d / "info").write_text(f"clientid: 0x6d0ef9ac5ee8bec{n}\naddress: {address}\nstatus: confirmed\n"
                                f'name: "Linux NFSv4.2 {name}"\nminor version: 2\n')
    assert nfsd_clients(str(tmp_path)) == ["10.0.0.2", "fd00::3"]
    assert nfsd_clients(str(tmp_path / "missing")) == []


def test_unexport_is_refused_while_workers_have_it_mounted(host):
    root = host[0]
    events = Events()
    m = manager(host, Units(nfs_server="active"), events)
    m.ensure(spec("/srv/models/m"))
    exports = root / "etc/exports.d/dsv41.exports"
    with pytest.raises(Refused, match="mounted by spark2, spark3: .*RemoveMount on each worker.*or force"):
        m.remove(False, ("spark2", "spark3"))
    assert exports.exists()
    state = m.remove(True, ("spark2",))
    assert not exports.exists() and state.detail == "removed (forced)" and not state.exported
    assert ("warning", "export_removed") in [(p, k) for p, k, _ in events.seen]
    assert m.remove(False, ()).detail == "was not exported"


def test_unexport_is_refused_while_the_kernel_holds_nfs_clients(host):
    root = host[0]
    m = manager(host, Units(nfs_server="active"))
    m.ensure(spec("/srv/models/m"))
    d = root / "proc/fs/nfsd/clients/9"
    d.mkdir(parents=True)
    (d / "info").write_text('address: "10.0.0.3:700"\n')
    with pytest.raises(Refused, match="NFS client 10.0.0.3"):
        m.remove(False, ())
    d.joinpath("info").unlink()
    assert m.remove(False, ()).detail == "removed"


def test_export_path_must_be_a_directory_and_must_not_lead_into_the_system(host):
    root = host[0]
    m = manager(host, Units(nfs_server="active"))
    with pytest.raises(Refused, match="not a directory"):
        m.ensure(spec("/srv/models/missing"))
    (root / "etc/passwd-dir").mkdir()
    (root / "srv/models/sneaky").symlink_to("/etc/passwd-dir")  # absolute: resolved inside the host view
    with pytest.raises(Invalid, match="resolves to.*'/etc/passwd-dir': refused"):
        m.ensure(spec("/srv/models/sneaky"))
    empty = root / "srv/models/empty"
    empty.mkdir()
    assert "warning: no config.json in /srv/models/empty" in m.ensure(spec("/srv/models/empty")).detail


def test_switching_backend_removes_the_other_one(host):
    root = host[0]
    units = Units(nfs_server="active")
    m = manager(host, units)
    m.ensure(spec("/srv/models/m"))
    assert (root / "etc/exports.d/dsv41.exports").exists()
    units.states.pop("nfs-server.service")  # ganesha refuses to run beside an active kernel server
    state = m.ensure(spec("/srv/models/m", backend="ganesha"))
    assert not (root / "etc/exports.d/dsv41.exports").exists()
    assert (root / "etc/ganesha/dsv41.conf").exists() and state.exported
    assert m.configured().backend == "ganesha"
    assert ("start_transient", "dsv41-nfs-ganesha.service") in units.calls


def test_status_snapshot_needs_no_systemd_and_survives_an_agent_restart(host):
    units = Units(nfs_server="active")
    m = manager(host, units)
    assert m.snapshot().detail == "nothing exported"
    m.ensure(spec("/srv/models/m"))
    assert m.snapshot().exported and "3 client line(s)" in m.snapshot().detail
    restarted = manager(host, units)
    calls = len(units.calls)
    snap = restarted.snapshot()
    assert snap.exported and snap.path == "/srv/models/m" and len(snap.clients) == 3
    assert snap.detail == "configured for kernel; not checked since the agent started"
    assert len(units.calls) == calls
