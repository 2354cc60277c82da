"""dsv41ctl loads only what the command it runs needs: its start-up is most of `dsv41ctl status`'s
latency. The parser of one command gives what the whole parser gives."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from coordinator import ctl
from dsv41.v1 import control_pb2 as pb
from dsv41.v1 import control_pb2_grpc

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
# What status through the coordinator never needs: the configuration, the certificate code, the bundle.
NOT_FOR_STATUS = ("coordinator.config", "coordinator.schema", "coordinator.pki", "coordinator.ctl_bundle",
                  "coordinator.control", "coordinator.runtime", "cryptography")


class _Serving(control_pb2_grpc.ControlServicer):
    def GetStatus(self, request, context):
        return pb.ClusterStatus(phase="serving", coordinator_running=True, ranks_running=3, ranks_total=3)


@pytest.fixture
def coordinator_socket(tmp_path):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    control_pb2_grpc.add_ControlServicer_to_server(_Serving(), server)
    path = str(tmp_path / "control.sock")
    server.add_insecure_port(f"unix:{path}")
    server.start()
    yield path
    server.stop(None)


def _modules_after(argv: list[str]) -> tuple[int, set[str]]:
    code = ("import json, sys; from coordinator import ctl; rc = ctl.main(sys.argv[1:]); "
            "sys.stderr.write(json.dumps([rc, sorted(sys.modules)]))")
    done = subprocess.run([sys.executable, "-c", code, *argv], cwd=REPO, capture_output=True, text=True, timeout=60)
    rc, modules = json.loads(done.stderr.strip().splitlines()[-1])
    return rc, set(modules)


def _loaded(modules: set[str], prefixes: tuple[str, ...]) -> set[str]:
    return {m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes)}


def test_status_through_the_coordinator_loads_no_configuration_or_certificate_code(coordinator_socket):
    rc, modules = _modules_after(["status", "--socket", coordinator_socket])
    assert rc == 0
    assert "dsv41.v1.control_pb2" in modules  # the check sees what status loads
    assert _loaded(modules, NOT_FOR_STATUS) == set()


def test_config_check_loads_no_grpc(tmp_path):
    rc, modules = _modules_after(["config", "check", str(tmp_path / "absent.env")])
    assert rc == 1
    assert "coordinator.config" in modules
    assert _loaded(modules, ("grpc", "dsv41.v1", "cryptography")) == set()


def test_every_command_is_declared_by_the_module_the_table_names():
    parser = ctl._parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    assert list(sub.choices) == list(ctl.COMMAND_MODULES)
    for command in ctl.COMMAND_MODULES:
        assert list(ctl._parser(command)._actions[-1].choices) == [command]


@pytest.mark.parametrize("argv", [
    ["status"], ["status", "--json", "--socket", "/x"], ["start", "--wait", "5"], ["events", "-f", "--last", "3"],
    ["pack", "--start"], ["autotune", "reset"], ["share", "unexport", "--force"], ["logs", "-n", "5", "--node", "a"],
    ["pki", "init", "--days", "9"], ["pki", "bundle", "spark2", "-o", "/b"], ["bundle", "--journal-mib", "2"],
    ["config", "show", "--node", "spark1", "/c.env"], ["config", "keys"], ["share"], ["pki"],
])
def test_the_parser_of_one_command_gives_the_whole_parsers_namespace(argv):
    def values(args):  # a parser in the namespace (share's, for its usage) by the usage it prints
        return {k: v.format_usage() if hasattr(v, "format_usage") else v for k, v in vars(args).items()}
    assert values(ctl._parse_one_command(argv)) == values(ctl._parser().parse_args(argv))


@pytest.mark.parametrize("argv", [[], ["-h"], ["bogus"], ["status", "--bogus"], ["config", "show"], ["stat"]])
def test_no_command_or_a_usage_error_goes_to_the_whole_parser(argv):
    assert ctl._parse_one_command(argv) is None


def test_a_usage_error_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exited:
        ctl.main(["status", "--bogus"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: dsv41ctl [-h]") and "unrecognized arguments: --bogus" in err
    assert "{" + ",".join(ctl.COMMAND_MODULES) + "}" in err


def test_a_command_without_its_action_prints_the_whole_help():
    import io
    out, err = io.StringIO(), io.StringIO()
    assert ctl.main(["pki"], out, err) == 2
    assert all(command in err.getvalue() for command in ctl.COMMAND_MODULES)
