"""sd_notify(3) without libsystemd: datagrams to $NOTIFY_SOCKET, a no-op when it is unset."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping


class SdNotify:
    """Sends ``KEY=VALUE`` lines to the service manager; ``address`` as in $NOTIFY_SOCKET."""

    def __init__(self, address: str | None) -> None:
        self.address = address or None
        self._sock: socket.socket | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SdNotify:
        env = os.environ if environ is None else environ
        return cls(env.get("NOTIFY_SOCKET"))

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *fields: str) -> None:
        """Send one datagram with the given ``KEY=VALUE`` fields (newlines inside a value are not
        allowed by the protocol and are replaced by spaces)."""
        if self.address is None:
            return
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        payload = "\n".join(f.replace("\n", " ") for f in fields)
        self._sock.sendto(payload.encode(), target)

    def ready(self, status: str | None = None) -> None:
        self.send("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> None:
        self.send(f"STATUS={text}")

    def stopping(self) -> None:
        self.send("STOPPING=1")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
