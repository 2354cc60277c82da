"""`dsv41ctl share unexport`: who counts as having the export mounted, when the coordinator refuses,
what it asks the agents, and the command line."""

import io

import grpc
import pytest

from coordinator import config, ctl, share
from coordinator import unexport as unexport_mod
from coordinator.agents import AgentUnavailable
from coordinator.runtime import ClusterRuntime
from dsv41.journal import EventLog
from dsv41.v1 import agent_pb2 as pb
from tests.configtext import HOME, SEED_TEXT, edited
from tests.rpcfailure import RpcFailure

pytestmark = pytest.mark.unit
M = pb.MountState


def asked(state=None, error=""):
    return share.Asked(None if state is None else M(state=state), error)


# ----- who pins the export

@pytest.mark.parametrize("state, why", [(M.HEALTHY, "healthy"), (M.STALE, "stale"), (M.MOUNTING, "mounting"),
                                        (M.WRONG_CONTENT, "mounted, wrong content"),
                                        (M.STATE_UNSPECIFIED, "mount state state_unspecified")])
def test_a_present_or_unknown_mount_pins_the_export(state, why):
    assert share.holders({"spark2": asked(state)}) == [("spark2", why)]


@pytest.mark.parametrize("state", [M.ABSENT, M.FAILED])
def test_no_mount_or_a_failed_mount_unit_does_not(state):
    assert share.holders({"spark2": asked(state)}) == []


def test_a_worker_whose_agent_cannot_be_asked_counts_as_mounting():
    held = share.holders({"spark3": asked(error="UNAVAILABLE: connection refused"), "spark2": asked(M.ABSENT)})
    assert held == [("spark3", "agent unreachable: UNAVAILABLE: connection refused")]


def test_running_and_starting_ranks_and_unknown_agents():
    def st(active):
        return share.Asked(pb.NodeStatus(rank=pb.RankState(active_state=active)))
    statuses = {"spark1": st("active"), "spark2": st("activating"), "spark3": st("inactive"),
                "spark4": st("absent"), "spark5": share.Asked(None, "DEADLINE_EXCEEDED: x")}
    assert share.running_ranks(statuses) == [("spark1", "rank active"), ("spark2", "rank activating"),
                                             ("spark5", "agent unreachable: DEADLINE_EXCEEDED: x")]


def test_refusal_names_the_workers_and_what_to_do():
    text = share.refusal("/srv/m", [("spark2", "healthy"), ("spark3", "stale")], [("spark1", "rank active")])
    assert text.startswith("refused: the export of /srv/m is mounted by spark2 (healthy), spark3 (stale); "
                           "ranks run on spark1 (rank active).")
    assert "dsv41ctl stop" in text and "--unmount" in text
    assert "Or add --force to unexport anyway, leaving spark2, spark3 with stale mounts." in text
    stopped = share.refusal("/srv/m", [("spark2", "healthy")], [])
    assert "dsv41ctl stop" not in stopped and "Run `dsv41ctl share unexport --unmount`" in stopped
    starting = share.refusal("", [], [], phase="launch")
    assert "the cluster is starting (phase launch)" in starting and "dsv41ctl stop" in starting
    assert share.refusal("/srv/m", [], [], phase="stopped") == ""
    assert share.refusal("/srv/m", [], [], phase="serving") == ""


def test_whether_an_export_was_removed_is_read_from_the_outcome_not_the_detail():
    E = pb.ExportState
    assert share.export_removed(E(outcome=E.REMOVED, path="/srv/m", detail="anything"))
    assert share.export_removed(E(outcome=E.REMOVED_FORCED, path="/srv/m"))
    assert not share.export_removed(E(outcome=E.WAS_NOT_EXPORTED, detail="removed"))
    # an agent older than the outcome field names a path only for an export it removed
    assert share.export_removed(E(path="/srv/m", detail="was not exported"))
    assert not share.export_removed(E(detail="removed"))


