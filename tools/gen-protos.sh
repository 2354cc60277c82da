#!/bin/bash
# Generates dsv41/v1/*_pb2*.py from protos/ with Debian's protoc (3.21) and grpc_python_plugin (1.51).
#   tools/gen-protos.sh OUTDIR_PARENT   write the stubs (normally: dsv41 -> ./dsv41/v1/)
#   tools/gen-protos.sh --check         fail when the committed stubs differ from a fresh generation
set -euo pipefail
cd "$(dirname "$0")/.."
plugin=$(command -v grpc_python_plugin) || { echo "grpc_python_plugin missing: apt-get install protobuf-compiler-grpc" >&2; exit 1; }
command -v protoc >/dev/null || { echo "protoc missing: apt-get install protobuf-compiler" >&2; exit 1; }
gen() {
    protoc -I protos --python_out="$1" --grpc_out="$1" --plugin=protoc-gen-grpc="$plugin" protos/dsv41/v1/*.proto
}
if [ "${1:-}" = "--check" ]; then
    tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
    gen "$tmp"
    for f in "$tmp"/dsv41/v1/*.py; do
        cmp -s "$f" "dsv41/v1/$(basename "$f")" || { echo "dsv41/v1/$(basename "$f") is stale: run make protos" >&2; exit 1; }
    done
    echo "stubs match protos/"
    exit 0
fi
out=$(mktemp -d); trap 'rm -rf "$out"' EXIT
gen "$out"
mkdir -p "$1/v1"
cp "$out"/dsv41/v1/*.py "$1/v1/"
[ -f "$1/v1/__init__.py" ] || echo '"""Generated gRPC stubs (make protos); do not edit."""' > "$1/v1/__init__.py"
