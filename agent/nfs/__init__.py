"""NFS on a node: the head's export (kernel nfsd or nfs-ganesha) and a worker's mount unit.

Nothing here imports more than the standard library and the agent's own D-Bus client: the
long-lived agent must stay small. Blocking file-system checks run in a child process
(agent.nfs.probe), never in the agent.
"""
