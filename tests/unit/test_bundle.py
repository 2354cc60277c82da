"""dsv41ctl bundle: what a node sends (its diagnostics, redacted), the tar the coordinator writes
from every node, and the output file dsv41ctl creates."""

import io
import json
import os
import tarfile

import grpc
import pytest

from agent.diagnostics import JournalEntry, NodeDiagnostics, kernel_lines, tail_lines
from agent.rpc_diagnostics import CHUNK_BYTES, held_secrets
from coordinator import config
from coordinator.agents import AgentUnavailable
from coordinator.bundle import BundleWriter, Sources
from coordinator.ctl_bundle import OutputFile
from coordinator.runtime import Incident
from dsv41.redact import Redactor
from dsv41.v1 import agent_pb2 as pb
from dsv41.v1 import control_pb2 as cpb
from tests.configtext import HOME, SEED_TEXT
from tests.rpcfailure import RpcFailure

pytestmark = pytest.mark.unit
KEY = "sk-dsv41-test-0123456789abcdef"
PEM = ("-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\nBKcwggSjAgEAAoIBAQC7\n"
       "-----END PRIVATE KEY-----\n")


def test_redactor_removes_private_key_blocks_and_secrets():
    redact = Redactor([KEY, "short"])
    text = f"a {KEY} b\n{PEM}-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\nshort stays"
    out = redact(text.encode()).decode()
    assert KEY not in out and "MIIEvQIBADANBgkqhkiG9w0BAQEFAASC" not in out
    assert "-----BEGIN PRIVATE KEY----- [redacted]" in out and "a [redacted] b" in out
    assert "-----BEGIN CERTIFICATE-----\nMIIB" in out  # certificates are public
    assert "short stays" in out  # too short to be a key: never matched in ordinary text
    ec = b"-----BEGIN EC PRIVATE KEY-----\nabc\n-----END EC PRIVATE KEY-----"
    assert b"abc" not in redact(ec)
    assert b"tail" not in redact(b"-----BEGIN RSA PRIVATE KEY-----\ntail")  # cut off: removed to the end


def test_tail_lines_keeps_the_newest_within_the_limits_and_says_what_it_cut():
    newest_first = [f"line {i}" for i in range(9, -1, -1)]
    assert tail_lines(newest_first, 1000) == "".join(f"line {i}\n" for i in range(10))
    cut = tail_lines(newest_first, 1000, max_lines=3)
    assert cut.splitlines()[0].startswith("[earlier lines left out") and cut.splitlines()[1:] == [
        "line 7", "line 8", "line 9"]
    assert tail_lines(newest_first, 14).splitlines()[1:] == ["line 8", "line 9"]  # 7 bytes each, newline included
    assert tail_lines(newest_first, 13).splitlines()[1:] == ["line 9"]
    assert tail_lines([], 10) == ""


def test_kernel_lines_keep_gpu_oom_and_mlx5_messages():
    entries = [JournalEntry(1.0, "kernel", 3, m) for m in (
        "NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus", "usb 1-1: new device",
        "python3 invoked oom-killer: gfp_mask=0x140cca", "Out of memory: Killed process 4242 (python3)",
        "mlx5_core 0000:01:00.0: mlx5_cmd_out_err:838: DESTROY_QP", "e1000e: link up")]
    text = kernel_lines(reversed(entries))
    assert "GPU has fallen off the bus" in text and "oom-killer" in text and "Killed process 4242" in text
    assert "DESTROY_QP" in text and "usb" not in text and "e1000e" not in text


class Journal:
    def __init__(self, lines: dict):
        self._lines = lines

    def units(self):
        return list(self._lines) + ["sshd.service", "dsv41-old.service"]

    def newest_first(self, unit):
        return [JournalEntry(float(i), unit, 6, m, "42") for i, m in reversed(list(enumerate(self._lines.get(unit, []))))]

    def kernel_newest_first(self):
        return [JournalEntry(5.0, "kernel", 3, "Out of memory: Killed process 7 (sglang::scheduler)")]


