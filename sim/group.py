"""The TP group over TCP, shaped like torch.distributed's rendezvous with NCCL's and gloo's failure
behaviour.

Rank 0 listens on --dist-init-addr; ranks 1..nnodes-1 connect (retrying until a deadline, like a
TCPStore client) and send their settings, which must match rank 0's. When all have joined, rank 0
says "ready". Every forward step of rank 0 is then a collective: rank 0 sends "step", every worker
answers "done", and rank 0 sends "complete" once all have answered. A stopped or frozen worker
never answers, so rank 0 and the other workers wait in the step, as in an all-reduce. A silent
peer is waited for (NCCL has no timeout of its own) until the engine's watchdog
(--watchdog-timeout) ends the process, as SGLang's does; a connection that closes means the peer
died and is noticed at once (a gloo/NCCL error). DSV41_SIM_PEER_TIMEOUT_S, only where a test asks
for it, makes silence count as a lost peer after that long, with heartbeats. Messages are JSON lines.
"""

from __future__ import annotations

import errno
import json
import socket
import threading
import time
from typing import Any, Callable

from .args import SimArgs

JOIN_READ_TIMEOUT_S = 5.0


class GroupError(Exception):
    """The group cannot form; the message says why."""


# What NCCL says when a peer's process ended (ncclRemoteError's string), said by the rank that lost
# it as the real engine's collective does (gloo: "Connection closed by peer [ADDR]:PORT"): the
# coordinator blames the rank that did not say it (coordinator/peerfailure.py).
NCCL_REMOTE_ERROR = "NCCL error: remote process exited or there was a network error"


class PeerLost(Exception):
    """A peer's connection closed or went silent."""


class StepHung(Exception):
    """A forward step did not complete within the watchdog's timeout."""


class Link:
    """One TCP connection carrying JSON lines."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buffer = b""
        self._send_lock = threading.Lock()

    def send(self, message: dict) -> bool:
        data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        try:
            with self._send_lock:
                self.sock.sendall(data)
            return True
        except OSError:
            return False

    def recv(self, timeout_s: float | None) -> dict:
        """The next message; PeerLost on a closed connection or silence past timeout_s (None: wait for
        as long as it takes, as NCCL does)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise PeerLost(f"no heartbeat for {timeout_s:g} s")
            try:
                self.sock.settimeout(left)
                data = self.sock.recv(65536)
            except socket.timeout:
                raise PeerLost(f"no heartbeat for {timeout_s:g} s") from None
            except ConnectionResetError:
                # A process killed with unread data in its socket resets instead of closing.
                raise PeerLost(f"connection closed (reset); {NCCL_REMOTE_ERROR}") from None
            except OSError as exc:
                raise PeerLost(f"connection error: {exc.strerror or exc}") from None
            if not data:
                raise PeerLost(f"connection closed; {NCCL_REMOTE_ERROR}")
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            message = json.loads(line)
        except ValueError:
            raise PeerLost(f"garbled message {line[:60]!r}") from None
        if not isinstance(message, dict):
            raise PeerLost(f"garbled message {line[:60]!r}")
        return message

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def settings_of(args: SimArgs) -> dict[str, Any]:
    return json.loads(json.dumps(args.group_settings()))


