"""A byte relay in front of a gRPC server: connection limits, and the peer's identity for the server.

gRPC Python 1.51 can neither limit connections nor tell a server who is on the other end of a
unix socket. So the public socket (the agent's TCP port, the coordinator's control socket) is
accepted here, counted, and relayed byte for byte to the real server, which listens on a unix
socket in a directory only root can enter. Each relayed connection comes from an abstract unix
address that names the peer (`dsv41-peer/control/uid=1000/pid=4242/7`, `dsv41-peer/agent/10.0.0.1/7`):
the server reads it back from `context.peer()` and can trust it, because only root can reach the
real server. TLS, if any, passes through untouched and ends in gRPC.

One thread runs every connection (selectors); nothing here blocks on a peer. At the total or
per-source limit, a new connection takes the place of the oldest one whose caller has not sent a
byte (an idle flood cannot keep a real caller out, whose TLS hello or HTTP/2 preface comes at
once); when every caller has spoken, the new one is closed at once.
gRPC's own handshake timeout ends the connections that never speak.
"""

from __future__ import annotations

import errno
import os
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

PEER_PREFIX = "dsv41-peer/"
_BUFFER = 256 << 10  # per direction; reading stops while the other side has this much unsent
_CHUNK = 64 << 10
_RETRY_S = 0.005  # while a caller waits for room in the server's backlog


@dataclass(frozen=True)
class Limits:
    max_connections: int = 256
    max_per_source: int = 32
    # A full backlog on the server's socket (its accept thread behind a burst of callers) answers a
    # unix connect with EAGAIN at once: a caller waits this long for room, not turned away at once.
    connect_wait_s: float = 2.0


@dataclass(frozen=True)
class Peer:
    """Who is on the other end of a relayed connection, as the relay saw it."""
    tag: str  # which listener accepted it ("agent", "control", "status")
    source: str  # "10.0.0.1:51234" (TCP) or "" (unix)
    uid: int = -1  # unix only: SO_PEERCRED of the connecting process
    pid: int = 0

    @property
    def source_key(self) -> str:
        return f"uid={self.uid}" if self.uid >= 0 else self.source.rpartition(":")[0].strip("[]")


def peer_name(peer: Peer, serial: int) -> str:
    """The abstract unix address the relay connects from (without the leading NUL)."""
    if peer.uid >= 0:
        return f"{PEER_PREFIX}{peer.tag}/uid={peer.uid}/pid={peer.pid}/{serial}"
    return f"{PEER_PREFIX}{peer.tag}/{peer.source}/{serial}"


def parse_peer(grpc_peer: str) -> Peer | None:
    """The Peer a relayed call came from, from gRPC's context.peer(); None for any other peer."""
    prefix = "unix-abstract:" + PEER_PREFIX
    if not grpc_peer.startswith(prefix):
        return None
    parts = grpc_peer[len(prefix):].split("/")
    if len(parts) == 4 and parts[1].startswith("uid=") and parts[2].startswith("pid="):
        try:
            return Peer(parts[0], "", int(parts[1][4:]), int(parts[2][4:]))
        except ValueError:
            return None
    if len(parts) == 3:
        return Peer(parts[0], parts[1])
    return None


def _refuse(sock: socket.socket) -> None:
    """Closes an accepted connection with a FIN, not a reset: what the client sent is read first
    (a reset can leave a gRPC client's channel refusing to reconnect for a long while)."""
    try:
        sock.setblocking(False)
        while sock.recv(65536):
            pass
    except OSError:
        pass
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    sock.close()


def _has_sent(sock: socket.socket) -> bool:
    """Whether the caller's bytes wait to be read (peeked, left in place)."""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:  # nothing waiting (BlockingIOError), or reset: nothing to keep
        return False


def _peercred(sock: socket.socket) -> tuple[int, int, int]:
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid, gid


@dataclass
class _Half:
    sock: socket.socket
    out: bytearray = field(default_factory=bytearray)  # bytes waiting to be written to sock
    eof: bool = False  # sock said it sends no more


class _Pair:
    def __init__(self, client: socket.socket, upstream: socket.socket, peer: Peer, opened: float):
        self.client = _Half(client)
        self.upstream = _Half(upstream)
        self.peer = peer
        self.closed = False
        self.opened = opened
        self.spoke = False  # the caller sent something (its TLS hello, its HTTP/2 preface)

    def other(self, half: _Half) -> _Half:
        return self.upstream if half is self.client else self.client


