"""sd_notify datagrams on a real unix socket, filesystem path and abstract namespace."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from dsv41.sdnotify import SdNotify

pytestmark = pytest.mark.unit


def receiver(address: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind("\0" + address[1:] if address.startswith("@") else address)
    s.settimeout(2)
    return s


@pytest.mark.parametrize("abstract", [False, True])
def test_messages_arrive(tmp_path: Path, abstract: bool) -> None:
    address = f"@dsv41-notify-{os.getpid()}" if abstract else str(tmp_path / "notify")
    sock = receiver(address)
    n = SdNotify.from_env({"NOTIFY_SOCKET": address})
    n.ready("starting")
    n.status("layer 1: 0.1/0.2 GiB\nsecond line")
    n.close()
    assert sock.recv(4096) == b"READY=1\nSTATUS=starting"
    assert sock.recv(4096) == b"STATUS=layer 1: 0.1/0.2 GiB second line"
    sock.close()


def test_unset_socket_is_a_no_op() -> None:
    n = SdNotify.from_env({})
    assert not n.enabled
    n.ready()
    n.status("nothing listens")
