"""The API key file (adapter/keyfile.py) and the api_key adapter: the key reaches SGLang's
ServerArgs from DSV41_API_KEY_FILE, a bad file or a key in argv stops the rank, the start-up log
line is redacted, and a target the adapter cannot patch stops the process instead of leaving
SGLang to serve without authentication."""

from __future__ import annotations

import importlib
import io
import os
import pickle
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from adapter import api_key, boot
from adapter.keyfile import VARIABLE, KeyFileError, read_key_file
from adapter.patching import AFTER, AdapterSpec, Installer, Patch, Refused, arm
from dsv41.adapterlog import AdapterLog
from tests.fakepkg import fake_package
from tests.rankentry import adapter_entry, rank_env

pytestmark = pytest.mark.unit

KEY = "s3cret-Key_0123456789"


def key_file(tmp_path: Path, content: bytes | str = KEY + "\n", mode: int = 0o600, name: str = "key") -> str:
    path = tmp_path / name
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    path.chmod(mode)
    return str(path)


# ----- the file rules -----

@pytest.mark.parametrize("content", [KEY, KEY + "\n", KEY + "\r\n", "!" * 8, "~" * 4096 + "\n"])
def test_one_line_of_printable_ascii_is_the_key(tmp_path: Path, content: str) -> None:
    assert read_key_file(key_file(tmp_path, content)) == content.rstrip("\r\n")


@pytest.mark.parametrize(
    "content, what",
    [
        (b"", "empty (it must hold the key on one line)"),
        (b"\n", "empty (it must hold the key on one line)"),
        (b"\n\n", "empty (it must hold the key on one line)"),
        (KEY.encode() + b"\nsecond-line-key\n", "more than one line"),
        (KEY.encode() + b"\n\n", "more than one line"),
        (b"\n" + KEY.encode(), "more than one line"),
        ("s3cret-\u00e9-key".encode(), "not ASCII"),
        (b"s3cret key with spaces", "holds spaces or control characters"),
        (b"s3cret\tkey-tab", "holds spaces or control characters"),
        (b"s3cret\x00key-nul", "holds spaces or control characters"),
        (b"sh0rt", "the key is shorter than 8 characters"),
        (b"k" * 4097, "longer than 4096 characters"),
        (b"k" * 10000, "longer than 4096 characters"),
    ],
)
def test_bad_contents_are_refused_without_quoting_them(tmp_path: Path, content: bytes, what: str) -> None:
    path = key_file(tmp_path, content)
    with pytest.raises(KeyFileError) as info:
        read_key_file(path)
    message = str(info.value)
    assert message.startswith(f"{VARIABLE}={path}: ") and what in message
    for secret in (b"s3cret", b"second-line", b"sh0rt"):
        assert secret.decode() not in message.replace(path, "")


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660, 0o666, 0o700 | 0o040])
def test_group_or_other_readable_files_are_refused(tmp_path: Path, mode: int) -> None:
    path = key_file(tmp_path, mode=mode)
    with pytest.raises(KeyFileError) as info:
        read_key_file(path)
    assert str(info.value) == (f"{VARIABLE}={path}: mode {mode:04o} lets group or other read the key; "
                               "it must be 0600")


def test_owner_only_modes_are_accepted(tmp_path: Path) -> None:
    assert read_key_file(key_file(tmp_path, mode=0o400)) == KEY


