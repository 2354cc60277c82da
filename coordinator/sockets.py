"""Where the coordinator's control sockets live and which groups may use them.

control.sock (root:dsv41, 0660) answers everything dsv41ctl asks; status.sock beside it
(root:dsv41-read, 0660) answers only what reads: status, events, logs, pack progress. Both are the
relay's (dsv41/relay.py), which tells the control service the caller's uid.
"""

import os

CONTROL_SOCKET = "/run/dsv41/control.sock"
CONTROL_GROUP = "dsv41"
STATUS_GROUP = "dsv41-read"
STATUS_NAME = "status.sock"
PRIVATE_DIR = "private"  # 0700 root: the gRPC server's own socket


def status_socket(control_socket: str) -> str:
    """The read-only socket beside a control socket."""
    return os.path.join(os.path.dirname(control_socket) or ".", STATUS_NAME)


def private_socket(control_socket: str) -> str:
    """The gRPC server's own socket, in a directory only root can enter."""
    return os.path.join(os.path.dirname(control_socket) or ".", PRIVATE_DIR, "control-grpc.sock")
