"""Finding 4 on SGLang 0.5.23's own HTTP app: /server_info and /get_server_info answer with the
resolved server args, the API key in clear, at the top and again in each scheduler's
internal_states. With the adapter (armed by DSV41_API_KEY_FILE, as on rank 0) both come out
"<redacted>"; without it, SGLang alone shows the key, which is what the test proves the
adapter's hook is for."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sglang.harness import Sglang

pytestmark = pytest.mark.sglang

KEY = "sglang-K3y_from-the-file"
ROUTES = ("server_info", "get_server_info")


def key_file(sglang: Sglang) -> str:
    path = Path(sglang.root) / "server-info-key"
    path.write_text(KEY + "\n")
    path.chmod(0o600)
    return str(path)


def test_sglang_alone_answers_with_the_key(sglang: Sglang) -> None:
    leaky, _ = sglang.check("chk_server_info", "--api-key", KEY, armed=False)
    assert leaky["key_set"] and not leaky["on"] and leaky["marked_redact"] is None
    for route in ROUTES:
        assert leaky[f"{route}_status"] == 200 and leaky[f"{route}_has_key"] is True
        assert leaky[f"{route}_api_key"] == leaky[f"{route}_scheduler_api_key"] == "the key"


def test_the_adapter_redacts_the_key_from_both_routes(sglang: Sglang) -> None:
    armed, err = sglang.check("chk_server_info", env={"DSV41_API_KEY_FILE": key_file(sglang)})
    assert armed["on"] and armed["marked_redact"] == armed["marked_in_http_server"] == "api_key"
    for route in ROUTES:
        assert armed[f"{route}_status"] == 200 and armed[f"{route}_tp_size"] == 1  # the rest is still there
        assert armed[f"{route}_has_key"] is False
        assert armed[f"{route}_api_key"] == armed[f"{route}_scheduler_api_key"] == "<redacted>"
    assert KEY not in err