def test_missing_empty_relative_and_odd_paths(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")
    with pytest.raises(KeyFileError, match=rf"^{VARIABLE}={missing}: no such file"):
        read_key_file(missing)
    for blank in ("", "  "):
        with pytest.raises(KeyFileError, match=rf"^{VARIABLE} is set but empty"):
            read_key_file(blank)
    with pytest.raises(KeyFileError, match=rf"^{VARIABLE}=key: not an absolute path"):
        read_key_file("key")
    with pytest.raises(KeyFileError, match="not a regular file"):
        read_key_file(str(tmp_path))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(KeyFileError, match="not a regular file"):  # and does not hang on the FIFO
        read_key_file(str(fifo))


def _refusal_as(uid: int, path: str) -> str:
    """read_key_file's refusal as seen by a forked child running as `uid` (root reads any file)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to uid, report, and leave without running pytest's teardown
        try:
            os.close(read_end)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            try:
                read_key_file(path)
                message = "accepted"
            except KeyFileError as exc:
                message = str(exc)
            os.write(write_end, message.encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        message = pipe.read().decode()
    os.waitpid(pid, 0)
    return message


def test_unreadable_file_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        path = key_file(tmp_path, mode=0o000)
        with pytest.raises(KeyFileError) as info:
            read_key_file(path)
        assert str(info.value) == f"{VARIABLE}={path}: cannot be read: Permission denied"
        return
    # pytest's temporary directories are 0700; nobody needs a directory it can pass through.
    with tempfile.TemporaryDirectory(dir="/tmp") as where:
        os.chmod(where, 0o711)
        path = key_file(Path(where), mode=0o000)
        os.chown(path, 65534, 65534)  # nobody's own file, unreadable even to nobody
        assert _refusal_as(65534, path) == f"{VARIABLE}={path}: cannot be read: Permission denied"


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file away needs root")
def test_a_file_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    path = key_file(tmp_path)
    os.chown(path, 65534, 65534)  # nobody could swap the key under a running server
    with pytest.raises(KeyFileError, match=rf"^{VARIABLE}={path}: owned by uid 65534; it must be owned by root"):
        read_key_file(path)
    os.chown(path, 0, 65534)  # root's file in another group is fine at 0600
    assert read_key_file(path) == KEY


def test_the_variable_named_in_messages_can_be_another(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match=r"^OTHER_FILE=/nope: no such file"):
        read_key_file("/nope", variable="OTHER_FILE")


# ----- the adapter's hooks, on stand-ins for SGLang's functions -----

def prepared(**fields):
    """A stand-in for prepare_server_args: returns the parsed record, unresolved."""
    def original(argv):
        return SimpleNamespace(argv=list(argv), api_key=None, admin_api_key=None, **fields)
    return original


def test_no_variable_no_adapter() -> None:
    assert api_key.build({"DSV41_SOURCE": "/m"}, AdapterLog(io.StringIO())) is None
    names = [s.name for s in boot.build_specs({"DSV41_SOURCE": "/m"}, AdapterLog(io.StringIO()))]
    assert "api_key" not in names


def test_the_key_from_the_file_reaches_server_args(tmp_path: Path) -> None:
    path = key_file(tmp_path)
    buf = io.StringIO()
    specs = boot.build_specs({"DSV41_SOURCE": "/m", VARIABLE: path}, AdapterLog(buf))
    (spec,) = [s for s in specs if s.name == "api_key"]
    assert spec.fail_closed is True
    assert [(p.module, p.attr, p.kind) for p in spec.patches] == [
        ("sglang.srt.server_args", "prepare_server_args", "around"),
        ("sglang.srt.entrypoints.engine", "_server_args_for_logging", "after"),
        ("sglang.srt.managers.tokenizer_manager", "TokenizerManager._server_args_for_dump", "after"),
        ("sglang.srt.managers.tokenizer_manager", "TokenizerManager._dump_config_snapshot", "after"),
        ("sglang.srt.sampling.watermarking.core", "redact_watermark_secrets", "after"),
    ]
    server_args = spec.state.around_prepare(prepared(), ["--model-path", "/m"])
    assert server_args.api_key == KEY and server_args.argv == ["--model-path", "/m"]
    assert buf.getvalue() == f"dsv41-adapter: api_key: the HTTP API requires the key read from {VARIABLE}={path}\n"
    assert KEY not in spec.detail


def test_a_bad_file_stops_the_rank_with_the_variable_path_and_reason(tmp_path: Path) -> None:
    path = key_file(tmp_path, mode=0o644)
    spec = api_key.build({VARIABLE: path}, AdapterLog(io.StringIO()))
    with pytest.raises(Refused) as info:
        spec.state.around_prepare(prepared(), [])
    assert isinstance(info.value, SystemExit)  # passes `except Exception` in SGLang and in sitecustomize
    assert str(info.value) == (f"dsv41-adapter: api_key: {VARIABLE}={path}: mode 0644 lets group or other read "
                               "the key; it must be 0600; the rank does not start")
    missing = api_key.build({VARIABLE: str(tmp_path / "gone")}, AdapterLog(io.StringIO()))
    with pytest.raises(Refused, match="no such file"):
        missing.state.around_prepare(prepared(), [])
    empty = api_key.build({VARIABLE: ""}, AdapterLog(io.StringIO()))  # present but empty still means "a key"
    assert empty is not None
    with pytest.raises(Refused, match=f"{VARIABLE} is set but empty"):
        empty.state.around_prepare(prepared(), [])


def test_a_key_also_in_argv_is_refused_because_ps_shows_it(tmp_path: Path) -> None:
    spec = api_key.build({VARIABLE: key_file(tmp_path)}, AdapterLog(io.StringIO()))

    def with_key(argv):
        return SimpleNamespace(api_key="from-argv-1234", admin_api_key=None)

    with pytest.raises(Refused) as info:
        spec.state.around_prepare(with_key, ["--api-key", "from-argv-1234"])
    message = str(info.value)
    assert "--api-key is given" in message and "visible to every local user in ps" in message
    assert "from-argv-1234" not in message and KEY not in message


def test_an_admin_key_in_argv_is_refused_too(tmp_path: Path) -> None:
    spec = api_key.build({VARIABLE: key_file(tmp_path)}, AdapterLog(io.StringIO()))

    def with_admin_key(argv):
        return SimpleNamespace(api_key=None, admin_api_key="admin-argv-5678")

    with pytest.raises(Refused) as info:
        spec.state.around_prepare(with_admin_key, ["--admin-api-key", "admin-argv-5678"])
    message = str(info.value)
    assert "--admin-api-key is given" in message and "remove --admin-api-key" in message
    assert "admin-argv-5678" not in message


def test_a_sealed_record_stops_the_rank(tmp_path: Path) -> None:
    class Sealed:
        api_key = None

        def __setattr__(self, name, value):
            raise AttributeError(f"server_args.{name} assigned after resolution")

    spec = api_key.build({VARIABLE: key_file(tmp_path)}, AdapterLog(io.StringIO()))
    with pytest.raises(Refused, match="cannot set server_args.api_key: AttributeError"):
        spec.state.around_prepare(lambda argv: Sealed(), [])


def test_the_logged_server_args_are_redacted(tmp_path: Path) -> None:
    spec = api_key.build({VARIABLE: key_file(tmp_path)}, AdapterLog(io.StringIO()))
    logged = {"model_path": "/m", "api_key": KEY, "admin_api_key": "admin-key-123", "port": 8888}
    out = spec.state.after_logging(logged, SimpleNamespace())
    assert out == {"model_path": "/m", "api_key": "<redacted>", "admin_api_key": "<redacted>", "port": 8888}
    assert logged["api_key"] == KEY  # a copy: SGLang's own dict is left alone
    assert spec.state.after_logging({"api_key": None}, None) == {"api_key": None}
    with pytest.raises(Refused, match="returned str, not a dict"):
        spec.state.after_logging(f"api_key={KEY}", None)


def test_a_crash_dump_gets_the_server_args_and_config_without_the_key(tmp_path: Path) -> None:
    spec = api_key.build({VARIABLE: key_file(tmp_path)}, AdapterLog(io.StringIO()))

    class ServerArgs:  # what SGLang pickles into a crash dump without watermarking
        def resolved_dict(self):
            return {"model_path": "/m", "api_key": KEY, "admin_api_key": None}

    assert spec.state.after_dump_args(ServerArgs(), None) == {"model_path": "/m", "api_key": "<redacted>",
                                                              "admin_api_key": None}
    assert spec.state.after_dump_args({"api_key": KEY}, None) == {"api_key": "<redacted>"}  # with watermarking
    assert spec.state.after_dump_config({"api_key": KEY, "port": 8888}, None) == {"api_key": "<redacted>",
                                                                                  "port": 8888}
    assert spec.state.after_dump_config(None, None) is None  # SGLang could not serialize its config
    with pytest.raises(Refused, match="_server_args_for_dump returned list, not a dict: cannot redact the API key "
                                      "from a crash dump"):
        spec.state.after_dump_args([KEY], None)


# ----- fail-closed installation -----

SOURCE = textwrap.dedent(
    """
    def prepare_server_args(argv):
        class Args:
            api_key = None

            def resolved_dict(self):
                return {"api_key": self.api_key, "argv": self.argv}
        args = Args()
        args.argv = argv
        return args

    def _server_args_for_logging(server_args):
        return {"api_key": server_args.api_key}

    class TokenizerManager:
        def __init__(self, server_args):
            self.server_args = server_args

        def _server_args_for_dump(self):
            return self.server_args

        def _dump_config_snapshot(self):
            return {"api_key": self.server_args.api_key, "port": 1}

    def redact_watermark_secrets(value):
        return value  # SGLang's own hides only its watermark keys

    def server_info(server_args, internal_states):
        # as /server_info: the resolved args, each scheduler's again, through the redaction
        return redact_watermark_secrets({**server_args.resolved_dict(), "internal_states": internal_states})
    """
)


@pytest.fixture
def pkg(tmp_path: Path, request: pytest.FixtureRequest):
    with fake_package(tmp_path, "dsv41keyfake_", request.node.name, SOURCE) as name:
        yield name


def respec(spec: AdapterSpec, module: str, attrs: dict[str, str] | None = None) -> AdapterSpec:
    """The spec's patches pointed at a stand-in module (attribute names renamed by `attrs`)."""
    attrs = attrs or {}
    patches = tuple(Patch(module, attrs.get(p.attr, p.attr), p.kind, p.hook, p.params) for p in spec.patches)
    return AdapterSpec(spec.name, spec.detail, patches, spec.state, spec.fail_closed)


def test_installed_hooks_set_and_redact_the_key(pkg: str, tmp_path: Path) -> None:
    buf = io.StringIO()
    spec = respec(api_key.build({VARIABLE: key_file(tmp_path)}, AdapterLog(buf)), f"{pkg}.target")
    arm(Installer([spec], AdapterLog(buf), registry_loader=lambda: None))
    module = importlib.import_module(f"{pkg}.target")
    args = module.prepare_server_args(["--port", "1"])
    assert args.api_key == KEY
    assert module._server_args_for_logging(args) == {"api_key": "<redacted>"}
    manager = module.TokenizerManager(args)
    dump = {"server_args": manager._server_args_for_dump(), "resolved_config": manager._dump_config_snapshot()}
    assert dump == {"server_args": {"api_key": "<redacted>", "argv": ["--port", "1"]},
                    "resolved_config": {"api_key": "<redacted>", "port": 1}}
    assert KEY.encode() not in pickle.dumps(dump)
    info = module.server_info(args, [{"api_key": KEY, "admin_api_key": None, "tp_size": 3}])
    assert info == {"api_key": "<redacted>", "argv": ["--port", "1"],
                    "internal_states": [{"api_key": "<redacted>", "admin_api_key": None, "tp_size": 3}]}
    assert buf.getvalue().startswith("dsv41-adapter: api_key installed (key from ")


def test_a_target_it_cannot_patch_stops_the_import(pkg: str, tmp_path: Path) -> None:
    buf = io.StringIO()
    spec = respec(api_key.build({VARIABLE: key_file(tmp_path)}, AdapterLog(buf)), f"{pkg}.target",
                  {"_server_args_for_logging": "_server_args_for_logging_v2"})
    arm(Installer([spec], AdapterLog(buf), registry_loader=lambda: None))
    with pytest.raises(Refused) as info:
        importlib.import_module(f"{pkg}.target")
    assert str(info.value) == (f"dsv41-adapter: api_key could not patch {pkg}.target._server_args_for_logging_v2: "
                               f"{pkg}.target has no _server_args_for_logging_v2; the rank does not start")


def test_a_hook_error_propagates_instead_of_switching_the_adapter_off(pkg: str) -> None:
    calls = []

    def broken(result, *args, **kwargs):
        calls.append(1)
        raise RuntimeError("cannot redact")

    for fail_closed in (False, True):
        spec = AdapterSpec("demo", "d", (Patch(f"{pkg}.target", "_server_args_for_logging", AFTER, broken),),
                           fail_closed=fail_closed)
        inst = Installer([spec], AdapterLog(io.StringIO()), registry_loader=lambda: None)
        sys.modules.pop(f"{pkg}.target", None)
        before = list(sys.meta_path)
        arm(inst)
        module = importlib.import_module(f"{pkg}.target")
        if fail_closed:
            with pytest.raises(RuntimeError, match="cannot redact"):
                module._server_args_for_logging(SimpleNamespace(api_key=KEY))
            assert inst.is_on("demo")
        else:  # the ordinary rule, for contrast: the adapter goes out and SGLang's result passes
            assert module._server_args_for_logging(SimpleNamespace(api_key=KEY)) == {"api_key": KEY}
            assert not inst.is_on("demo")
        sys.meta_path[:] = before
    assert calls == [1, 1]


# ----- in a process, through sitecustomize, as a rank starts -----

FAKE_SGLANG = {
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    "sglang/srt/entrypoints/__init__.py": "",
    "sglang/srt/server_args.py": SOURCE,
    "sglang/srt/entrypoints/engine.py": "from sglang.srt.server_args import _server_args_for_logging\n",
}


def run_rank(tmp_path: Path, env_extra: dict[str, str], fake: dict[str, str] = FAKE_SGLANG) -> subprocess.CompletedProcess:
    site = tmp_path / "fake-sglang"
    for rel, text in fake.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    env = rank_env([str(adapter_entry(tmp_path)), str(site)], PYTHONDONTWRITEBYTECODE="1", DSV41_SOURCE="/models/x",
                   **env_extra)
    code = ("import sglang.srt.entrypoints.engine as e; from sglang.srt.server_args import prepare_server_args; "
            "a = prepare_server_args(['--x']); print(a.api_key == open(%r).read().strip(), "
            "e._server_args_for_logging(a))") % env_extra.get(VARIABLE, "/dev/null")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=60)


def test_a_rank_process_gets_the_key_and_never_prints_it(tmp_path: Path) -> None:
    out = run_rank(tmp_path, {VARIABLE: key_file(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True {'api_key': '<redacted>'}"
    assert KEY not in out.stderr and "api_key installed" in out.stderr


def test_a_rank_process_with_a_bad_file_exits_1_naming_it(tmp_path: Path) -> None:
    path = key_file(tmp_path, content="")
    out = run_rank(tmp_path, {VARIABLE: path})
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip().splitlines()[-1] == (f"dsv41-adapter: api_key: {VARIABLE}={path}: empty (it must hold "
                                                   "the key on one line); the rank does not start")


def test_a_rank_process_whose_sglang_changed_exits_1(tmp_path: Path) -> None:
    changed = {**FAKE_SGLANG, "sglang/srt/server_args.py": SOURCE.replace("def prepare_server_args(argv)",
                                                                          "def prepare_server_args(args)")}
    out = run_rank(tmp_path, {VARIABLE: key_file(tmp_path)}, changed)
    assert out.returncode == 1 and out.stdout == ""
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("dsv41-adapter: api_key could not patch sglang.srt.server_args.prepare_server_args: ")
    assert "parameters argv are gone" in last and last.endswith("; the rank does not start")
