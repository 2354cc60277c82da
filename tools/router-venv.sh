#!/bin/bash
# Creates (once) the cached Python environment of SGLang's model gateway: sglang-router 0.3.2 from
# PyPI and what it requires (setproctitle, aiohttp, orjson, uvicorn, fastapi; no sglang, no torch:
# `python -m sglang_router.launch_router` imports neither). The gateway's test and GATEWAY_PYTHON
# where the rank's runtime has no sglang_router use it. Prints the venv's path. Re-runs are
# instant; a failed build leaves nothing marked ready.
set -euo pipefail
VENV="${DSV41_ROUTER_VENV:-/var/tmp/dsv41-router-venv}"
# The stamp holds a digest of this script: a change to it (the pinned version) rebuilds.
STAMP="$VENV/.dsv41-ready"
digest=$(sha256sum < "$0" | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$digest" ]; then echo "$VENV"; exit 0; fi
rm -rf "$VENV"
/usr/bin/python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check sglang-router==0.3.2 >&2
"$VENV/bin/python" -c "import sglang_router.launch_router" >&2
echo "$digest" > "$STAMP"
echo "$VENV"
