"""The SGLang API key end to end: a cluster of three booted nodes (stand-in engine) brought up with
API_KEY_FILE set on the host where the coordinator runs. Rank 0 serves only with the key (the smoke
test sends it), and the key is nowhere else: not in any process's argv, any node's journal, the
rank unit's environment or the coordinator's log; on the head it is a 0600 file."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import pytest

from coordinator import plan
from tests.integration.simcluster import Coordinator, boot, cluster_env

pytestmark = pytest.mark.integration

KEY = "dsv41-it-K3y_7f3a9c0e51b24d68"
ARGV_SCAN = ("import os\n"
             "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
             "    try:\n"
             "        print(open(f'/proc/{pid}/cmdline', 'rb').read().replace(b'\\0', b' ').decode(errors='replace'))\n"
             "    except OSError:\n"
             "        pass\n")


@pytest.fixture(scope="module")
def serving(rootfs, tmp_path_factory):
    """One cluster boot for every test here, left serving with the key."""
    cluster = boot(rootfs)
    workdir = tmp_path_factory.mktemp("apikey")
    key_file = workdir / "sglang-api-key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)  # root's, like the coordinator: read_api_key refuses anything else
    coordinator = Coordinator(workdir, cluster_env(cluster.nodes, API_KEY_FILE=str(key_file)))
    try:
        coordinator.start()
        status = coordinator.wait_phase("serving", "failed", timeout=120)
        assert status.phase == "serving", f"{status.phase_detail}\n{coordinator.log.read_text()[-3000:]}"
        yield cluster.nodes, coordinator
    finally:
        if coordinator.proc is not None and coordinator.proc.poll() is None:
            coordinator.terminate()
        cluster.stop()


def chat(address: str, key: str | None) -> tuple[int, dict]:
    body = json.dumps({"model": "deepseek-v4.1-flash", "messages": [{"role": "user", "content": "What is 19+23?"}]})
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(f"http://{address}:8888/v1/chat/completions", data=body.encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=20) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {}


def test_rank_0_answers_only_with_the_key(serving):
    nodes, coordinator = serving
    head = nodes["spark1"]
    assert chat(head.address, None)[0] == 401
    assert chat(head.address, "not-the-key-0000")[0] == 401
    status, reply = chat(head.address, KEY)
    assert status == 200 and "42" in reply["choices"][0]["message"]["content"]
    # "serving" means the coordinator's smoke test passed: it sends the key, and it fails a rank 0
    # that answers /v1/models without it.
    assert coordinator.status().phase == "serving"


def test_the_key_file_on_the_head_is_0600_and_only_rank_0_names_it(serving):
    nodes, _ = serving
    head = nodes["spark1"]
    mode, owner = head.run(["stat", "-c", "%a %U", plan.API_KEY_NODE_PATH]).stdout.split()
    assert (mode, owner) == ("600", "root")
    assert head.run(["cat", plan.API_KEY_NODE_PATH]).stdout.strip() == KEY
    for name, node in nodes.items():
        env = node.run(["systemctl", "show", "dsv41-rank.service", "-p", "Environment"]).stdout
        assert KEY not in env, name
        assert (f"DSV41_API_KEY_FILE={plan.API_KEY_NODE_PATH}" in env) == (node is head), (name, env)
        if node is not head:
            assert not node.run(["test", "-e", plan.API_KEY_NODE_PATH], check=False).returncode == 0, name


def test_the_key_is_in_no_argv_on_any_node(serving):
    nodes, coordinator = serving
    for name, node in nodes.items():
        ps = node.run(["ps", "-eo", "args"]).stdout
        assert "dsv41-sim-rank" in ps, (name, ps)  # the scan sees the ranks
        scanned = node.run(["python3", "-c", ARGV_SCAN]).stdout
        assert "dsv41-sim-rank" in scanned and "--model-path" in scanned, (name, scanned[-2000:])
        assert KEY not in ps and KEY not in scanned, name
    with open(f"/proc/{coordinator.proc.pid}/cmdline", "rb") as f:
        assert KEY.encode() not in f.read()


def test_the_key_is_in_no_journal_field_and_no_coordinator_log(serving):
    nodes, coordinator = serving
    for name, node in nodes.items():
        exported = node.run(["journalctl", "-o", "export", "--no-pager"], text=False, timeout=120).stdout
        assert b"dsv41-sim-rank" in exported, name  # the ranks' own lines are there
        assert KEY.encode() not in exported, name
    head_journal = nodes["spark1"].run(["journalctl", "-o", "cat", "--no-pager", "-u", "dsv41-rank.service"]).stdout
    assert "serving deepseek-v4.1-flash" in head_journal, head_journal[-2000:]
    assert KEY not in coordinator.log.read_text()
    assert os.stat(coordinator.config).st_size > 0 and KEY not in coordinator.config.read_text()