class Relay:
    """Relays connections accepted on the listeners to the unix socket `upstream`."""

    def __init__(self, upstream: str, limits: Limits = Limits(),
                 refused: Callable[[Peer, str], None] = lambda peer, why: None,
                 monotonic: Callable[[], float] = time.monotonic):
        self._upstream = upstream
        self._limits = limits
        self._refused = refused
        self._monotonic = monotonic
        self._selector = selectors.DefaultSelector()
        self._listeners: dict[socket.socket, str] = {}
        self._pairs: set[_Pair] = set()
        self._connecting: list[_Pair] = []  # accepted, waiting for room in the server's backlog
        self._per_source: dict[str, int] = {}
        self._serial = 0
        self._last_report: dict[str, float] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="relay", daemon=True)

    # -- set-up

    def listen_tcp(self, host: str, port: int, tag: str, backlog: int = 1024) -> int:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        self._add(sock, tag)
        return sock.getsockname()[1]

    def listen_unix(self, path: str, tag: str, mode: int = 0o660, group: int | None = None,
                    backlog: int = 128) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o777 & ~mode)  # the socket is born with its mode: no window for others
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        if group is not None:
            try:
                os.chown(path, -1, group)
            except PermissionError:
                pass  # not root (a test): the owner's group stays
        os.chmod(path, mode)
        sock.listen(backlog)
        self._add(sock, tag)

    def _add(self, sock: socket.socket, tag: str) -> None:
        sock.setblocking(False)
        self._listeners[sock] = tag
        self._selector.register(sock, selectors.EVENT_READ, ("listen", sock))

    def start(self) -> "Relay":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread.is_alive():
            self._thread.join(5.0)

    @property
    def connections(self) -> int:
        return len(self._pairs)

    # -- the loop

    def _run(self) -> None:
        try:
            while not self._stopping:
                for key, events in self._selector.select(timeout=_RETRY_S if self._connecting else 1.0):
                    kind, obj = key.data
                    try:
                        if kind == "listen":
                            self._accept(obj)
                        elif kind == "pair":
                            pair, half = obj
                            self._service(pair, half, events)
                    except Exception as exc:  # noqa: BLE001 - one bad connection must not end the relay
                        if kind == "pair":
                            self._close(obj[0])
                        self._report(Peer("relay", ""), f"relay error: {type(exc).__name__}: {exc}")
                if self._connecting:
                    self._retry_connects()
                if self._stopping:
                    break
        finally:
            for pair in list(self._pairs):
                self._close(pair)
            for sock in list(self._listeners):
                self._selector.unregister(sock)
                sock.close()
            self._selector.close()

    def _accept(self, listener: socket.socket) -> None:
        for _ in range(64):  # a burst at a time, so one flood cannot starve the other sockets
            try:
                client, address = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._report(Peer("relay", ""), f"cannot accept: {exc.strerror}")
                    return
                continue
            tag = self._listeners[listener]
            if client.family == socket.AF_UNIX:
                pid, uid, _ = _peercred(client)
                peer = Peer(tag, "", uid, pid)
            else:
                host, port = address[0], address[1]
                peer = Peer(tag, f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
            why = self._over_limit(peer)
            if why:
                victim = self._silent(None if len(self._pairs) >= self._limits.max_connections else peer.source_key)
                if victim is None:
                    _refuse(client)
                    self._report(peer, why)
                    continue
                self._close(victim)
                self._report(victim.peer, f"closed a connection from {victim.peer.source or victim.peer.source_key} "
                             f"that had not spoken, for a new one ({why.split(': ', 1)[1]})")
            self._connect(client, peer)

    def _over_limit(self, peer: Peer) -> str | None:
        if len(self._pairs) >= self._limits.max_connections:
            return f"refused a connection from {peer.source or peer.source_key}: {len(self._pairs)} connections " \
                   f"open, the limit is {self._limits.max_connections}"
        if self._per_source.get(peer.source_key, 0) >= self._limits.max_per_source:
            return f"refused a connection from {peer.source or peer.source_key}: it has " \
                   f"{self._limits.max_per_source} open, the limit per source"
        return None

    def _silent(self, source_key: str | None) -> _Pair | None:
        """The oldest connection (of that source; of any for None) whose caller never spoke, or None.
        A caller whose bytes wait unread has spoken: a burst of accepts runs before the reads, and a
        flood queued behind a real caller (the kernel queues a full backlog's connections late) must
        not close it between its connect and its first read."""
        candidates = sorted((p for p in self._pairs if not p.spoke
                             and (source_key is None or p.peer.source_key == source_key)),
                            key=lambda p: p.opened)
        for pair in candidates:
            if _has_sent(pair.client.sock):
                pair.spoke = True
                continue
            return pair
        return None

    def _connect(self, client: socket.socket, peer: Peer) -> None:
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            for _ in range(8):  # an abstract name someone else holds: take the next
                self._serial += 1
                try:
                    upstream.bind("\0" + peer_name(peer, self._serial))
                    break
                except OSError as exc:
                    if exc.errno != errno.EADDRINUSE:
                        raise
            upstream.setblocking(False)
            connected = self._try_connect(upstream)
        except OSError as exc:
            upstream.close()
            _refuse(client)
            self._report(peer, f"cannot reach the server at {self._upstream}: {exc.strerror or exc}")
            return
        if client.family != socket.AF_UNIX:
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        client.setblocking(False)
        pair = _Pair(client, upstream, peer, self._monotonic())
        self._pairs.add(pair)
        self._per_source[peer.source_key] = self._per_source.get(peer.source_key, 0) + 1
        if connected:
            self._relay(pair)
        else:  # the caller's bytes wait in its socket, unread, until the server has room
            self._connecting.append(pair)

    def _try_connect(self, upstream: socket.socket) -> bool:
        """Connects `upstream` to the server: True, or False while the server's backlog is full."""
        try:
            upstream.connect(self._upstream)
            return True
        except (BlockingIOError, InterruptedError):
            return False

    def _retry_connects(self) -> None:
        now = self._monotonic()
        waiting = []
        for pair in self._connecting:
            if pair.closed:  # given way to a newer caller meanwhile
                continue
            try:
                if self._try_connect(pair.upstream.sock):
                    self._relay(pair)
                    continue
                waited = now - pair.opened >= self._limits.connect_wait_s
                why = f"its backlog stayed full for {self._limits.connect_wait_s:g} s" if waited else ""
            except OSError as exc:
                why = exc.strerror or str(exc)
            if why:
                self._close(pair, refuse=True)
                self._report(pair.peer, f"cannot reach the server at {self._upstream}: {why}")
            else:
                waiting.append(pair)
        self._connecting = waiting

    def _relay(self, pair: _Pair) -> None:
        for half in (pair.client, pair.upstream):
            self._selector.register(half.sock, selectors.EVENT_READ, ("pair", (pair, half)))

    def _service(self, pair: _Pair, half: _Half, events: int) -> None:
        if pair.closed:
            return
        other = pair.other(half)
        if events & selectors.EVENT_READ and not half.eof:
            try:
                data = half.sock.recv(_CHUNK)
            except (BlockingIOError, InterruptedError):
                data = None
            except OSError:
                self._close(pair)
                return
            if data == b"":
                half.eof = True
            elif data:
                if half is pair.client:
                    pair.spoke = True
                other.out += data
                self._send(pair, other)  # most of the time it all goes at once
        if events & selectors.EVENT_WRITE:
            self._send(pair, half)
        if pair.closed:
            return
        # gRPC never half-closes: a side that ended, once its bytes are passed on, ends the connection.
        if (pair.client.eof and not pair.upstream.out) or (pair.upstream.eof and not pair.client.out):
            self._close(pair)
            return
        self._arm(pair, pair.client)
        self._arm(pair, pair.upstream)

    def _send(self, pair: _Pair, half: _Half) -> None:
        if not half.out or pair.closed:
            return
        try:
            sent = half.sock.send(half.out)
            del half.out[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._close(pair)

    def _arm(self, pair: _Pair, half: _Half) -> None:
        """Waits on `half` for what can happen now: bytes to read while the other side's buffer has
        room, room to write while it has bytes queued. Nothing: off the selector until that changes."""
        other = pair.other(half)
        events = 0
        if not half.eof and len(other.out) < _BUFFER:
            events |= selectors.EVENT_READ
        if half.out:
            events |= selectors.EVENT_WRITE
        try:
            key = self._selector.get_key(half.sock)
        except KeyError:
            key = None
        if events and key is None:
            self._selector.register(half.sock, events, ("pair", (pair, half)))
        elif events and key.events != events:
            self._selector.modify(half.sock, events, key.data)
        elif not events and key is not None:
            self._selector.unregister(half.sock)

    def _close(self, pair: _Pair, refuse: bool = False) -> None:
        """Ends both sides; `refuse`: the caller's unread bytes are read first (a FIN, not a reset)."""
        if pair.closed:
            return
        pair.closed = True
        for half in (pair.client, pair.upstream):
            try:
                self._selector.unregister(half.sock)
            except (KeyError, ValueError):
                pass
            if refuse and half is pair.client:
                _refuse(half.sock)
            else:
                half.sock.close()
        self._pairs.discard(pair)
        key = pair.peer.source_key
        left = self._per_source.get(key, 1) - 1
        if left > 0:
            self._per_source[key] = left
        else:
            self._per_source.pop(key, None)

    def _report(self, peer: Peer, why: str) -> None:
        # One line per source and ten seconds: a flood must not flood the journal too.
        now = self._monotonic()
        key = peer.source_key
        if now - self._last_report.get(key, -1e9) < 10.0:
            return
        self._last_report[key] = now
        if len(self._last_report) > 4096:
            self._last_report.clear()
        self._refused(peer, why)
