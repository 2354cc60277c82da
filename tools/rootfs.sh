#!/bin/bash
# Builds (once) the Debian bookworm base root file system that the systemd-nspawn
# node harness (testbed/nspawn.py) boots every node from, and prints its path.
#
# The result is cached under ${DSV41_ROOTFS_CACHE:-/var/cache/dsv41-test}/bookworm-<hash>,
# where <hash> covers the package list and this script: a re-run is instant, a
# changed list or script builds a new tree. Nodes never write to it (each boots
# through its own overlayfs), so one tree serves concurrent test runs.
#
# Needs root. Installs mmdebstrap and systemd-container on the host when missing.
# DSV41_ROOTFS_MIRROR overrides the Debian mirror (default deb.debian.org).
set -euo pipefail

PACKAGES=(
    systemd systemd-sysv dbus libpam-systemd python3 iproute2 procps
    python3-pydbus python3-gi python3-pyroute2 python3-psutil python3-grpcio
    python3-protobuf python3-systemd python3-cryptography python3-prometheus-client
    fuse3 python3-fusepy
    nfs-ganesha nfs-ganesha-vfs libnfs-utils
    apt ca-certificates
)
# Units that cannot work in a container, or that would make every boot "degraded"
# for reasons that have nothing to do with the code under test:
# - run-rpc_pipefs.mount: the host kernel has no sunrpc pipefs to mount.
# - getty/console-getty: nspawn runs with --console=read-only; nobody logs in.
# - systemd-timesyncd: the host owns the clock (installed only if pulled in).
MASKED_UNITS=(
    run-rpc_pipefs.mount getty@.service console-getty.service
    systemd-timesyncd.service
)
# Installed but not started at boot: tests that serve NFS start it themselves
# with their own export configuration (the packaged default exports nothing
# useful and its rpc helpers need the missing kernel pieces). The periodic jobs
# (apt, fstrim, e2scrub, dpkg backup) would only add noise and CPU load to tests.
DISABLED_UNITS=(
    nfs-ganesha.service nfs-ganesha-lock.service rpcbind.service rpcbind.socket
    nfs-client.target
    apt-daily.timer apt-daily-upgrade.timer dpkg-db-backup.timer e2scrub_all.timer
    fstrim.timer e2scrub_reap.service
)

MIRROR="${DSV41_ROOTFS_MIRROR:-http://deb.debian.org/debian}"
SECURITY_MIRROR="${DSV41_ROOTFS_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
CACHE="${DSV41_ROOTFS_CACHE:-/var/cache/dsv41-test}"

if [ "$(id -u)" -ne 0 ]; then
    echo "tools/rootfs.sh: must run as root (mmdebstrap --mode=root); running as uid $(id -u)" >&2
    exit 1
fi

SELF="$(readlink -f "${BASH_SOURCE[0]}")"
HASH="$( { printf '%s\n' "${PACKAGES[@]}" "--" "${MASKED_UNITS[@]}" "--" "${DISABLED_UNITS[@]}" \
            "--" "$MIRROR" "$SECURITY_MIRROR"; cat "$SELF"; } | sha256sum | cut -c1-16)"
ROOT="$CACHE/bookworm-$HASH"

if [ -d "$ROOT" ]; then echo "$ROOT"; exit 0; fi

mkdir -p "$CACHE"
# One builder at a time per cache; a second caller waits and then finds the tree.
exec 9>"$CACHE/.lock"
flock 9
if [ -d "$ROOT" ]; then echo "$ROOT"; exit 0; fi

missing=()
command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
command -v systemd-nspawn >/dev/null || missing+=(systemd-container)
if [ ${#missing[@]} -gt 0 ]; then
    echo "tools/rootfs.sh: installing ${missing[*]} on the host" >&2
    apt-get update -q >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >&2
fi

TMP="$ROOT.tmp.$$"
# A failed build leaves nothing behind that a later run could mistake for a tree. Never
# delete through a mount mmdebstrap may have left inside (/dev, /proc, /sys of the host).
cleanup() {
    if grep -q " $TMP/" /proc/mounts; then
        echo "tools/rootfs.sh: not removing $TMP: file systems are still mounted inside" >&2
    else
        rm -rf --one-file-system "$TMP"
    fi
}
trap cleanup EXIT
cleanup

join() { local IFS="$1"; shift; echo "$*"; }
start=$(date +%s)
mmdebstrap --variant=minbase --mode=root --quiet \
    --include="$(join , "${PACKAGES[@]}")" \
    --customize-hook='chroot "$1" passwd -d root' \
    --customize-hook='systemctl --root="$1" enable systemd-networkd.service' \
    --customize-hook="systemctl --root=\"\$1\" mask ${MASKED_UNITS[*]}" \
    --customize-hook="for u in ${DISABLED_UNITS[*]}; do systemctl --root=\"\$1\" disable \"\$u\" 2>/dev/null || true; done" \
    --customize-hook='rm -f "$1"/etc/machine-id && touch "$1"/etc/machine-id' \
    --customize-hook='rm -f "$1"/etc/hostname' \
    --customize-hook='printf "127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n" > "$1"/etc/hosts' \
    bookworm "$TMP" \
    "deb $MIRROR bookworm main" \
    "deb $MIRROR bookworm-updates main" \
    "deb $SECURITY_MIRROR bookworm-security main" >&2
mv -T "$TMP" "$ROOT"
trap - EXIT
echo "tools/rootfs.sh: built $ROOT in $(( $(date +%s) - start )) s ($(du -sh "$ROOT" | cut -f1))" >&2
echo "$ROOT"