# ----- the runtime's part, over fake agents

class FakeAgent:
    def __init__(self, node, rank="active", mount=M.HEALTHY, down=False):
        self.node, self.rank, self.mount, self.down = node, rank, mount, down
        self.calls = []
        self.exported = node == "spark1"

    def _check(self, what):
        self.calls.append(what)
        if self.down:
            raise AgentUnavailable(self.node, what, OSError("connection refused"))

    def status(self, timeout=None):
        self._check("status")
        return pb.NodeStatus(rank=pb.RankState(active_state=self.rank),
                             export=pb.ExportState(exported=self.exported, path="/srv/m" if self.exported else ""))

    def get_mount(self, timeout=None):
        self._check("get_mount")
        return M(state=self.mount)

    def remove_mount(self, timeout=None):
        self._check("remove_mount")
        if self.rank == "active":
            raise AgentUnavailable(self.node, "RemoveMount", RpcFailure(grpc.StatusCode.FAILED_PRECONDITION,
                                                                  "the rank is running"))
        self.mount = M.ABSENT
        return M(state=M.ABSENT)

    def remove_export(self, force, mounted_by, timeout=None):
        self._check(("remove_export", force, tuple(mounted_by)))
        if mounted_by and not force:
            raise AgentUnavailable(self.node, "RemoveExport", RpcFailure(grpc.StatusCode.FAILED_PRECONDITION,
                                                                   f"export /srv/m is mounted by {', '.join(mounted_by)}"))
        was = self.exported
        self.exported = False
        outcome = ((pb.ExportState.REMOVED_FORCED if force and mounted_by else pb.ExportState.REMOVED) if was
                   else pb.ExportState.WAS_NOT_EXPORTED)
        return pb.ExportState(exported=False, path="/srv/m" if was else "", outcome=outcome,
                              detail=("removed" + (" (forced)" if force else "")) if was else "was not exported")

    def watch_rank(self, on_event, on_lost, stop, heartbeat_ms=0):
        import threading
        thread = threading.Thread(target=stop.wait, daemon=True)
        thread.start()
        return thread


def runtime(rank="active", mounts=(M.HEALTHY, M.HEALTHY), down=()):
    cfg = config.parse(edited(SEED_TEXT, NFS_BACKEND="ganesha"), "cluster.env", HOME)
    names = [n.name for n in cfg.nodes]
    clients = {names[0]: FakeAgent(names[0], rank, M.ABSENT)}
    for name, mount in zip(names[1:], mounts):
        clients[name] = FakeAgent(name, rank, mount, down=name in down)
    log = EventLog("test", {}, stream=io.StringIO(), use_journal=False)
    return ClusterRuntime(cfg, clients, log), clients


def unexport(rt, force, unmount, phase="stopped"):
    """What the supervisor runs for `dsv41ctl share unexport`, in the given phase."""
    return unexport_mod.unexport(rt.clients, rt.cfg.head.name, rt._log, phase, rt._incident, force, unmount)


def test_while_serving_the_head_agent_is_asked_with_the_mounting_workers_and_refuses():
    rt, clients = runtime()
    ok, message = unexport(rt, force=False, unmount=False, phase="serving")
    assert not ok
    assert "mounted by spark2 (healthy), spark3 (healthy)" in message and "ranks run on spark1" in message
    assert ("remove_export", False, ("spark2", "spark3")) in clients["spark1"].calls
    assert clients["spark1"].exported  # still served
    assert "remove_mount" not in clients["spark2"].calls


def test_unmount_is_not_attempted_under_running_ranks():
    rt, clients = runtime()
    ok, message = unexport(rt, force=False, unmount=True)
    assert not ok and "remove_mount" not in clients["spark2"].calls and clients["spark1"].exported


