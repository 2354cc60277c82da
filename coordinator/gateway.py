"""The coordinator's side of the model gateway (sglang-router 0.3.2) on the head: its unit's command
line, the decision which workers to add and remove, and the manager that keeps the unit running and
the gateway's workers equal to the groups that serve.

A group is added only once its rank 0 answers /health with 200, and an add counts only once GET
/workers lists it: 0.3.2 registers in the background, and a DELETE issued while an add is still
pending is lost, the add completing later (router-findings). So every removal is confirmed by a
listing too, and repeated while the worker is still listed.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from dsv41.journal import EventLog
from dsv41.v1 import agent_pb2 as pb

from .agents import AgentUnavailable
from .groups import groups_of, worker_url
from .gatewayapi import GatewayApi, GatewayError, GatewayWorker, worker_healthy

# The router lets requests in flight finish this long after SIGTERM; the unit's stop waits longer.
SHUTDOWN_GRACE_S = 60
UNIT_STOP_TIMEOUT_S = SHUTDOWN_GRACE_S + 15
POLL_S = 0.5
ENSURE_RETRY_S = 5.0           # between tries to start the unit while the head agent does not answer
SET_GATEWAY_TIMEOUT_S = 30.0
ADD_RETRY_S = 10.0             # an add not listed after this is asked again (its job may have failed)
ADD_SETTLE_S = 4.0             # an add of a healthy worker was listed 0.3 to 1.1 s after its 202 (0.3.2)
REMOVE_CHECK_S = 0.1
STARTUP_GRACE_S = 15.0         # the router's start: not answering then is no episode to warn about


def gateway_args(cfg) -> list[str]:
    """sglang_router.launch_router's flags (0.3.2). No worker URLs (groups are added as they serve)
    and never the API key (the unit's wrapper reads it from its file)."""
    metrics = cfg.listen("GATEWAY_METRICS_LISTEN")
    return ["--host", "0.0.0.0", "--port", str(cfg.integer("GATEWAY_PORT")), "--policy", "round_robin",
            "--prometheus-host", metrics.host, "--prometheus-port", str(metrics.port),
            "--health-check-interval-secs", "5", "--health-failure-threshold", "2",
            "--health-success-threshold", "1", "--health-check-endpoint", "/health",
            # total attempts, the first included: a request that meets a group going down is tried on another
            "--retry-max-retries", "5",
            "--shutdown-grace-period-secs", str(SHUTDOWN_GRACE_S), "--request-timeout-secs", "1800",
            "--log-level", "info"]


def gateway_url(cfg) -> str:
    return f"http://{cfg.head.address}:{cfg.integer('GATEWAY_PORT')}"


@dataclass(frozen=True)
class GatewayActions:
    add: tuple[tuple[str, str], ...]        # (group, url)
    remove: tuple[GatewayWorker, ...]


def _url(url: str) -> str:
    return url.rstrip("/")


def reconcile(wanted: Mapping[str, str], listed: Sequence[GatewayWorker]) -> GatewayActions:
    """What makes the gateway's workers the wanted groups' URLs, each once: a listed worker that no
    wanted group has goes, and of several registrations of one URL a healthy one stays."""
    wanted_urls = {_url(u) for u in wanted.values()}
    kept: set[str] = set()
    remove = []
    for worker in sorted(listed, key=lambda w: not w.healthy):
        if _url(worker.url) in wanted_urls and _url(worker.url) not in kept:
            kept.add(_url(worker.url))
        else:
            remove.append(worker)
    add = tuple((group, _url(url)) for group, url in sorted(wanted.items()) if _url(url) not in kept)
    return GatewayActions(add, tuple(sorted(remove, key=lambda w: (w.url, w.id))))


@dataclass(frozen=True)
class GatewayView:
    url: str
    unit_state: str                                  # the unit's systemd ActiveState, "" before it is known
    ready: bool                                      # reachable, with a healthy worker
    workers: tuple[tuple[str, str, bool], ...]       # (group or "", url, healthy)
    error: str                                       # why the gateway or its unit is not as wanted, "" when it is


@dataclass(frozen=True)
class _PendingAdd:
    url: str
    worker_id: str
    at: float


class Gateway:
    def __init__(self, cfg, head_client, head_rank_spec: Callable[[], pb.RankSpec], api_key: str | None,
                 log: EventLog, routable: Callable[[], Mapping[str, str]], poll_s: float = POLL_S,
                 api: GatewayApi | None = None, monotonic: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], object] = time.sleep,
                 healthy: Callable[[str], bool] | None = None):
        self._cfg = cfg
        self._head = head_client
        self._head_rank_spec = head_rank_spec
        self._api_key = api_key
        self._log = log
        self._routable = routable
        self._poll_s = poll_s
        self.url = gateway_url(cfg)
        self._api = api or GatewayApi(self.url, api_key)
        self._monotonic = monotonic
        self._sleep = sleep
        self._healthy = healthy or (lambda url: worker_healthy(url, api_key))
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gateway", daemon=True)
        self._ops = threading.Lock()        # one change of the gateway's workers at a time
        self._state = threading.Lock()      # what view() and remove_now() read
        self._held: set[str] = set()
        # url -> group: every group's rank 0, so that any listing names its workers' groups
        self._known: dict[str, str] = {_url(worker_url(cfg, g)): g.name for g in groups_of(cfg)}
        self._pending: dict[str, _PendingAdd] = {}
        self._removed_ids: set[str] = set()  # removals logged, until the worker is no longer listed
        self._unit_state = ""
        self._unit_wanted = False  # start() until stop_unit()
        self._unit_running = False  # ensure_unit() succeeded since the last start()
        self._unit_problem = ""
        self._unit_since: float | None = None
        self._unreachable = False
        self._error = ""
        self._ready = False
        self._workers: tuple[tuple[str, str, bool], ...] = ()

    # ---------------------------------------------------------------- the unit

    def _spec(self, run: bool) -> pb.GatewaySpec:
        return pb.GatewaySpec(rank=self._head_rank_spec(), python=self._cfg.optional_text("GATEWAY_PYTHON") or "",
                              args=gateway_args(self._cfg), run=run, stop_timeout_s=UNIT_STOP_TIMEOUT_S)

    def ensure_unit(self) -> bool:
        """Asks the head's agent to run the gateway's unit; False (warned once per problem) when it
        could not."""
        try:
            state = self._head.set_gateway(self._spec(True), timeout=SET_GATEWAY_TIMEOUT_S)
        except AgentUnavailable as exc:
            problem = f"the head agent could not start the gateway's unit: {exc.meaning()}"
            with self._state:
                self._error = problem
            if problem != self._unit_problem:
                self._unit_problem = problem
                self._log.event("gateway_unit_unreachable", f"{problem}; trying again every {ENSURE_RETRY_S:g} s",
                                "warning", error=str(exc))
            return False
        with self._state:
            self._unit_state = state.active_state
            self._error = state.message if state.active_state not in ("active", "activating") else ""
        self._unit_problem = ""
        self._unit_since = self._monotonic()
        self._log.event("gateway_unit", f"gateway unit {state.active_state} (pid {state.main_pid}) serving on "
                        f"{self.url}", active_state=state.active_state, main_pid=state.main_pid, url=self.url,
                        unit_message=state.message or None)
        return True

    def start(self) -> "Gateway":
        """The unit wanted running (at once, or again after stop_unit) and the workers kept in step."""
        with self._state:
            self._unit_wanted, self._unit_running = True, False
        if not self._thread.is_alive() and not self._done.is_set():
            self._thread.start()
        return self

    def stop(self, stop_unit: bool) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(10.0)
        if stop_unit:
            self.stop_unit()

    def stop_unit(self) -> None:
        """`dsv41ctl stop`: the unit stopped (its in-flight requests get the grace period); the
        manager stays, for a later start."""
        with self._state:
            self._unit_wanted = False
        try:
            state = self._head.set_gateway(self._spec(False), timeout=UNIT_STOP_TIMEOUT_S + SET_GATEWAY_TIMEOUT_S)
        except AgentUnavailable as exc:
            self._log.event("gateway_unit_stop_failed", f"could not stop the gateway's unit: {exc.meaning()}",
                            "warning", error=str(exc))
            return
        with self._state:
            self._unit_state, self._ready, self._workers = state.active_state, False, ()
        self._log.event("gateway_unit", f"gateway unit {state.active_state}", active_state=state.active_state)

    def _run(self) -> None:
        wait = 0.0
        while not self._done.wait(wait):
            with self._state:
                wanted, running = self._unit_wanted, self._unit_running
            if not wanted:
                wait = self._poll_s
            elif not running:
                started = bool(self._guarded(self.ensure_unit))
                with self._state:
                    self._unit_running = started and self._unit_wanted
                wait = self._poll_s if started else ENSURE_RETRY_S
            else:
                self._guarded(self.poll)
                wait = self._poll_s

    def _guarded(self, step: Callable[[], object]) -> object:
        """The loop outlives a bug in one round; the error is logged."""
        try:
            return step()
        except Exception as exc:  # noqa: BLE001
            self._log.event("gateway_round_failed", f"gateway {step.__name__} failed: {exc!r}", "err",
                            error=repr(exc))
            return False

    # ---------------------------------------------------------------- the workers

    def poll(self) -> None:
        """One round: the gateway's workers made equal to the routable groups not held out."""
        routable = {group: _url(url) for group, url in self._routable().items()}
        with self._state:
            self._known.update({url: group for group, url in routable.items()})
            held = set(self._held)
        wanted = {group: url for group, url in routable.items() if group not in held}
        with self._ops:
            try:
                listed = self._api.workers()
                self._seen(listed)
                actions = reconcile(wanted, listed)
                for worker in actions.remove:
                    self._remove(worker, self._why_removed(worker, wanted, held))
                for group, url in actions.add:
                    self._add(group, url)
            except GatewayError as exc:
                self._not_answering(exc)

    def _seen(self, listed: Sequence[GatewayWorker]) -> None:
        if self._unreachable:
            self._unreachable = False
            self._log.event("gateway_reachable", f"the gateway at {self.url} answers again", url=self.url)
        urls = {_url(w.url): w for w in listed}
        with self._state:
            confirmed = [(group, pending.url) for group, pending in self._pending.items() if pending.url in urls]
            for group, _ in confirmed:
                del self._pending[group]
            self._removed_ids &= {w.id for w in listed}
            self._workers = tuple((self._known.get(_url(w.url), ""), w.url, w.healthy) for w in listed)
            self._ready = any(w.healthy for w in listed)
            if not self._unit_problem:
                self._error = ""
        for group, url in confirmed:
            self._log.event("gateway_worker_added", f"{group} ({url}) is routed by the gateway", group=group,
                            url=url, worker_id=urls[url].id, why="it serves and its rank 0 answers /health")

    def _not_answering(self, exc: GatewayError) -> None:
        with self._state:
            self._error = str(exc)
            self._ready = False
        starting = self._unit_since is not None and self._monotonic() - self._unit_since < STARTUP_GRACE_S
        if not self._unreachable and not starting:
            self._unreachable = True
            self._log.event("gateway_unreachable", f"the gateway does not answer as it should: {exc}", "warning",
                            url=self.url, status=exc.status, error=exc.detail)

    def _add(self, group: str, url: str) -> None:
        pending = self._pending.get(group)
        now = self._monotonic()
        if pending and pending.url == url and now - pending.at < ADD_RETRY_S:
            return  # queued; a later listing confirms it
        if not self._healthy(url):
            return  # not before /health says 200: a pending add could not be removed
        worker_id = self._api.add(url, self._api_key)
        with self._state:
            self._pending[group] = _PendingAdd(url, worker_id, now)

    def _remove(self, worker: GatewayWorker, why: str) -> None:
        self._api.remove(worker.id)
        with self._state:
            first = worker.id not in self._removed_ids
            self._removed_ids.add(worker.id)
            group = self._known.get(_url(worker.url), "")
        if first:
            self._log.event("gateway_worker_removed", f"{group or worker.url} is no longer routed: {why}",
                            group=group or None, url=worker.url, worker_id=worker.id, why=why)

    def _why_removed(self, worker: GatewayWorker, wanted: Mapping[str, str], held: set[str]) -> str:
        group = self._known.get(_url(worker.url))
        if group in held:
            return "held out (a planned restart or drain)"
        if _url(worker.url) in wanted.values():
            return "a second registration of a URL already routed"
        if group:
            return f"{group} is not serving"
        return "no group has this URL"

    # ---------------------------------------------------------------- held out

    def remove_now(self, group: str, timeout_s: float = 5.0) -> bool:
        """Takes the group out of the gateway and holds it out until release(group): True once GET
        /workers no longer lists it, False if that was not seen within timeout_s."""
        deadline = self._monotonic() + timeout_s
        routable_url = self._routable().get(group)
        with self._state:
            self._held.add(group)  # from now on no poll adds it
            urls = {url for url, g in self._known.items() if g == group} | ({_url(routable_url)} if routable_url
                                                                              else set())
        if not self._ops.acquire(timeout=max(0.0, timeout_s)):
            return False
        try:
            with self._state:  # a poll under way when the group was held may have added it just now
                pending = self._pending.pop(group, None)
            return self._remove_until_gone(group, urls, pending, deadline)
        finally:
            self._ops.release()

    def _remove_until_gone(self, group: str, urls: set[str], pending: _PendingAdd | None, deadline: float) -> bool:
        # A queued add is listed only once its job ends: until it shows (and is removed) or could have
        # shown, the group is not known to be gone.
        settled_at = pending.at + ADD_SETTLE_S if pending else 0.0
        while True:
            try:
                listed = self._api.workers()
                self._seen(listed)
                mine = [w for w in listed if _url(w.url) in urls]
                if pending and any(w.id == pending.worker_id for w in mine):
                    settled_at = 0.0
                for worker in mine:
                    self._remove(worker, "held out (a planned restart or drain)")
                if not mine and self._monotonic() >= settled_at:
                    return True
            except GatewayError as exc:
                self._not_answering(exc)
            if self._monotonic() >= deadline:
                self._log.event("gateway_remove_unconfirmed", f"{group} could not be seen gone from the gateway "
                                f"within its time; it stays held out", "warning", group=group)
                return False
            self._sleep(REMOVE_CHECK_S)

    def release(self, group: str) -> None:
        """The group may be routed again once it serves (the next poll adds it)."""
        with self._state:
            self._held.discard(group)

    def routes(self, group: str) -> bool:
        """Whether the gateway's last listing had the group as a healthy worker."""
        with self._state:
            return any(g == group and healthy for g, _, healthy in self._workers)

    def view(self) -> GatewayView:
        with self._state:
            return GatewayView(self.url, self._unit_state, self._ready, self._workers, self._error)
