"""Where the coordinator's control socket lives and which group may use it."""

CONTROL_SOCKET = "/run/dsv41/control.sock"
CONTROL_GROUP = "dsv41"
