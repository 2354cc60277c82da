#!/bin/bash
# Runs Debian 13 (trixie)'s lintian on the packages `make debs` built (run as root):
#
#   tools/lintian-trixie.sh [OUT]      # OUT: packaging/out by default; `make debs-lintian-trixie`
#
# The build machine is Debian 12, whose lintian does not know trixie's checks (aliased-location
# for files under /lib, among others). This builds once, with mmdebstrap, a minimal trixie tree
# holding lintian, cached under ${DSV41_ROOTFS_CACHE:-/var/cache/dsv41-test}/trixie-lintian-<hash>
# (about 1 minute and 300 MB), then runs lintian inside it with systemd-nspawn on a read-only copy
# of OUT. Exits 1 when lintian reports an error, like `make debs-lintian`.
# DSV41_ROOTFS_MIRROR overrides the Debian mirror (default deb.debian.org).
set -euo pipefail

OUT="$(readlink -f "${1:-$(dirname "$0")/../packaging/out}")"
MIRROR="${DSV41_ROOTFS_MIRROR:-http://deb.debian.org/debian}"
CACHE="${DSV41_ROOTFS_CACHE:-/var/cache/dsv41-test}"

if [ "$(id -u)" -ne 0 ]; then
    echo "tools/lintian-trixie.sh: must run as root (mmdebstrap --mode=root, systemd-nspawn)" >&2
    exit 1
fi
changes=("$OUT"/*.changes)
if [ ! -f "${changes[0]}" ] || [ ${#changes[@]} -ne 1 ]; then
    echo "tools/lintian-trixie.sh: expected one .changes file in $OUT: run make debs first" >&2
    exit 1
fi

# The tree depends only on these (not on the rest of this script, so that an edit does not rebuild it).
TREE="trixie lintian $MIRROR"
HASH="$(echo "$TREE" | sha256sum | cut -c1-16)"
ROOT="$CACHE/trixie-lintian-$HASH"
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock-trixie-lintian"
flock 9
if [ ! -d "$ROOT" ]; then
    missing=()
    command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
    command -v systemd-nspawn >/dev/null || missing+=(systemd-container)
    if [ ${#missing[@]} -gt 0 ]; then
        apt-get update -q >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >&2
    fi
    TMP="$ROOT.tmp.$$"
    trap 'rm -rf --one-file-system "$TMP"' EXIT
    mmdebstrap --variant=apt --mode=root --quiet --include=lintian trixie "$TMP" "deb $MIRROR trixie main" >&2
    mv -T "$TMP" "$ROOT"
    trap - EXIT
fi
mkdir -p "$ROOT/debs"  # the mount point (the tree is read-only while lintian runs)
flock -u 9

nspawn=(systemd-nspawn --quiet --register=no --keep-unit --timezone=off --resolv-conf=off -D "$ROOT" --read-only
        --tmpfs=/tmp --bind-ro="$OUT:/debs" --setenv=LC_ALL=C.UTF-8 --setenv=HOME=/tmp)
name="$(basename "${changes[0]}")"
# The exit status is printed inside: nspawn's own failures must not read as a clean lintian run.
output=$("${nspawn[@]}" /bin/sh -c "echo lintian \$(dpkg-query -W -f '\${Version}' lintian) \
    '(Debian 13 trixie)' on $name; lintian --color=never --display-info --pedantic --tag-display-limit 0 /debs/$name; \
    echo lintian-exit=\$?" 2>&1) || true
printf '%s\n' "$output" | grep -v -e '^lintian-exit=' -e '^Attempted to remove disk file system' || true
code=$(printf '%s\n' "$output" | sed -n 's/^lintian-exit=//p' | tr -dc '0-9')
if [ -z "$code" ]; then
    echo "tools/lintian-trixie.sh: lintian did not run in $ROOT" >&2
    exit 1
fi
errors=$(printf '%s\n' "$output" | grep -c '^E: ' || true)
warnings=$(printf '%s\n' "$output" | grep -c '^W: ' || true)
echo "lintian (trixie): $errors error(s), $warnings warning(s), exit $code (see packaging/LINTIAN.md)"
if [ "$errors" -gt 0 ] || [ "$code" -gt 2 ]; then
    exit 1
fi
exit 0
