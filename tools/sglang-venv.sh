#!/bin/bash
# Creates (once) the cached virtual environment for the `sglang` test tier:
# CPU torch 2.13.0 (the build this kind of machine keeps on disk), sglang 0.5.23
# without its GPU dependencies, and the few packages its argument parser and
# adapters import. Prints the venv's path. Re-runs are instant.
set -euo pipefail
VENV="${DSV41_SGLANG_VENV:-/var/tmp/dsv41-sglang-venv}"
STAMP="$VENV/.dsv41-ready-1"
if [ -f "$STAMP" ]; then echo "$VENV"; exit 0; fi
rm -rf "$VENV"
/usr/bin/python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check torch==2.13.0 >&2
"$VENV/bin/pip" install -q --disable-pip-version-check --no-deps sglang==0.5.23 >&2
"$VENV/bin/pip" install -q --disable-pip-version-check numpy orjson psutil pybase64 requests \
    packaging pillow starlette msgspec pydantic pyzmq tqdm IPython aiohttp triton >&2
"$VENV/bin/python" -c "import sglang.srt.server_args" >&2
touch "$STAMP"
echo "$VENV"
