"""RPCs for the node checks: NFS export and mounts, RoCE fabric (filled in by the node-checks work)."""


class NodeCheckRpcs:
    """Mixin of AgentService: uses self._settings, self._systemd, self._events, self._rank."""