def test_node_diagnostics_hold_every_file_and_no_secret(tmp_path):
    proc = tmp_path / "proc"
    (proc / "pressure").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal: 128 kB\nMemAvailable: 64 kB\n")
    (proc / "buddyinfo").write_text("Node 0, zone Normal 1 2 3\n")
    for resource in ("cpu", "memory"):  # io left out: the file says it could not be read
        (proc / "pressure" / resource).write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    journal = Journal({"dsv41-agent.service": ["agent up"],
                       "dsv41-rank.service": [f"rank line {i}" for i in range(20)] + [f"key {KEY} leaked"]})
    d = NodeDiagnostics(journal, lambda: json.dumps({"node": "spark1", "tls_key": PEM}), Redactor([KEY]),
                        proc_root=str(proc), extra_units=lambda: ["var-tmp-model.mount"])
    files = dict(d.files(1 << 20, rank_lines=5))
    assert set(files) == {"proc/meminfo", "proc/buddyinfo", "proc/pressure/cpu", "proc/pressure/memory",
                          "proc/pressure/io", "agent-status.json", "journal/dsv41-agent.service.log",
                          "journal/dsv41-rank.service.log", "rank-last-lines.log", "kernel.log"}
    assert files["proc/meminfo"].startswith(b"MemTotal:")
    assert files["proc/pressure/io"].startswith(b"cannot read /proc/pressure/io")
    assert b"Killed process 7" in files["kernel.log"]
    last = files["rank-last-lines.log"].decode().splitlines()
    assert len(last) == 6 and last[0].startswith("[earlier lines") and last[-1].endswith("key [redacted] leaked")
    assert b"dsv41-rank.service[42] <6> rank line 0" in files["journal/dsv41-rank.service.log"]
    everything = b"".join(files.values())
    assert KEY.encode() not in everything and b"MIIEvQIBADANBgkqhkiG9w0BAQEFAASC" not in everything


def test_held_secrets_are_the_private_state_files_and_the_tls_key(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "sglang-api-key").write_text(KEY + "\n")
    os.chmod(state / "sglang-api-key", 0o600)
    (state / "dspark_sps.json").write_text("{}")
    os.chmod(state / "dspark_sps.json", 0o644)
    key = tmp_path / "agent.key"
    key.write_text(PEM)
    secrets = held_secrets(str(tmp_path), (str(key), None))
    assert KEY.encode() in secrets and PEM.strip().encode() in secrets and b"{}" not in secrets


class Agent:
    def __init__(self, node, files=None, fail_after=None):
        self.node, self.files, self.fail_after = node, files or {}, fail_after
        self.asked = []

    def collect_diagnostics(self, journal_max_bytes, timeout):
        self.asked.append(journal_max_bytes)
        for i, (path, data) in enumerate(self.files.items()):
            if self.fail_after is not None and i >= self.fail_after:
                raise AgentUnavailable(self.node, "CollectDiagnostics",
                                       RpcFailure(grpc.StatusCode.UNAVAILABLE, "connection refused"))
            for offset in range(0, max(len(data), 1), 4):
                yield pb.DiagnosticChunk(path=path, data=data[offset:offset + 4], last=offset + 4 >= len(data))
        if self.fail_after is not None and self.fail_after >= len(self.files):
            raise AgentUnavailable(self.node, "CollectDiagnostics",
                                   RpcFailure(grpc.StatusCode.UNAVAILABLE, "connection refused"))


def sources(cfg):
    status = cpb.ClusterStatus(phase="failed", phase_detail="health: spark1: not healthy", generation="g1",
                               nodes=[cpb.NodeView(name="spark1", agent_reachable=True,
                                                   status=pb.NodeStatus(rank=pb.RankState(fingerprint="f1")))])
    return Sources(status, [Incident(1764612345.0, "spark3", "rank_exit", f"died; key {KEY}")], {"spark1": "f1"},
                   SEED_TEXT.encode() + f"\n# {KEY}\n".encode(), "a test")