def test_ranks_running_without_mounts_are_refused_by_the_coordinator_itself():
    rt, clients = runtime(mounts=(M.ABSENT, M.ABSENT))
    ok, message = unexport(rt, force=False, unmount=False)
    assert not ok and "ranks run on spark1 (rank active)" in message
    assert not [c for c in clients["spark1"].calls if c[0] == "remove_export"]


def test_stopped_cluster_with_mounts_left_needs_unmount_then_unexports():
    rt, clients = runtime(rank="inactive")
    ok, message = unexport(rt, force=False, unmount=False)
    assert not ok and "ranks run" not in message and "--unmount" in message
    ok, message = unexport(rt, force=False, unmount=True)
    assert ok, message
    assert message == "unexported /srv/m on spark1 (unmounted on spark2; unmounted on spark3)"
    assert clients["spark1"].calls[-1] == ("remove_export", False, ())


def test_an_unreachable_worker_blocks_unless_forced_and_force_is_recorded():
    rt, clients = runtime(rank="inactive", mounts=(M.ABSENT, M.ABSENT), down=("spark3",))
    ok, message = unexport(rt, force=False, unmount=False)
    assert not ok and "spark3 (agent unreachable" in message
    ok, message = unexport(rt, force=True, unmount=False)
    assert ok and "(forced): the mounts on spark3 are stale now" in message
    assert rt.incidents()[-1].kind == "export_forced"


def test_the_supervisor_runs_it_and_a_starting_cluster_is_refused_at_once():
    rt, clients = runtime(rank="inactive", mounts=(M.ABSENT, M.ABSENT))
    rt._set(phase="health")
    ok, message = rt.unexport(force=False, unmount=False, wait_s=5)
    assert not ok and "starting (phase health)" in message and clients["spark1"].calls == []
    rt._set(phase="stopped")
    rt.run(autostart=False)  # finds no running rank to adopt and waits for requests
    try:
        assert rt.unexport(force=False, unmount=False, wait_s=10) == (True, "unexported /srv/m on spark1")
        assert rt.unexport(force=False, unmount=False, wait_s=10) == (True, "nothing was exported on spark1")
    finally:
        rt.shutdown(stop_cluster=False)


# ----- the command line

def run_ctl(*argv):
    out, err = io.StringIO(), io.StringIO()
    return ctl.main(list(argv), out, err), out.getvalue(), err.getvalue()


def test_share_without_an_action_is_a_usage_error():
    code, out, err = run_ctl("share")
    assert code == 2 and out == ""
    assert err.startswith("usage: dsv41ctl share") and "name an action: unexport" in err


def test_unexport_options_parse():
    from coordinator import ctl_cluster
    args = ctl._parser().parse_args(["share", "unexport"])
    assert (args.force, args.unmount, args.handler) == (False, False, ctl_cluster._share_unexport)
    args = ctl._parser().parse_args(["share", "unexport", "--force", "--unmount", "--socket", "/x"])
    assert (args.force, args.unmount, args.socket) == (True, True, "/x")


def test_unexport_without_a_coordinator_exits_3(tmp_path):
    code, out, err = run_ctl("share", "unexport", "--socket", str(tmp_path / "none.sock"))
    assert code == 3 and "cannot reach the coordinator" in err


def test_a_refusal_exits_1_with_the_reason_on_stderr(monkeypatch):
    from coordinator import ctl_cluster
    from dsv41.v1 import control_pb2 as cpb
    sent = []

    class Stub:
        def UnexportShare(self, request, timeout):
            sent.append(request)
            return cpb.ActionReply(ok=request.force, message="refused: mounted by spark2" if not request.force
                                   else "unexported")
    monkeypatch.setattr(ctl_cluster, "_stub", lambda socket: Stub())
    code, out, err = run_ctl("share", "unexport")
    assert (code, out, err) == (1, "", "refused: mounted by spark2\n")
    code, out, err = run_ctl("share", "unexport", "--force")
    assert (code, out, err) == (0, "unexported\n", "")
    assert [r.force for r in sent] == [False, True]
