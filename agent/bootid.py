"""Which boot of this node the agent runs in.

The kernel's boot ID changes when a machine boots again. A node that is a container (the test
nodes, booted by systemd-nspawn) shares its host's kernel and so its boot ID; PID 1's start time
(in clock ticks since the kernel booted) changes with every boot of the node's own systemd. Both
together name one boot of one node; `systemctl daemon-reexec` keeps PID 1 and so keeps the ID.
"""

from __future__ import annotations

import hashlib


def boot_id(proc_root: str = "/proc") -> str:
    """A short hex ID of this boot; "" when /proc cannot tell."""
    try:
        with open(f"{proc_root}/sys/kernel/random/boot_id") as f:
            kernel = f.read().strip()
        with open(f"{proc_root}/1/stat") as f:
            stat = f.read()
    except OSError:
        return ""
    # Fields after the command name (which may hold spaces) start at ")"; starttime is field 22.
    fields = stat[stat.rfind(")") + 2:].split()
    started = fields[19] if len(fields) > 19 else ""
    return hashlib.sha256(f"{kernel}/{started}".encode()).hexdigest()[:16]
