"""What the NFS operations raise; the RPC layer maps each to a gRPC status."""


class Invalid(ValueError):
    """INVALID_ARGUMENT: a field is malformed or not allowed; the message says which and why."""


class Refused(RuntimeError):
    """FAILED_PRECONDITION: well-formed, but the node's state does not allow it now."""


class Denied(PermissionError):
    """PERMISSION_DENIED: well-formed, but this node's agent.env does not allow it."""
