"""The cluster runtime: bring-up, supervision, restart policy and stop, over the node agents.

One supervisor thread performs every action in order (start, stop, restart, a rank's exit), so
two actions never race; rank watchers and the control socket only enqueue. The coordinator never
touches D-Bus, sysfs or netlink itself: it asks the agents.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import Callable

from dsv41.journal import EventLog
from dsv41.v1 import agent_pb2 as pb

from . import plan as plan_mod
from . import serving, share, weights
from .agents import AgentClient, AgentUnavailable
from .config import ClusterConfig

STEPS = ("preflight", "share", "fabric", "pack", "launch", "health", "smoke")
GIB = 1 << 30
STABLE_SERVING_S = 600.0  # serving this long resets the restart attempt counter


class StepFailed(Exception):
    def __init__(self, step: str, node: str | None, reason: str):
        super().__init__(f"{step}: {node + ': ' if node else ''}{reason}")
        self.step, self.node, self.reason = step, node, reason


@dataclass(frozen=True)
class Incident:
    at_unix_s: float
    node: str
    kind: str
    message: str


@dataclass(frozen=True)
class Snapshot:
    phase: str = "stopped"
    detail: str = ""
    since: float = 0.0
    serving_since: float = 0.0
    restart_attempt: int = 0
    generation: str = ""
    last_incident: Incident | None = None
    fabric: dict = field(default_factory=dict)  # node -> FabricReport
    fingerprints: dict = field(default_factory=dict)  # node -> plan fingerprint
    ranks: dict = field(default_factory=dict)  # node -> last RankState seen


def image_of(spec: plan_mod.RankSpec) -> str | None:
    """The image a container-runtime rank runs (the argument before the rank's command), else None."""
    if spec.runtime != "container":
        return None
    argv = list(spec.argv)
    return argv[argv.index("python3") - 1] if "python3" in argv else None


def image_problems(images_by_node: dict[str, dict[str, str]],
                   specs: dict[str, plan_mod.RankSpec]) -> list[tuple[str, str]]:
    """(node, reason) for every node whose image is missing or differs from the head's."""
    wanted = {node: image_of(spec) for node, spec in specs.items()}
    ids = {node: images_by_node.get(node, {}).get(image, "") for node, image in wanted.items() if image}
    problems = [(node, f"image {wanted[node]} is not on this node (or not in its ALLOWED_IMAGES): "
                       f"docker pull it, or load the same build") for node, image_id in ids.items() if not image_id]
    if not problems and len(set(ids.values())) > 1:
        reference = next(iter(ids))
        problems = [(node, f"image {wanted[node]} is {image_id[:19]} here but {ids[reference][:19]} on "
                           f"{reference}: every rank must run the same build")
                    for node, image_id in ids.items() if image_id != ids[reference]]
    return problems


def generation_of(plans) -> str:
    return hashlib.sha256(",".join(p.fingerprint for p in plans).encode()).hexdigest()[:12]


class ClusterRuntime:
    def __init__(self, cfg: ClusterConfig, clients: dict[str, AgentClient], log: EventLog,
                 table_source_dir: str = plan_mod.STATE_DIR, state_dir: str = "/var/lib/dsv41/coordinator",
                 api_key: str | None = None, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep, monotonic: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.clients = clients
        self._log = log
        self._table_dir = table_source_dir
        self._state_dir = state_dir
        self._api_key = api_key  # read from API_KEY_FILE by the daemon; reaches rank 0 as a 0600 file
        self._clock, self._sleep, self._monotonic = clock, sleep, monotonic
        self._lock = threading.Lock()
        self._snapshot = Snapshot(since=clock())
        self._actions: queue.Queue = queue.Queue()
        self._stop_watchers = threading.Event()
        self._watch_threads: list[threading.Thread] = []
        self._exited: dict[str, str] = {}  # node -> why its rank is gone, during a bring-up
        self._incidents: list[Incident] = []
        self._incident_listeners: list[Callable[[Incident], None]] = []
        self._plans: tuple[plan_mod.NodePlan, ...] = ()
        self._launched: dict[str, str] = {}  # node -> invocation ID of the rank this generation started
        self._exit_times: dict[str, float] = {}  # node -> when its current-generation rank exited
        self._operator = threading.Event()  # an operator's action is waiting: it beats a restart backoff
        self._done = threading.Event()
        self._worker = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self.base_url = f"http://{cfg['HEAD_IP']}:{cfg['PORT']}"

    # -- public, thread-safe

    def snapshot(self) -> Snapshot:
        with self._lock:
            return self._snapshot

    def incidents(self) -> list[Incident]:
        with self._lock:
            return list(self._incidents)

    def on_incident(self, listener: Callable[[Incident], None]) -> None:
        self._incident_listeners.append(listener)

    def run(self, autostart: bool = True) -> None:
        """Starts the supervisor: re-adopt what runs, else bring the cluster up when asked to."""
        for client in self.clients.values():
            self._watch_threads.append(client.watch_rank(
                lambda event, node=client.node: self._on_rank_event(node, event),
                lambda why, node=client.node: self._on_watch_lost(node, why), self._stop_watchers))
        self._worker.start()
        self._actions.put(("adopt_or_start", autostart))

    def request(self, action: str, reason: str | None = None) -> None:
        """An operator's (or the memory guard's) start, stop or restart; `reason` is shown as the phase detail."""
        self._operator.set()
        self._actions.put((action, reason))

    def unexport(self, force: bool, unmount: bool, wait_s: float = 150.0) -> tuple[bool, str]:
        """An operator's `dsv41ctl share unexport`: (done, what happened or why it was refused).

        Runs on the supervisor between other actions, so it never races a bring-up's share step.
        Refused unless forced while a worker has the export mounted (the head's agent decides, from
        the `mounted_by` the workers' agents report) or ranks run or start; `unmount` first removes
        the workers' mounts, which their agents allow only while their ranks are stopped."""
        phase = self.snapshot().phase
        if not force and phase in share.BUSY_PHASES:
            return False, share.refusal("", [], [], phase)
        job: Future = Future()
        self._actions.put(("unexport", (force, unmount, job)))
        try:
            return job.result(timeout=wait_s)
        except FutureTimeout:
            if job.cancel():
                return False, (f"the coordinator is busy (phase {self.snapshot().phase}) and did not get to it within "
                               f"{wait_s:g} s; nothing was changed: try again")
            return job.result()

    def shutdown(self, stop_cluster: bool) -> None:
        """Stops the supervisor; with stop_cluster, brings the ranks down and confirms it on every node."""
        self._operator.set()
        self._actions.put(("shutdown", stop_cluster))
        self._done.wait()
        self._stop_watchers.set()

    # -- state

    def _set(self, **changes) -> Snapshot:
        with self._lock:
            if "phase" in changes and changes["phase"] != self._snapshot.phase:
                changes.setdefault("since", self._clock())
            self._snapshot = replace(self._snapshot, **changes)
            return self._snapshot

    def _incident(self, node: str, kind: str, message: str) -> Incident:
        incident = Incident(self._clock(), node, kind, message)
        with self._lock:
            self._incidents.append(incident)
            del self._incidents[:-200]
            self._snapshot = replace(self._snapshot, last_incident=incident)
        self._log.error("incident", f"{node}: {message}", node_name=node, incident=kind)
        for listener in list(self._incident_listeners):
            listener(incident)
        return incident

    # -- rank watching

    def _on_rank_event(self, node: str, event: pb.RankEvent) -> None:
        rank = event.rank
        with self._lock:
            ranks = dict(self._snapshot.ranks)
            ranks[node] = rank
            self._snapshot = replace(self._snapshot, ranks=ranks)
            phase = self._snapshot.phase
        # An exit is known by the invocation it ended, not by state transitions: streams can
        # deliver an earlier rank's last state after a new launch, and one exit can be reported
        # several times (failed, then reset to inactive).
        exit_info = rank.last_exit
        launched = self._launched.get(node)
        if not launched or exit_info.invocation_id != launched or node in self._exited:
            return
        if rank.active_state in ("active", "activating") and rank.invocation_id == exit_info.invocation_id:
            return  # a run cannot have ended and still be running: not an exit
        why = (f"rank unit {rank.active_state}: result {exit_info.result or 'unknown'}, "
               f"{exit_info.code or 'exit'} status {exit_info.status}")
        self._exited[node] = why
        self._exit_times[node] = exit_info.at_unix_s or self._clock()
        self._log.info("rank_gone", f"{node}: {why}", node_name=node, invocation=exit_info.invocation_id,
                       exited_at_unix_s=f"{self._exit_times[node]:.6f}")
        if phase in ("serving", "health", "smoke"):
            self._actions.put(("rank_exited", (node, why, exit_info.invocation_id)))

    def _on_watch_lost(self, node: str, why: str) -> None:
        self._log.warning("agent_stream_lost", f"{node}: lost the rank watch ({why}); re-subscribing",
                          node_name=node)

    # -- the supervisor

    def _run(self) -> None:
        while True:
            action, arg = self._actions.get()
            if action in ("start", "stop", "restart", "shutdown"):
                self._operator.clear()
            try:
                if action == "shutdown":
                    if arg:
                        self._stop_cluster("coordinator stopping")
                    self._done.set()
                    return
                if action == "adopt_or_start":
                    if not self._adopt() and arg:
                        self._bring_up_with_retries()
                elif action == "start":
                    if self.snapshot().phase != "serving":
                        self._bring_up_with_retries(reset_attempts=True)
                elif action == "stop":
                    if arg:
                        self._incident(self.cfg.head.name, "stopped", arg)
                    self._stop_cluster(arg or "requested by dsv41ctl stop")
                elif action == "restart":
                    self._stop_cluster("restart requested", wait_memory=True)
                    self._bring_up_with_retries(reset_attempts=True)
                elif action == "unexport":
                    force, unmount, job = arg
                    if job.set_running_or_notify_cancel():
                        try:
                            job.set_result(self._unexport(force, unmount))
                        except Exception as exc:  # the operator gets the error; the cluster's phase is untouched
                            self._log.error("unexport_error", f"share unexport failed unexpectedly: {exc!r}")
                            job.set_exception(exc)
                elif action == "rank_exited":
                    node, why, invocation = arg
                    # Exits of ranks from before the last (re)start are old news.
                    if self.snapshot().phase == "serving" and invocation == self._launched.get(node):
                        self._set(phase="stopping", detail=f"rank on {node} exited: {why}")
                        first, message = self._first_failure()
                        self._incident(first, "rank_exit", message)
                        self._recover(f"rank on {first} exited: {self._exited[first]}")
            except Exception as exc:  # the supervisor must survive anything an action throws
                self._log.error("supervisor_error", f"{action} failed unexpectedly: {exc!r}")
                self._set(phase="failed", detail=f"{action}: internal error: {exc}")

    def _first_failure(self, settle_s: float = 0.5) -> tuple[str, str]:
        """When one rank dies the others follow within moments: wait for them, then blame the first."""
        self._sleep(settle_s)
        exits = sorted(self._exit_times.items(), key=lambda item: item[1])
        # Exit timestamps of different nodes are only comparable to a few milliseconds (each is
        # when that node's systemd reaped the process, and a peer notices a dead socket at once):
        # among exits that close together, a rank ended from outside (signal, OOM kill) is the cause.
        close = [node for node, at in exits if at - exits[0][1] <= 0.05]
        external = [node for node in close if any(k in self._exited[node] for k in ("result signal", "oom-kill",
                                                                                      "result core-dump"))]
        first = external[0] if external else exits[0][0]
        exits = [(first, self._exit_times[first])] + [e for e in exits if e[0] != first]
        message = f"rank on {first} died first: {self._exited[first]}"
        followers = [f"{node} ({self._exited[node].split(': ', 1)[-1]})" for node, _ in exits[1:]]
        if followers:
            message += "; then " + ", ".join(followers)
        return first, message

    def _recover(self, cause: str) -> None:
        """A rank of a serving cluster is gone: the TP group is broken. Stop it all, then restart."""
        self._stop_cluster(f"recovering: {cause}", wait_memory=True)
        self._bring_up_with_retries(first_cause=cause)

    def _bring_up_with_retries(self, reset_attempts: bool = False, first_cause: str | None = None) -> None:
        snap = self._set(restart_attempt=0) if reset_attempts else self.snapshot()
        attempt = snap.restart_attempt
        if snap.serving_since and self._clock() - snap.serving_since > STABLE_SERVING_S:
            attempt = 0
        cause = first_cause
        while True:
            if cause is not None:
                attempt += 1
                max_attempts = int(self.cfg["RESTART_MAX_ATTEMPTS"])
                if attempt > max_attempts:
                    self._set(phase="failed", restart_attempt=attempt - 1,
                              detail=f"{cause} (gave up after {max_attempts} restart attempt(s))")
                    self._log.error("restart_exhausted", f"not restarting again: {cause}", attempts=max_attempts)
                    return
                delay = float(self.cfg["RESTART_BACKOFF_S"]) * 2 ** (attempt - 1)
                self._set(phase="restarting", restart_attempt=attempt,
                          detail=f"attempt {attempt}/{max_attempts} in {delay:g} s after: {cause}")
                self._log.warning("restart_attempt", f"restart attempt {attempt}/{max_attempts} in {delay:g} s: "
                                  f"{cause}", attempt=attempt, delay_s=delay)
                if self._operator.wait(delay):
                    return  # an operator's stop/restart arrived during the backoff: it wins
            try:
                self._bring_up()
                return
            except StepFailed as exc:
                self._incident(exc.node or "cluster", f"{exc.step}_failed", exc.reason)
                self._stop_cluster(f"bring-up failed at {exc.step}", final_phase=None,
                                   wait_memory=exc.step not in ("preflight", "share", "fabric", "pack"))
                self._set(phase="failed", detail=str(exc))
                if exc.step in ("preflight", "share", "fabric", "pack"):
                    return  # a restart cannot fix configuration or a node that is not ready
                cause = str(exc)

    # -- bring-up

    def _bring_up(self) -> None:
        self._exited.clear()
        self._exit_times.clear()
        self._launched.clear()
        step_deadlines = {"preflight": "PREFLIGHT_TIMEOUT_S", "share": "SHARE_TIMEOUT_S", "fabric": "FABRIC_TIMEOUT_S",
                          "pack": "PACK_TIMEOUT_S", "launch": "LAUNCH_TIMEOUT_S", "health": "HEALTH_TIMEOUT_S",
                          "smoke": "SMOKE_TIMEOUT_S"}
        for step in STEPS:
            if step == "smoke" and self.cfg["SKIP_SMOKE"]:
                continue
            self._set(phase=step, detail="")
            deadline = float(self.cfg[step_deadlines[step]])
            started = self._monotonic()
            self._log.info("step_started", f"bring-up: {step}", step=step)
            getattr(self, f"_step_{step}")(deadline)
            self._log.info("step_done", f"bring-up: {step} done in {self._monotonic() - started:.2f} s", step=step,
                           duration_s=round(self._monotonic() - started, 3))
        now = self._clock()
        ranks = len(self._plans)
        self._set(phase="serving", detail=f"serving on :{self.cfg['PORT']}, {ranks}/{ranks} ranks", serving_since=now)
        self._log.info("serving", f"cluster serving at {self.base_url} ({ranks}/{ranks} ranks, generation "
                       f"{self.snapshot().generation})", generation=self.snapshot().generation)

    def _on_nodes(self, fn: Callable[[AgentClient], object], nodes: list[str]) -> dict[str, Future]:
        """fn(client) on each named node at once; returns when all are done, their futures by node."""
        with ThreadPoolExecutor(max_workers=max(1, len(nodes))) as pool:
            return {name: pool.submit(fn, self.clients[name]) for name in nodes}

    def _each(self, fn: Callable[[AgentClient], object], step: str) -> dict[str, object]:
        """Runs fn on every node concurrently; the first error fails the step naming its node."""
        results, errors = {}, []
        for name, future in self._on_nodes(fn, list(self.clients)).items():
            try:
                results[name] = future.result()
            except AgentUnavailable as exc:
                errors.append(StepFailed(step, name, f"agent at {self.clients[name].target}: {exc.code}: "
                                                      f"{exc.details}"))
            except StepFailed as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        return results

    def _status_once_reachable(self, client: AgentClient, deadline: float) -> pb.NodeStatus:
        """The agent's status. An agent that cannot be reached yet (its node still booting, its network
        coming up, the agent restarting) is asked again each second until the step's deadline; any other
        answer, and a refused TLS handshake, is final at once."""
        end = self._monotonic() + deadline
        waiting = False
        while True:
            try:
                return client.status(timeout=max(1.0, min(end - self._monotonic(), 10.0)))
            except AgentUnavailable as exc:
                if exc.code != "UNAVAILABLE" or exc.explained or self._monotonic() + 1.0 > end:
                    raise exc.after_waiting(deadline) if waiting else exc
                if not waiting:
                    waiting = True
                    self._log.warning("agent_waiting", f"{client.node}: agent at {client.target} not reachable "
                                      f"yet, waiting up to {deadline:g} s: {exc.details}", node_name=client.node)
                    self._set(detail=f"waiting for the agent on {client.node}: {exc.details}")
            self._sleep(1.0)

    def _step_preflight(self, deadline: float) -> None:
        statuses = self._each(lambda c: self._status_once_reachable(c, deadline), "preflight")
        versions = {name: s.agent_version for name, s in statuses.items()}
        if len(set(versions.values())) > 1:
            raise StepFailed("preflight", None, "agents run different versions: " +
                             ", ".join(f"{n} {v}" for n, v in versions.items()) + "; upgrade every node to one version")
        digests = {name: s.adapter_digest for name, s in statuses.items()}
        if len(set(digests.values())) > 1:
            raise StepFailed("preflight", None, "adapter files differ between nodes: " +
                             ", ".join(f"{n} {d[:12] or 'none'}" for n, d in digests.items()) +
                             "; install the same dsv41-adapter everywhere")
        if not self.cfg["SKIP_VERIFY"]:
            self._set(detail=f"verifying the checkpoint in {self.cfg['MODEL_DIR']}")
            result = weights.verify(str(self.cfg["MODEL_DIR"]), int(self.cfg["EXPECTED_SHARDS"]),
                                    os.path.join(self._state_dir, "weights-receipts.json"))
            if not result.ok:
                raise StepFailed("preflight", self.cfg.head.name, f"weights: {result.detail}")
            self._log.info("weights_verified", f"weights: {result.detail}", hashed_bytes=result.hashed_bytes)
        self._plans = self._render_plans(sync_tables=True)
        plans = {p.node: p for p in self._plans}
        need = float(self.cfg["RANK_MEMORY_GIB"]) * GIB
        for name, status in statuses.items():
            rank = status.rank
            running = rank.active_state in ("active", "activating")
            if running and rank.fingerprint != plans[name].fingerprint:
                self._log.warning("stale_rank", f"{name} runs plan {rank.fingerprint}, not {plans[name].fingerprint}:"
                                  " stopping it before launch", node_name=name)
                self.clients[name].stop_rank(int(self.cfg["RANK_STOP_TIMEOUT_S"]))
                status = self.clients[name].status()
            available = status.memory.available_bytes
            if not running and available < need:
                raise StepFailed("preflight", name, f"{available / GIB:.1f} GiB available, a rank needs "
                                                    f"{need / GIB:.1f} GiB (RANK_MEMORY_GIB)")
        self._check_images(statuses, plans)
        self._set(generation=generation_of(self._plans),
                  fingerprints={p.node: p.fingerprint for p in self._plans})

    def _check_images(self, statuses: dict, plans: dict) -> None:
        """Ranks of one TP group must run one image: the same local image ID on every node."""
        problems = image_problems({name: dict(s.images) for name, s in statuses.items()},
                                  {name: p.rank_spec for name, p in plans.items()})
        if problems:
            node, reason = problems[0]
            raise StepFailed("preflight", node, reason)

    def _render_plans(self, sync_tables: bool) -> tuple[plan_mod.NodePlan, ...]:
        """Renders plans; the DSpark table flags only when every node holds the head's copy."""
        probe = plan_mod.render_cluster(self.cfg, dspark_tables=True)
        tables = probe[0].dspark_tables  # rank path -> node path
        if not tables:
            return plan_mod.render_cluster(self.cfg)
        names = [os.path.basename(node_path) for node_path in tables.values()]
        head = self.cfg.head.name
        sources = {}
        for name in names:
            path = os.path.join(self._table_dir, name)
            try:
                with open(path, "rb") as f:
                    sources[name] = f.read()
            except FileNotFoundError:
                sources[name] = None
        present = all(content is not None for content in sources.values())
        for node, client in self.clients.items():
            for name, content in sources.items():
                if node == head:
                    continue
                if sync_tables:
                    if content is None:
                        client.remove_file(name)  # a stale copy would make ranks disagree
                    else:
                        digest = client.file_digest(name)
                        if digest.sha256 != hashlib.sha256(content).hexdigest():
                            client.put_file(name, content)
        if not present:
            missing = [n for n, c in sources.items() if c is None]
            self._log.info("dspark_tables_absent", f"DSpark tables not on the head ({', '.join(missing)} in "
                           f"{self._table_dir}): no rank gets the table flags")
            return plan_mod.render_cluster(self.cfg)
        want = {name: hashlib.sha256(content).hexdigest() for name, content in sources.items()}
        for node, client in self.clients.items():
            for name, sha in want.items():
                got = client.file_digest(name)
                if got.sha256 != sha:
                    raise StepFailed("preflight", node, f"DSpark table {name} differs from the head's "
                                                        f"({got.sha256[:12] or 'absent'} != {sha[:12]}): ranks would "
                                                        "disagree on the verify schedule")
        return plan_mod.render_cluster(self.cfg, dspark_tables=True)

    def _step_share(self, deadline: float) -> None:
        if not self.cfg["NFS_SHARE"]:
            return
        plans = {p.node: p for p in self._plans}
        head = self.cfg.head.name
        try:
            state = self.clients[head].ensure_export(plans[head], deadline)
        except AgentUnavailable as exc:
            raise StepFailed("share", head, f"export: {exc.code}: {exc.details}") from None
        if not state.exported:
            raise StepFailed("share", head, f"export of {plans[head].export.path} failed: {state.detail}")
        end = self._monotonic() + deadline
        workers = [n for n in self.clients if n != head]
        for node in workers:
            try:
                self.clients[node].ensure_mount(plans[node], deadline)
            except AgentUnavailable as exc:
                raise StepFailed("share", node, f"mount: {exc.code}: {exc.details}") from None
        pending = set(workers)
        last: dict[str, pb.MountState] = {}
        while pending:
            for node in sorted(pending):
                last[node] = self.clients[node].get_mount()
                if last[node].state == pb.MountState.HEALTHY:
                    pending.discard(node)
            if not pending:
                break
            if self._monotonic() > end:
                node = sorted(pending)[0]
                state = last[node]
                raise StepFailed("share", node, f"mount of {plans[node].mount.what} at {plans[node].mount.where} is "
                                                f"{pb.MountState.State.Name(state.state).lower()}: {state.detail}")
            self._sleep(0.5)

    def _step_fabric(self, deadline: float) -> None:
        plans = {p.node: p for p in self._plans}
        reports = self._each(lambda c: c.check_fabric(plans[c.node], deadline), "fabric")
        self._set(fabric=reports)
        for node, report in reports.items():
            if not report.ok:
                failed = [f"{c.name}: {c.detail}" for c in report.checks if not c.ok]
                raise StepFailed("fabric", node, "; ".join(failed) or "fabric check failed")

    def _step_pack(self, deadline: float) -> None:
        todo = [p for p in self._plans if p.pack.required]
        if not todo:
            return
        plans = {p.node: p for p in todo}
        states = {p.node: self.clients[p.node].pack_state(p) for p in todo}
        incomplete = {n: [l for l in s.layers if l.state != "complete"] for n, s in states.items()}
        incomplete = {n: ls for n, ls in incomplete.items() if ls}
        if not incomplete:
            return
        if not plans[next(iter(incomplete))].pack.run_if_missing:
            node, layers = next(iter(incomplete.items()))
            what = ", ".join(f"layer {l.layer} rank {l.rank}: {l.state}" + (f" ({l.detail})" if l.detail else "")
                             for l in layers)
            raise StepFailed("pack", node, f"packed Engram shards not complete ({what}); run `dsv41ctl pack` "
                                           "or set SKIP_PREPARE=0")
        for node in incomplete:
            self.clients[node].start_pack(plans[node])
        end = self._monotonic() + deadline
        while incomplete:
            if self._monotonic() > end:
                raise StepFailed("pack", sorted(incomplete)[0], f"pack not complete after {deadline:g} s")
            self._sleep(2.0)
            for node in list(incomplete):
                state = self.clients[node].pack_state(plans[node])
                if all(l.state == "complete" for l in state.layers):
                    del incomplete[node]
                elif not state.running:
                    bad = [l for l in state.layers if l.state != "complete"]
                    raise StepFailed("pack", node, f"pack job ended with {bad[0].state}: {bad[0].detail or state.status_text}")

    def _step_launch(self, deadline: float) -> None:
        # Workers first, then the head: rank 0 starts the rendezvous the others are waiting for.
        generation = self.snapshot().generation
        if self._api_key:
            head = self.cfg.head.name
            try:
                self.clients[head].put_file(os.path.basename(plan_mod.API_KEY_NODE_PATH), self._api_key.encode(),
                                            mode=0o600)
            except AgentUnavailable as exc:
                raise StepFailed("launch", head, f"cannot place the API key file: {exc.code}: {exc.details}") from None
        order = sorted(self._plans, key=lambda p: (p.rank == 0, p.rank))
        for node_plan in order:
            try:
                reply = self.clients[node_plan.node].start_rank(node_plan, generation, replace=True,
                                                                timeout_s=int(deadline))
            except AgentUnavailable as exc:
                raise StepFailed("launch", node_plan.node, f"{exc.code}: {exc.details}") from None
            with self._lock:
                ranks = dict(self._snapshot.ranks)
                ranks[node_plan.node] = reply.rank
                self._snapshot = replace(self._snapshot, ranks=ranks)
                self._launched[node_plan.node] = reply.rank.invocation_id
            self._log.info("rank_launched", f"{node_plan.node}: rank {node_plan.rank} "
                           f"{pb.StartRankResponse.Outcome.Name(reply.outcome).lower()} (pid {reply.rank.main_pid})",
                           node_name=node_plan.node, rank=node_plan.rank, pid=reply.rank.main_pid,
                           invocation=reply.rank.invocation_id)

    def _first_exit(self) -> str | None:
        for node, why in list(self._exited.items()):
            return f"rank on {node} exited during bring-up: {why}"
        return None

    def _step_health(self, deadline: float) -> None:
        result = serving.wait_healthy(self.base_url, deadline, self._first_exit, sleep=self._sleep,
                                      monotonic=self._monotonic, interval_s=0.2)
        if not result.ok:
            raise StepFailed("health", self.cfg.head.name, result.detail)

    def _step_smoke(self, deadline: float) -> None:
        result = serving.smoke(self.base_url, str(self.cfg["SERVED_MODEL_NAME"]), bool(self.cfg["SMOKE_QUICK"]),
                               int(self.cfg["MAX_RUNNING_REQUESTS"]), timeout=deadline, api_key=self._api_key)
        if not result.ok:
            raise StepFailed("smoke", self.cfg.head.name, result.detail)
        exited = self._first_exit()
        if exited:
            raise StepFailed("smoke", None, exited)

    # -- adoption and stop

    def _adopt(self) -> bool:
        """A restarted coordinator takes over ranks that run the current plans instead of restarting them."""
        try:
            statuses = self._each(lambda c: c.status(), "adopt")
        except StepFailed as exc:
            self._log.warning("adopt_skipped", f"cannot see every agent ({exc}); bringing the cluster up instead")
            return False
        running = {n for n, s in statuses.items() if s.rank.active_state in ("active", "activating")}
        if not running:
            return False
        try:
            plans = self._render_plans(sync_tables=False)
        except (AgentUnavailable, StepFailed):
            return False
        matches = all(statuses[p.node].rank.fingerprint == p.fingerprint for p in plans)
        if running != set(self.clients) or not matches:
            self._log.warning("adopt_refused", "ranks running do not match the current plans on every node "
                              f"(running on {', '.join(sorted(running))}); restarting the cluster")
            return False
        self._plans = plans
        self._launched = {n: s.rank.invocation_id for n, s in statuses.items()}
        with self._lock:
            self._snapshot = replace(self._snapshot, ranks={n: s.rank for n, s in statuses.items()},
                                     generation=generation_of(plans),
                                     fingerprints={p.node: p.fingerprint for p in plans})
        self._set(phase="health", detail="re-adopting running ranks")
        result = serving.health(self.base_url)
        if not result.ok:
            self._log.warning("adopt_refused", f"running ranks do not answer ({result.detail}); restarting")
            return False
        self._set(phase="serving", detail=f"serving on :{self.cfg['PORT']}, {len(plans)}/{len(plans)} ranks "
                                          "(re-adopted)", serving_since=self._clock())
        self._log.info("adopted", f"re-adopted a serving cluster ({len(plans)} ranks, generation "
                       f"{generation_of(plans)}) without restarting it")
        return True

    def _stop_cluster(self, why: str, final_phase: str | None = "stopped", wait_memory: bool = False) -> None:
        """Rank 0 first (it drains), then the workers; then confirm on every node that nothing is left."""
        self._set(phase="stopping", detail=why)
        deadline = int(self.cfg["RANK_STOP_TIMEOUT_S"])
        head = self.cfg.head.name
        results: dict[str, str] = {}

        def stop(client: AgentClient) -> str:
            try:
                reply = client.stop_rank(deadline)
                return pb.StopRankResponse.Outcome.Name(reply.outcome).lower()
            except AgentUnavailable as exc:
                return f"not confirmed: {exc.code}: {exc.details}"

        results[head] = stop(self.clients[head])
        workers = [c for n, c in self.clients.items() if n != head]
        with ThreadPoolExecutor(max_workers=max(1, len(workers))) as pool:
            for client, outcome in zip(workers, pool.map(stop, workers)):
                results[client.node] = outcome
        for node, client in self.clients.items():
            try:
                state = client.status().rank.active_state
                confirmed = state in ("absent", "inactive")
                detail = f"rank unit {state}"
            except AgentUnavailable as exc:
                confirmed, detail = False, f"agent unreachable: {exc.details}"
            priority = "info" if confirmed else "err"
            self._log.event("rank_stop_confirmed" if confirmed else "rank_stop_unconfirmed",
                            f"{node}: stop {results[node]}; {detail}", priority, node_name=node)
        if final_phase:
            self._set(phase=final_phase, detail=why, serving_since=0.0)
        if wait_memory:  # only a restart stacks new ranks on the memory the old ones held
            self._wait_memory_back()

    # -- the share, on an operator's request

    def _ask(self, fn: Callable[[AgentClient], object], nodes: list[str]) -> dict[str, share.Asked]:
        """fn on each node at once; an agent that cannot answer is an Asked with its error."""
        out = {}
        for name, future in self._on_nodes(fn, nodes).items():
            try:
                out[name] = share.Asked(future.result())
            except AgentUnavailable as exc:
                out[name] = share.Asked(None, f"{exc.code}: {exc.details}")
        return out

    def _unexport(self, force: bool, unmount: bool) -> tuple[bool, str]:
        head = self.cfg.head.name
        workers = [name for name in self.clients if name != head]
        statuses = self._ask(lambda c: c.status(timeout=10.0), list(self.clients))
        if statuses[head].answer is None:
            return False, f"cannot reach {head}'s agent ({statuses[head].error}): nothing was changed"
        path = statuses[head].answer.export.path
        running = share.running_ranks(statuses)
        mounted = share.holders(self._ask(lambda c: c.get_mount(), workers))
        notes = []
        if unmount and mounted and (force or not running):
            for node, _ in mounted:
                try:
                    self.clients[node].remove_mount()
                    notes.append(f"unmounted on {node}")
                except AgentUnavailable as exc:
                    notes.append(f"not unmounted on {node}: {exc.details}")
            mounted = share.holders(self._ask(lambda c: c.get_mount(), [node for node, _ in mounted]))
        reason = share.refusal(path, mounted, running, self.snapshot().phase)
        held_by = [node for node, _ in mounted]
        if reason and not force and not mounted:
            self._log.warning("unexport_refused", reason, ranks_running=",".join(n for n, _ in running))
            return False, reason
        try:
            state = self.clients[head].remove_export(force, held_by)
        except AgentUnavailable as exc:
            if exc.code == "FAILED_PRECONDITION" and not force:
                message = reason or f"refused by {head}'s agent: {exc.details}"
                if notes:
                    message += f" ({'; '.join(notes)})"
                self._log.warning("unexport_refused", message, mounted_by=",".join(held_by),
                                  ranks_running=",".join(n for n, _ in running))
                return False, message
            return False, f"{head}: RemoveExport: {exc.code}: {exc.details}"
        path = state.path or path
        if state.detail == "was not exported":
            message = f"nothing was exported on {head}"
        else:
            message = f"unexported {path} on {head}"
        if notes:
            message += f" ({'; '.join(notes)})"
        forced = share.forced_note(mounted, running) if force and state.detail != "was not exported" else ""
        if forced:
            message += f" (forced): {forced}"
            self._incident(head, "export_forced", message)
        else:
            self._log.info("share_unexported", message, path=path)
        return True, message

    def _wait_memory_back(self) -> None:
        """A restart must not stack a new rank on memory the old one has not returned yet."""
        need = float(self.cfg["RANK_MEMORY_GIB"]) * GIB
        end = self._monotonic() + float(self.cfg["MEMORY_RECOVERY_TIMEOUT_S"])
        pending = set(self.clients)
        while pending and self._monotonic() < end:
            for node in sorted(pending):
                try:
                    if self.clients[node].status().memory.available_bytes >= need:
                        pending.discard(node)
                except AgentUnavailable:
                    pass
            if pending:
                self._sleep(1.0)
        for node in sorted(pending):
            self._log.warning("memory_not_back", f"{node}: available memory still below RANK_MEMORY_GIB after the "
                              "stop", node_name=node)
