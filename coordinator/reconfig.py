"""The running coordinator's configuration: which one runs, and changing it without an outage.

`apply()` validates cluster.env first (an invalid file changes nothing), compares it with the running
configuration, and replaces the Session: coordinator-side keys take effect at once, rank-side keys
through one restart of the group, rolled back if the group does not serve. `rollback()` brings the
configuration before the current one back. Calls are serialised; the control socket calls them.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from dsv41.journal import EventLog

from . import config as config_mod
from . import configdiff
from .configstore import ConfigStore, Source, choose_at_start, digest
from .runtime import Rollout
from .session import STOPPED_PHASES, Credentials, Outcome, Session, Unusable, credentials, parse_text


def first_config(path: str, store: ConfigStore) -> tuple[config_mod.ClusterConfig, str, str]:
    """The configuration to start with, its text, and why it is not cluster.env's (empty when it
    is): the one applied before runs when the file is invalid or holds a change that was rolled
    back. config_mod.ConfigInvalid: neither is usable."""
    try:
        (text, cfg), invalid = config_mod.read(path), None
    except config_mod.ConfigInvalid as exc:
        text, cfg, invalid = None, None, exc
    applied = store.applied()
    choice = choose_at_start(invalid is None, text, applied, store.rejected(), str(invalid) if invalid else "")
    if choice is None:
        raise invalid
    if choice.source is Source.FILE:
        return cfg, text, ""
    return parse_text(applied, path), applied, choice.why


class Coordinator:
    def __init__(self, path: str, store: ConfigStore, log: EventLog, state_dir: str,
                 clock: Callable[[], float] = time.time, session_factory: Callable[..., Session] = Session,
                 spawn: Callable[[Callable[[], None]], None] | None = None):
        self.path = path
        self._store, self._log, self._state_dir, self._clock = store, log, state_dir, clock
        self._new_session = session_factory
        self._started_unix_s = clock()  # the sessions' incidents from before it are earlier coordinators'
        # A rollback runs beside the supervisor that asks for it (it replaces that supervisor).
        self._spawn = spawn or (lambda fn: threading.Thread(target=fn, name="rollback", daemon=True).start())
        self._lock = threading.RLock()
        self._listeners: list[Callable] = []
        self._session: Session | None = None

    # Read by the control service on every call: the session of the moment.
    @property
    def session(self) -> Session:
        return self._session

    @property
    def cfg(self) -> config_mod.ClusterConfig:
        return self._session.cfg

    @property
    def runtime(self):
        return self._session.runtime

    @property
    def api_key(self) -> str | None:
        return self._session.api_key

    def on_incident(self, listener: Callable) -> None:
        """listener(incident) for the incidents of this session and every later one."""
        self._listeners.append(listener)
        if self._session is not None:
            self._session.runtime.on_incident(listener)

    # ------------------------------------------------------------------ start and stop

    def start(self, cfg: config_mod.ClusterConfig, text: str, creds: Credentials, autostart: bool) -> None:
        """The first session. A file that differs from the one applied before is a change like any
        other: the ranks are restarted for it only when their plans differ, under a rollout."""
        with self._lock:
            applied = self._store.applied()
            restart_for, rollout = (), None
            if applied is not None and applied != text:
                try:
                    before = parse_text(applied, self.path)
                    change = configdiff.diff(before, cfg)
                    if change.restarts_ranks:
                        restart_for, rollout = change.restart_keys, self._rollout(change, applied, cfg, text)
                        self._log_diff(change, "at start")
                except config_mod.ConfigInvalid:
                    pass  # the stored one no longer parses (an upgrade's new rule): nothing to compare with
            self._session = self._new_session(cfg, text, creds, self._log, self._listeners, self._state_dir,
                                             self._started_unix_s)
            self._session.start(autostart, restart_for if autostart else (), rollout if autostart else None)
            self._store.record_applied(text)

    def stop(self, stop_cluster: bool) -> None:
        with self._lock:
            if self._session is not None:
                self._session.stop(stop_cluster)

    def note(self) -> str:
        """What status says when cluster.env is not what runs; empty when it is."""
        try:
            with open(self.path, encoding="utf-8") as f:
                text = f.read(1 << 20)
        except (OSError, UnicodeDecodeError) as exc:
            return f"{self.path}: cannot read ({exc}); the configuration applied before runs"
        session = self._session
        if session is None or text == session.text:
            return ""
        rejected = self._store.rejected()
        if rejected is not None and rejected.sha256 == digest(text):
            return (f"{self.path} holds a change that was rolled back ({rejected.why}); the configuration before "
                    "it runs: fix the file, then `dsv41ctl config apply`")
        return f"{self.path} differs from the running configuration: `dsv41ctl config diff`, then `dsv41ctl config apply`"

    # ------------------------------------------------------------------ changes

    def diff(self) -> Outcome:
        """cluster.env against the running configuration, changing nothing."""
        try:
            new = config_mod.load(self.path)
        except config_mod.ConfigInvalid as exc:
            return Outcome(False, f"{self.path} is invalid; applying it would change nothing:\n{exc}")
        with self._lock:
            change = configdiff.diff(self._session.cfg, new)
        return Outcome(True, _summary(change), change)

    def apply(self, by: str) -> Outcome:
        """cluster.env, validated, compared and applied; an invalid or unusable file changes nothing."""
        try:
            text, new = config_mod.read(self.path)
        except config_mod.ConfigInvalid as exc:  # unreadable, or invalid
            return self._refused(f"{self.path} is invalid; nothing was changed:\n{exc}")
        with self._lock:
            outcome = self._replace(new, text, by, rollout=True)
            if outcome.ok:
                self._store.forget_rejected()
            return outcome

    def rollback(self, by: str) -> Outcome:
        """The configuration before the current one, brought back on request."""
        with self._lock:
            previous = self._store.previous()
            if previous is None:
                return self._refused("no earlier configuration was applied on this head: nothing to roll back to")
            try:
                cfg = parse_text(previous, self.path)
            except config_mod.ConfigInvalid as exc:
                return self._refused(f"the earlier configuration no longer validates; nothing was changed:\n{exc}")
            bad = self._session.text
            outcome = self._replace(cfg, previous, by, rollout=False)
            if outcome.ok:
                self._store.record_rolled_back(bad, previous, self._clock(), f"rolled back by {by}")
            return outcome

    def _rolled_back(self, bad: str, previous: str, why: str) -> None:
        """A rollout that failed (from the supervisor, which must not wait for its own replacement)."""
        def run() -> None:
            with self._lock:
                if self._session is None or self._session.text != bad:
                    return  # replaced meanwhile by an operator's apply
                try:
                    cfg = parse_text(previous, self.path)
                except config_mod.ConfigInvalid as exc:
                    self._log.error("rollback_failed", f"cannot bring the earlier configuration back: {exc}")
                    return
                outcome = self._replace(cfg, previous, "the coordinator (rollout failed)", rollout=False, force=True)
                if outcome.ok:
                    self._store.record_rolled_back(bad, previous, self._clock(), why)
        self._spawn(run)

    def _rollout(self, change: configdiff.ConfigDiff, previous: str, new: config_mod.ClusterConfig,
                 text: str) -> Rollout:
        return Rollout(change.restart_keys, new.number("ROLLOUT_CONFIRM_S"),
                       lambda why: self._rolled_back(text, previous, why))

    def _replace(self, new: config_mod.ClusterConfig, text: str, by: str, rollout: bool,
                 force: bool = False) -> Outcome:
        old = self._session
        change = configdiff.diff(old.cfg, new)
        if not change.changes and text == old.text and not force:
            return Outcome(True, "cluster.env is what runs: nothing to apply", change)
        try:
            creds = credentials(new)
        except Unusable as exc:
            return self._refused(f"{self.path} cannot be run; nothing was changed: {exc}")
        phase = old.runtime.snapshot().phase
        running = phase not in STOPPED_PHASES
        restart_for = change.restart_keys if (running and change.restarts_ranks) or force else ()
        plan = self._rollout(change, old.text, new, text) if rollout and restart_for else None
        old.stop(stop_cluster=False)
        self._session = self._new_session(new, text, creds, self._log, self._listeners, self._state_dir,
                                         self._started_unix_s)
        self._session.start(running or force, restart_for, plan)
        self._store.record_applied(text)
        self._log_diff(change, f"applied by {by}")
        return Outcome(True, _summary(change, restart_for, running), change)

    def _refused(self, message: str) -> Outcome:
        self._log.warning("config_refused", message.split("\n")[0], config=self.path)
        return Outcome(False, message)

    def _log_diff(self, change: configdiff.ConfigDiff, how: str) -> None:
        keys = ", ".join(c.key for c in change.changes) or "none"
        self._log.event("config_applied", f"configuration {how}: {len(change.changes)} key(s) changed ({keys})"
                        + ("; the ranks restart for " + ", ".join(change.rank_keys) if change.restarts_ranks else ""),
                        "notice", keys=keys, restarts_ranks=int(change.restarts_ranks))


def _summary(change: configdiff.ConfigDiff, restart_for: tuple[str, ...] | None = None,
             running: bool = True) -> str:
    if not change.changes:
        return "no key differs from the running configuration"
    lines = change.describe()
    if restart_for is None:
        tail = ("applying it restarts the ranks once" if change.restarts_ranks
                else "applying it keeps the ranks running")
    elif restart_for:
        tail = "the ranks are restarting for it (dsv41ctl status follows)"
    elif change.restarts_ranks and not running:
        tail = "the cluster is not running: the ranks start with it at the next `dsv41ctl start`"
    else:
        tail = "applied; the ranks kept running"
    return "\n".join(lines + [tail])
