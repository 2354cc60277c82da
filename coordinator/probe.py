"""Whether a serving cluster has work pending, for the hang check: rank 0's in-flight list once a
second, and on an idle cluster a one-token canary (GET /health_generate, SGLang's health check that
always generates) every CANARY_INTERVAL_S. It only reports what it saw to the supervisor, which
decides; it never acts."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from typing import Callable

from .guard.engine import EngineApi
from .messages import CanaryDone, CanarySent, WorkSeen
from .state import Phase

POLL_S = 1.0
CANARY_TIMEOUT_S = 25.0  # SGLang answers 503 after 20 s without a generation
CANARY_PATH = "/health_generate"


def canary(base_url: str, timeout_s: float = CANARY_TIMEOUT_S) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}{CANARY_PATH}", timeout=timeout_s) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


class ServingProbe:
    def __init__(self, serving: Callable[[], bool], post: Callable[[object], None], engine: EngineApi,
                 canary_interval_s: float, monotonic: Callable[[], float] = time.monotonic,
                 ask_canary: Callable[[], bool] | None = None, poll_s: float = POLL_S):
        self._serving = serving
        self._post = post
        self._engine = engine
        self._canary_interval_s = canary_interval_s
        self._monotonic = monotonic
        self._ask_canary = ask_canary or (lambda: canary(engine.base_url))
        self._poll_s = poll_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="serving-probe", daemon=True)

    @classmethod
    def for_runtime(cls, runtime, api_key: str | None) -> "ServingProbe":
        cfg = runtime.cfg
        # A drain serves what is in flight: a hang then is still a hang.
        return cls(lambda: runtime.snapshot().phase in (Phase.SERVING, Phase.DRAINING), runtime.post,
                   EngineApi(runtime.base_url, api_key, timeout_s=2.0), cfg.number("CANARY_INTERVAL_S"))

    def start(self) -> "ServingProbe":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join(5.0)
        self._engine.close()

    def _run(self) -> None:
        last_work = self._monotonic()
        while not self._done.wait(self._poll_s):
            if not self._serving():
                last_work = self._monotonic()
                continue
            listing = self._engine.inflight()
            now = self._monotonic()
            # Without a list (rank 0's HTTP side not answering, or no adapter route) only the canary
            # can tell whether the group computes.
            busy = bool(listing.requests) and not listing.unavailable
            self._post(WorkSeen(None if listing.unavailable else busy, now, listing.unavailable))
            if busy:
                last_work = now
            elif now - last_work >= self._canary_interval_s:
                self._post(CanarySent(now))
                ok = self._ask_canary()
                self._post(CanaryDone(ok, self._monotonic()))
                last_work = self._monotonic()
