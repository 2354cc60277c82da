"""The SGLang API key: its file on the head, and how the plan hands it to rank 0 (never in argv)."""

from __future__ import annotations

import os

import pytest

from coordinator import config, pki, plan
from tests.configtext import HOME, SEED_TEXT, edited

pytestmark = pytest.mark.unit
KEY = "sk-dsv41-0123456789abcdef"


def key_file(tmp_path, text: str = KEY + "\n", mode: int = 0o600):
    path = tmp_path / "api-key"
    path.write_text(text)
    os.chmod(path, mode)
    return str(path)


def test_a_0600_file_of_ours_gives_the_key_without_its_newline(tmp_path):
    assert pki.read_api_key(key_file(tmp_path)) == KEY


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_a_file_readable_by_group_or_other_is_refused_with_the_fix(tmp_path, mode):
    path = key_file(tmp_path, mode=mode)
    with pytest.raises(pki.PkiError) as info:
        pki.read_api_key(path)
    assert str(info.value) == (f"API_KEY_FILE={path}: mode {mode:04o} lets group or other read the key; "
                               f"run `chmod 600 {path}`")


def test_a_file_of_another_user_is_refused(tmp_path):
    path = key_file(tmp_path)
    with pytest.raises(pki.PkiError, match=f"owned by uid {os.geteuid()}, must be owned by uid {os.geteuid() + 1}"):
        pki.read_api_key(path, owner_uid=os.geteuid() + 1)


def test_a_symlink_a_directory_and_a_fifo_are_refused(tmp_path):
    link = tmp_path / "link"
    link.symlink_to(key_file(tmp_path))
    with pytest.raises(pki.PkiError, match="cannot open"):
        pki.read_api_key(str(link))
    with pytest.raises(pki.PkiError, match="must be a regular file"):
        pki.read_api_key(str(tmp_path))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(pki.PkiError, match="must be a regular file"):
        pki.read_api_key(str(fifo))
    with pytest.raises(pki.PkiError, match="cannot open: No such file"):
        pki.read_api_key(str(tmp_path / "absent"))


@pytest.mark.parametrize("text", ["", "\n", "short\n", "two words\n", "line1\nline2\n", "k\u00e9y-with-latin1\n"])
def test_anything_but_one_line_of_printable_ascii_is_refused(tmp_path, text):
    with pytest.raises(pki.PkiError, match="one line of 8 to 4096 printable ASCII"):
        pki.read_api_key(key_file(tmp_path, text))


def cluster(**changes):
    cfg = config.parse(edited(SEED_TEXT, **changes), "cluster.env", HOME)
    return cfg, plan.render_cluster(cfg)


def test_without_a_key_file_no_rank_hears_of_a_key():
    _, plans = cluster()
    for p in plans:
        assert "DSV41_API_KEY_FILE" not in p.rank_spec.env
        assert all("api-key" not in b.target for b in p.rank_spec.binds)


def test_container_rank_0_reads_the_key_from_a_read_only_bind_and_argv_carries_no_key():
    _, plans = cluster(API_KEY_FILE="/etc/dsv41/api-key")
    head, *workers = plans
    assert head.rank_spec.env["DSV41_API_KEY_FILE"] == plan.CONTAINER_API_KEY_PATH
    assert plan.Bind(plan.API_KEY_NODE_PATH, plan.CONTAINER_API_KEY_PATH, True) in head.rank_spec.binds
    argv = head.rank_spec.argv
    assert "--api-key" not in argv and "/etc/dsv41/api-key" not in " ".join(argv)
    assert f"{plan.API_KEY_NODE_PATH}:{plan.CONTAINER_API_KEY_PATH}:ro" in argv
    for p in workers:  # only rank 0 serves HTTP: the workers never get the key
        assert "DSV41_API_KEY_FILE" not in p.rank_spec.env
        assert plan.API_KEY_NODE_PATH not in " ".join(p.rank_spec.argv)


def test_host_rank_0_reads_the_copy_in_the_state_directory():
    _, plans = cluster(API_KEY_FILE="/etc/dsv41/api-key", RANK_RUNTIME="host")
    assert plans[0].rank_spec.env["DSV41_API_KEY_FILE"] == plan.API_KEY_NODE_PATH
    assert "--api-key" not in plans[0].rank_spec.argv


def test_the_key_path_passes_the_agents_bind_and_env_checks():
    from agent import rankspec, settings
    image = "sha256:" + "cd" * 32
    cfg, plans = cluster(API_KEY_FILE="/etc/dsv41/api-key", IMAGE=image)
    head = plans[0].rank_spec
    assert head.argv[head.argv.index("python3") - 1] == image
    s = settings.parse(f"NODE_NAME=spark1\nINSECURE_NO_TLS=1\nALLOWED_IMAGES={image}\n"
                       f"ALLOWED_PATHS=/home/op/NewModels,/home/op/dsv41-engram,/home/op/nccl-2.30.7\n", "agent.env", {})
    launch = rankspec.check_launch(
        runtime=head.runtime, argv=head.argv, env=head.env, fills=head.agent_fills,
        binds=[(b.source, b.target, b.read_only) for b in head.binds], exec_start_pre=head.exec_start_pre,
        exec_stop_post=head.exec_stop_post, stop_timeout_s=head.stop_timeout_s, memory_max=0, memory_high=0,
        fingerprint=plans[0].fingerprint, rank=0, generation="g", fabric_address=plans[0].address,
        hcas=list(plans[0].fabric.hcas), settings=s)
    assert launch.env["DSV41_API_KEY_FILE"] == plan.CONTAINER_API_KEY_PATH


def test_api_key_file_must_be_absolute():
    with pytest.raises(config.ConfigInvalid, match="API_KEY_FILE=api-key: must be an absolute path"):
        cluster(API_KEY_FILE="api-key")
