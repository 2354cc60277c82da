#!/bin/bash
# Installs what the test tiers need on a Debian 12 machine (run as root): the distribution's
# Python packages the .deb runs on, protoc for the stub check, systemd-nspawn + mmdebstrap for the
# integration and cluster tiers, g++ and ninja for the native Engram reader (unit and sglang tiers),
# the cached SGLang venv for the sglang tier and the cached sglang-router venv (the model gateway's
# test in that tier, and the demo's gateway). Idempotent and quick when everything is there
# (no apt-get at all then): `make test` and `make demo` run it first.
#   tools/install-test-deps.sh            everything
#   tools/install-test-deps.sh --demo     only what the demo needs (no SGLang venv)
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
PACKAGES=(
    make python3 python3-venv python3-pip python3-pytest python3-hypothesis
    python3-pydbus python3-gi python3-pyroute2 python3-psutil python3-grpcio python3-protobuf
    python3-systemd python3-cryptography python3-prometheus-client
    protobuf-compiler protobuf-compiler-grpc
    systemd-container mmdebstrap iproute2 fio g++ ninja-build
    debhelper dh-python pybuild-plugin-pyproject python3-setuptools lintian
)
missing=()
for package in "${PACKAGES[@]}"; do
    status=$(dpkg-query -W -f='${Status}' "$package" 2>/dev/null || true)
    [ "$status" = "install ok installed" ] || missing+=("$package")
done
if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "install-test-deps: missing ${missing[*]}; run as root (sudo) to install them" >&2
        exit 1
    fi
    echo "install-test-deps: installing ${missing[*]}" >&2
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
"$(dirname "$0")/router-venv.sh" >/dev/null
if [ "${1:-}" != "--demo" ]; then
    "$(dirname "$0")/sglang-venv.sh" >/dev/null
fi
