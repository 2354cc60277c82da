#!/bin/sh
# TEST-ONLY STAND-IN for mount.nfs4 (nfs-common). The cluster tier (tests/cluster/test_cluster.py)
# installs it as /sbin/mount.nfs4 on the worker nodes only: the test machine's kernel has no NFS
# client, so a worker cannot mount the head's export for real. mount(8) runs /sbin/mount.<type> for
# `-t nfs4`, so the agent's transient mount unit, systemd and mount(8) all run as they do on a Spark.
#
# It mounts only what the head really serves to this worker: it first lists SERVER:/PATH over NFSv4
# with libnfs (nfs-ls; the head runs nfs-ganesha), and fails (exit 32, mount(8)'s "mount failure")
# when the export is missing or refuses this client. Then, instead of the NFS file system, it
# bind-mounts the node's local read-only copy of the model directory ($LOCAL_COPY) at the target.
#
# Called by mount(8) as: mount.nfs4 SERVER:/PATH DIR [-sfnvr] [-N NAMESPACE] [-o OPTIONS]
set -u
LOCAL_COPY=/srv/dsv41-model
spec=${1:?SERVER:/PATH}
dir=${2:?DIR}
server=${spec%%:*}
path=${spec#*:}
say() { echo "mount.nfs4 (test stand-in): $*" >&2; }
# A test holds the mount "in progress" (as a slow NFS server would) while this file exists.
HOLD=/run/dsv41-test-hold-mount
while [ -e "$HOLD" ]; do sleep 0.2; done
if ! listing=$(nfs-ls "nfs://$server$path?version=4" 2>&1); then
    say "$spec is not served to this client: $listing"
    exit 32
fi
case "$listing" in
    *config.json*) ;;
    *) say "$spec is served but holds no config.json: $listing"; exit 32 ;;
esac
say "$spec is served over NFSv4 (nfs-ls); bind-mounting the local copy $LOCAL_COPY at $dir"
exec mount --bind -o ro "$LOCAL_COPY" "$dir"