def test_the_bundle_holds_every_node_and_the_cluster_files_without_secrets():
    cfg = config.parse(SEED_TEXT, "/etc/dsv41/cluster.env", HOME)
    agents = {"spark1": Agent("spark1", {"journal/dsv41-agent.service.log": f"up {KEY}\n".encode(),
                                         "../../etc/shadow": b"x", "kernel.log": b""}),
              "spark2": Agent("spark2", {"proc/meminfo": b"MemTotal: 1 kB\n"}),
              "spark3": Agent("spark3", {"proc/meminfo": b"MemTotal: 2 kB\n"}, fail_after=1)}
    out = io.BytesIO()
    notes = BundleWriter(cfg, agents, [KEY], clock=lambda: 1764612345.0).write(out, sources(cfg), 1 << 20)
    assert notes == ["spark3: UNAVAILABLE: connection refused"]
    assert all(a.asked == [1 << 20] for a in agents.values())
    out.seek(0)
    with tarfile.open(fileobj=out) as tar:
        members = {m.name: m for m in tar.getmembers()}
        content = {name: tar.extractfile(m).read() for name, m in members.items()}
    top = "dsv41-bundle-20251201T180545Z"
    assert all(name.startswith(top + "/") for name in members)
    names = {name[len(top) + 1:] for name in members}
    assert names == {"README.txt", "cluster/status.json", "cluster/events.json", "cluster/events.txt",
                     "cluster/plans/spark1.json", "cluster/plans/spark2.json", "cluster/plans/spark3.json",
                     "cluster/fingerprints.json", "cluster/cluster.env",
                     "nodes/spark1/journal/dsv41-agent.service.log", "nodes/spark1/etc/shadow", "nodes/spark1/kernel.log",
                     "nodes/spark2/proc/meminfo", "nodes/spark3/proc/meminfo", "nodes/spark3/UNREACHABLE.txt"}
    assert all(m.mode == 0o640 and m.uname == "root" for m in members.values())
    assert not any(KEY.encode() in data for data in content.values())
    assert b"[redacted]" in content[f"{top}/nodes/spark1/journal/dsv41-agent.service.log"]
    assert json.loads(content[f"{top}/cluster/status.json"])["phase"] == "failed"
    prints = json.loads(content[f"{top}/cluster/fingerprints.json"])
    assert prints["launched"] == {"spark1": "f1"} and prints["running"] == {"spark1": "f1"}
    assert set(prints["rendered"]) == {"spark1", "spark2", "spark3"}
    assert b"spark3 rank_exit: died; key [redacted]" in content[f"{top}/cluster/events.txt"]
    assert b"connection refused" in content[f"{top}/nodes/spark3/UNREACHABLE.txt"]
    assert b"not collected: spark3" in content[f"{top}/README.txt"]
    plan = json.loads(content[f"{top}/cluster/plans/spark2.json"])
    assert plan["node"] == "spark2" and plan["fingerprint"] == prints["rendered"]["spark2"]


def test_the_output_file_is_new_private_and_never_followed(tmp_path):
    path = tmp_path / "b.tar"
    f = OutputFile(str(path))
    f.write(b"data")
    f.close()
    assert path.read_bytes() == b"data" and os.stat(path).st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):
        OutputFile(str(path))
    target = tmp_path / "elsewhere"
    link = tmp_path / "link.tar"
    link.symlink_to(target)
    with pytest.raises(FileExistsError):  # O_EXCL refuses a symbolic link, dangling or not
        OutputFile(str(link))
    assert not target.exists()
    partial = OutputFile(str(tmp_path / "partial.tar"))
    partial.write(b"half")
    partial.discard()
    assert not (tmp_path / "partial.tar").exists()


def test_chunks_of_the_agent_stream_are_at_most_a_mebibyte():
    assert CHUNK_BYTES == 1 << 20
