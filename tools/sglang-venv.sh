#!/bin/bash
# Creates (once) the cached Python environment of the real SGLang engine on this kind of machine
# (x86-64, no GPU): CPU torch 2.13.0, sglang 0.5.23 without its GPU dependencies, every package its
# server imports (pinned, from PyPI), and the two CPU shims of tools/engine/shims (sgl_kernel's one
# op a dense model calls; torchvision, which SGLang's config package imports but only vision models
# use). The sglang test tier, the real-engine tier and `make demo ENGINE=sglang` all use it.
# Prints the venv's path. Re-runs are instant; a failed build leaves nothing marked ready.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="${DSV41_SGLANG_VENV:-/var/tmp/dsv41-sglang-venv}"
# The stamp holds a digest of this script, the package list and the shims: a change to any rebuilds.
STAMP="$VENV/.dsv41-ready"
digest=$(cat "$0" "$HERE/engine/server-requirements.txt" "$HERE"/engine/shims/*/*.py | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$digest" ]; then echo "$VENV"; exit 0; fi
rm -rf "$VENV"
/usr/bin/python3 -m venv "$VENV"
pip=("$VENV/bin/pip" install -q --disable-pip-version-check)
# torch first: 2.13.0 is the CPU build on this machine's disk (a bare `torch` would pull a CUDA build).
"${pip[@]}" torch==2.13.0 >&2
"${pip[@]}" --no-deps sglang==0.5.23 >&2
# What SGLang's argument parser and the adapters import, with their own dependencies.
"${pip[@]}" numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq tqdm \
    IPython aiohttp triton >&2
# What the HTTP server, tokenizer manager, scheduler and detokenizer import (sglang's Requires-Dist
# names CUDA-only packages too, hence --no-deps and this list; dill is imported but not declared).
"${pip[@]}" --no-deps -r "$HERE/engine/server-requirements.txt" >&2
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cp -r "$HERE/engine/shims/sgl_kernel" "$HERE/engine/shims/torchvision" "$site/"
"$VENV/bin/python" -c "import sglang.srt.server_args, sglang.srt.entrypoints.http_server" >&2
echo "$digest" > "$STAMP"
echo "$VENV"
