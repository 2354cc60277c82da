"""docs/configuration.md is what tools/config-reference.py writes from the schema, key for key."""

import importlib.util
import io
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from coordinator import schema

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("config_reference", REPO / "tools" / "config-reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules[spec.name]


def test_the_committed_reference_is_the_generated_one():
    gen = _generator()
    committed = (REPO / "docs" / "configuration.md").read_text()
    assert committed == gen.render(gen.schema_rows()), "docs/configuration.md is stale: run `make config-reference`"


def test_every_key_has_its_row_with_default_and_allowed_values():
    text = _generator().render(_generator().schema_rows())
    for key in schema.KEYS:
        assert f"| `{key.name}` |" in text
    assert "| `AGENT_PORT` | integer | `7441` | an integer from 1 to 65535 |" in text
    assert "| `MEMORY_GUARD` | choice | `act` | one of act, observe, off |" in text
    assert "| `HEAD_IP` | text | required |" in text
    for name in schema.UNUSED:
        assert f"| `{name}` |" in text


def test_check_exits_1_with_a_diff_on_a_stale_file(tmp_path):
    gen = _generator()
    stale = tmp_path / "configuration.md"
    stale.write_text(gen.render(gen.schema_rows()).replace("| `AGENT_PORT` | integer | `7441`",
                                                           "| `AGENT_PORT` | integer | `7442`"))
    out = io.StringIO()
    with redirect_stdout(out):
        assert gen.main(["--output", str(stale), "--check"]) == 1
    assert "-| `AGENT_PORT` | integer | `7442`" in out.getvalue()
    assert "+| `AGENT_PORT` | integer | `7441`" in out.getvalue()
    assert gen.main(["--output", str(stale)]) == 0
    assert gen.main(["--output", str(stale), "--check"]) == 0
