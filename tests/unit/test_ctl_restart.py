"""`dsv41ctl restart [--drain]`: what it asks the coordinator and what it prints."""

import io

import pytest

from coordinator import ctl, ctl_cluster
from dsv41.v1 import control_pb2 as pb

pytestmark = pytest.mark.unit


class Stub:
    """The control socket's answers, as coordinator/control.py gives them."""
    def __init__(self):
        self.asked = []

    def Start(self, request, timeout):
        raise AssertionError("not a start")

    Stop = Start

    def Restart(self, request, timeout):
        self.asked.append(request)
        message = ("drained restart requested (by root): rank 0 refuses new requests and lets those in flight "
                   "finish for up to 600 s (DRAIN_TIMEOUT_S), then the ranks restart") if request.drain \
            else "restart requested (by root)"
        return pb.ActionReply(ok=True, message=message, status=pb.ClusterStatus(phase="serving"))


@pytest.mark.parametrize("argv, drain", [(["restart"], False), (["restart", "--drain"], True)])
def test_restart_asks_for_a_drain_only_with_the_flag_and_returns_once_accepted(monkeypatch, argv, drain):
    stub = Stub()
    monkeypatch.setattr(ctl_cluster, "_stub", lambda socket_path, read_only=False: stub)
    out, err = io.StringIO(), io.StringIO()
    assert ctl.main(argv + ["--socket", "/nonexistent"], out, err) == 0, err.getvalue()
    assert [r.drain for r in stub.asked] == [drain]
    assert ("DRAIN_TIMEOUT_S" in out.getvalue()) is drain


def test_the_restart_help_says_what_the_drain_does(capsys):
    with pytest.raises(SystemExit):
        ctl.main(["restart", "--help"])
    assert "DRAIN_TIMEOUT_S" in capsys.readouterr().out
