#!/bin/bash
# Installs what the test tiers need on a Debian 12 machine (run as root): the distribution's
# Python packages the .deb runs on, protoc for the stub check, systemd-nspawn + mmdebstrap for the
# integration and cluster tiers, g++ and ninja for the native Engram reader (unit and sglang tiers),
# and the cached SGLang venv for the sglang tier.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends \
    make python3 python3-venv python3-pip python3-pytest python3-hypothesis \
    python3-pydbus python3-gi python3-pyroute2 python3-psutil python3-grpcio python3-protobuf \
    python3-systemd python3-cryptography python3-prometheus-client \
    protobuf-compiler protobuf-compiler-grpc \
    systemd-container mmdebstrap iproute2 fio g++ ninja-build \
    debhelper dh-python pybuild-plugin-pyproject python3-setuptools lintian >/dev/null
"$(dirname "$0")/sglang-venv.sh" >/dev/null