def differences(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """Human-readable settings on which two ranks disagree."""
    out = []
    for key in sorted(set(mine) | set(theirs)):
        if mine.get(key) != theirs.get(key):
            out.append(f"--{key.replace('_', '-')} {theirs.get(key)!r} there, {mine.get(key)!r} here")
    return out


class Head:
    """Rank 0's side of the group."""

    def __init__(self, args: SimArgs, peer_timeout_s: float | None, heartbeat_s: float, log: Callable[[str], None],
                 on_lost: Callable[[int, str], None]) -> None:
        self.args = args
        self.nnodes = int(args.nnodes)
        self._peer_timeout_s = peer_timeout_s
        self._heartbeat_s = heartbeat_s
        self._log = log
        self._on_lost = on_lost
        self._settings = settings_of(args)
        self._cond = threading.Condition()
        self._links: dict[int, Link] = {}
        self._answered: dict[int, int] = {}  # rank -> the last step it answered
        self._failure: str | None = None
        self._ready = False
        self._closing = False
        self._server: socket.socket | None = None

    @property
    def address(self) -> str:
        return f"{self.args.dist_host}:{self.args.dist_port}"

    def listen(self) -> None:
        family = socket.AF_INET6 if ":" in self.args.dist_host else socket.AF_INET
        server = socket.socket(family, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            server.bind((self.args.dist_host, self.args.dist_port))
        except OSError as exc:
            server.close()
            if exc.errno == errno.EADDRNOTAVAIL:
                raise GroupError(f"cannot listen on --dist-init-addr {self.address}: {self.args.dist_host} is not "
                                 "an address of this node (rank 0 must run on the node --dist-init-addr names)")
            raise GroupError(f"cannot listen on --dist-init-addr {self.address}: {exc.strerror or exc}") from None
        server.listen(64)
        self._server = server
        threading.Thread(target=self._accept_loop, name="rendezvous", daemon=True).start()
        if self._peer_timeout_s is not None:
            threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()

    def gather(self, timeout_s: float, stop: threading.Event | None = None) -> bool:
        """Blocks until every rank joined (True) or `stop` is set (False); GroupError on a
        disagreement or at the deadline."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if self.nnodes > 1 and len(self._links) < self.nnodes - 1:
                self._log(f"waiting for ranks {self._missing()} to join at {self.address} "
                          f"(for up to {timeout_s:g} s)")
            while len(self._links) < self.nnodes - 1 and self._failure is None:
                if stop is not None and stop.is_set():
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    raise GroupError(f"ranks {self._missing()} did not join at {self.address} within "
                                     f"{timeout_s:g} s")
                self._cond.wait(min(left, 0.5))
            if self._failure is not None:
                raise GroupError(self._failure)
            self._ready = True
            for link in self._links.values():
                link.send({"op": "ready", "nnodes": self.nnodes})
        if self.nnodes > 1:
            self._log(f"group of {self.nnodes} ranks formed at {self.address}")
        return True

    def _missing(self) -> str:
        return ", ".join(str(r) for r in range(1, self.nnodes) if r not in self._links)

    def _accept_loop(self) -> None:
        assert self._server is not None
        while True:
            try:
                sock, peer = self._server.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._handle_join, args=(Link(sock), peer), daemon=True).start()

    def _handle_join(self, link: Link, peer: tuple) -> None:
        try:
            message = link.recv(JOIN_READ_TIMEOUT_S)
        except PeerLost:
            link.close()
            return
        rank = message.get("rank")
        if message.get("op") != "join" or not isinstance(rank, int):
            link.send({"op": "reject", "reason": "not a dsv41-sim-rank join"})
            link.close()
            return
        theirs = message.get("settings") or {}
        diff = differences(self._settings, theirs)
        with self._cond:
            reason = None
            if self._ready:
                reason = f"the group at {self.address} is already complete"
            elif diff:
                reason = (f"rank {rank} disagrees with rank 0: " + "; ".join(diff) +
                          " (ranks of one TP group must be started with the same settings)")
                self._failure = reason
            elif rank in self._links:
                reason = f"rank {rank} has already joined from another process"
            elif not 1 <= rank < self.nnodes:
                reason = f"rank {rank} is not a worker rank of a group of {self.nnodes}"
            if reason:
                link.send({"op": "reject", "reason": reason})
                link.close()
                self._log(f"refused a join from {peer[0]}: {reason}")
                self._cond.notify_all()
                return
            self._links[rank] = link
            self._log(f"rank {rank} joined from {peer[0]}")
            self._cond.notify_all()
        self._watch(rank, link)

    def _watch(self, rank: int, link: Link) -> None:
        while True:
            try:
                message = link.recv(self._peer_timeout_s)
            except PeerLost as exc:
                with self._cond:
                    closing = self._closing
                    self._links.pop(rank, None)
                    self._cond.notify_all()
                if not closing:
                    self._on_lost(rank, str(exc))
                return
            if message.get("op") == "done" and isinstance(message.get("n"), int):
                with self._cond:
                    self._answered[rank] = message["n"]
                    self._cond.notify_all()

    def step(self, n: int, watchdog_s: float) -> None:
        """Forward step n as a collective: returns once every worker answered it. A worker that
        does not answer is waited for; past watchdog_s StepHung is raised (the engine's watchdog
        ends the process). A lost worker ends the process through on_lost meanwhile."""
        with self._cond:
            links = dict(self._links)
        for link in links.values():
            link.send({"op": "step", "n": n})
        deadline = time.monotonic() + watchdog_s
        with self._cond:
            while True:
                waiting = [r for r in links if self._answered.get(r, 0) < n and r in self._links]
                if not waiting or self._closing:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StepHung(f"forward step {n} waited {watchdog_s:g} s for ranks "
                                   f"{', '.join(map(str, waiting))}")
                self._cond.wait(min(left, 1.0))
        for link in links.values():
            link.send({"op": "complete", "n": n})

    def _heartbeat_loop(self) -> None:
        while True:
            with self._cond:
                if self._closing:
                    return
                links = list(self._links.values())
            for link in links:
                link.send({"op": "hb"})
            time.sleep(self._heartbeat_s)

    def report_lost(self, rank: int, reason: str) -> None:
        """Tells the other workers which rank was lost, so their own error names it."""
        with self._cond:
            self._closing = True
            links = [link for r, link in self._links.items() if r != rank]
        for link in links:
            link.send({"op": "abort", "lost": rank, "reason": reason})

    def shutdown_workers(self, timeout_s: float = 2.0) -> list[int]:
        """Tells every worker to exit and waits until their connections close; returns the ranks
        that did not close in time."""
        with self._cond:
            self._closing = True
            links = dict(self._links)
        for link in links.values():
            link.send({"op": "shutdown"})
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._links and time.monotonic() < deadline:
                self._cond.wait(0.05)
            return sorted(self._links)


class Worker:
    """A worker rank's side of the group."""

    def __init__(self, args: SimArgs, peer_timeout_s: float | None, heartbeat_s: float,
                 log: Callable[[str], None], on_step: Callable[[int], None] = lambda n: None) -> None:
        self.args = args
        self._peer_timeout_s = peer_timeout_s
        self._heartbeat_s = heartbeat_s
        self._log = log
        self._on_step = on_step
        self._link: Link | None = None
        self._in_step_since: float | None = None  # monotonic time this rank entered the step under way

    @property
    def address(self) -> str:
        return f"{self.args.dist_host}:{self.args.dist_port}"

    def _connect(self, deadline: float, timeout_s: float) -> Link:
        announced = False
        while True:
            try:
                sock = socket.create_connection((self.args.dist_host, self.args.dist_port),
                                                timeout=min(2.0, max(deadline - time.monotonic(), 0.1)))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return Link(sock)
            except OSError as exc:
                why = exc.strerror or str(exc) or type(exc).__name__
                if time.monotonic() >= deadline:
                    raise GroupError(f"rank 0 at {self.address} did not answer within {timeout_s:g} s "
                                     f"(last error: {why})") from None
                if not announced:
                    self._log(f"waiting for rank 0 at {self.address} ({why}); retrying for up to "
                              f"{timeout_s:g} s")
                    announced = True
                time.sleep(0.2)

    def join(self, timeout_s: float) -> bool:
        """Connects, sends this rank's settings and waits for "ready" (True); False when rank 0
        shuts down before the group formed; GroupError on any failure."""
        deadline = time.monotonic() + timeout_s
        link = self._connect(deadline, timeout_s)
        link.send({"op": "join", "rank": self.args.rank, "settings": settings_of(self.args)})
        self._log(f"connected to rank 0 at {self.address}; waiting for all {self.args.nnodes} ranks")
        self._link = link
        if self._peer_timeout_s is not None:
            threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()
        while True:
            try:
                message = link.recv(self._peer_timeout_s)
            except PeerLost as exc:
                raise GroupError(f"lost rank 0 at {self.address} before the group formed ({exc})") from None
            op = message.get("op")
            if op == "ready":
                self._log(f"group of {self.args.nnodes} ranks formed")
                return True
            if op == "shutdown":
                return False
            if op == "reject":
                raise GroupError(f"rank 0 refused this rank: {message.get('reason')}")
            if op == "abort":
                raise GroupError(f"rank {message.get('lost')} was lost before the group formed "
                                 f"({message.get('reason')}), as reported by rank 0")

    def follow(self) -> tuple[bool, str]:
        """Runs until rank 0 says shut down (True) or the group fails (False, why). A step is taken
        (on_step) when rank 0 starts it and answered at once; the rank is then in the collective
        until rank 0 says it completed, which the watchdog times."""
        assert self._link is not None
        while True:
            try:
                message = self._link.recv(self._peer_timeout_s)
            except PeerLost as exc:
                return False, f"lost rank 0 at {self.address} ({exc})"
            op = message.get("op")
            if op == "step" and isinstance(message.get("n"), int):
                self._in_step_since = time.monotonic()
                self._on_step(message["n"])
                self._link.send({"op": "done", "n": message["n"]})
            elif op == "complete":
                self._in_step_since = None
            elif op == "shutdown":
                return True, "rank 0 asked all ranks to shut down"
            elif op == "abort":
                return False, f"lost rank {message.get('lost')} ({message.get('reason')}), as reported by rank 0"

    def stuck_for(self) -> float:
        """Seconds this rank has been in a step that did not complete (0 when in none)."""
        since = self._in_step_since
        return 0.0 if since is None else time.monotonic() - since

    def _heartbeat_loop(self) -> None:
        link = self._link
        assert link is not None
        while link.send({"op": "hb"}):
            time.sleep(self._heartbeat_s)
