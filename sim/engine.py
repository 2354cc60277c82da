"""The stand-in's scheduler: requests wait, are admitted up to --max-running-requests, prefill in
chunks of --chunked-prefill-size at a fixed token rate (shared by all requests, as on one GPU),
then decode one token per request per decode step, all decoding requests in one batch. Prefill
allocates real memory per token; completion or abort frees it. An abort takes effect at the next
chunk boundary, as in SGLang.

Every forward step (a prefill chunk or a decode batch) begins with `begin_step()`: the rank's
progress counter moves and, in a TP group, rank 0 waits for every worker to take part in the step
(sim/group.py), so a stopped worker stalls generation here. The lock is never held meanwhile:
the HTTP side (in-flight listing, aborts) keeps answering while a step hangs, as SGLang's
tokenizer process does."""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from .memory import ChunkMemory


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


class Rejected(Exception):
    """A request the engine does not take; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(eq=False)
class Request:
    rid: str
    prompt_tokens: int
    created: float
    prefilled: int = 0
    generated: int = 0
    wanted: int = 0  # output tokens its client asked for so far (the decode step makes them)
    phase: Phase = Phase.WAITING
    finish_reason: str | None = None
    abort_requested: bool = False
    memory: ChunkMemory = field(default_factory=ChunkMemory)


@dataclass(frozen=True)
class EngineConfig:
    chunk_tokens: int  # -1: no chunking, a prompt is prefilled at once
    max_running: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    bytes_per_token: int
    max_total_tokens: int  # only reported (/v1/loads)
    context_length: int | None


def plan_chunk(pending: list[tuple[str, int]], budget: int) -> list[tuple[str, int]]:
    """One prefill batch: FCFS over (rid, tokens still to prefill), at most `budget` tokens in all
    (budget < 0: unlimited); the last request taken may be cut (chunked)."""
    batch = []
    for rid, remaining in pending:
        if budget == 0:
            break
        take = remaining if budget < 0 else min(remaining, budget)
        if take > 0:
            batch.append((rid, take))
            if budget > 0:
                budget -= take
    return batch


class Engine:
    def __init__(self, config: EngineConfig, on_fatal: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 begin_step: Callable[[], None] = lambda: None) -> None:
        self.config = config
        self._on_fatal = on_fatal
        self._clock = clock
        self._sleep = sleep
        self._begin_step = begin_step
        self._cond = threading.Condition()
        self._requests: dict[str, Request] = {}  # in arrival order; finished ones are removed
        self._last_step_at = float("-inf")  # time.monotonic() when the last forward step completed
        self._accepting = True
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # --- the tokenizer side -------------------------------------------------------------------

    def submit(self, rid: str, prompt_tokens: int) -> Request:
        limit = self.config.context_length
        if limit is not None and prompt_tokens > limit:
            raise Rejected(400, f"The input ({prompt_tokens} tokens) is longer than the model's context "
                                f"length ({limit} tokens).")
        with self._cond:
            if not self._accepting:
                raise Rejected(503, "The server is shutting down; not accepting new requests.")
            if rid in self._requests:
                raise Rejected(400, f"Duplicate request ID: {rid}")
            request = Request(rid, max(prompt_tokens, 1), self._clock())
            self._requests[rid] = request
            self._cond.notify_all()
            return request

    def abort(self, rid: str, abort_all: bool = False) -> list[str]:
        """Flags requests for abort and returns their rids. Like SGLang 0.5.23 with one tokenizer
        worker: an empty rid without abort_all does nothing; otherwise the rid must be one in flight,
        and then every request whose rid starts with it is aborted (the scheduler's prefix match)."""
        with self._cond:
            if abort_all:
                chosen = list(self._requests.values())
            elif not rid or rid not in self._requests:
                chosen = []
            else:
                chosen = [r for r in self._requests.values() if r.rid.startswith(rid)]
            for request in chosen:
                request.abort_requested = True
                if request.phase is Phase.WAITING:
                    self._finish_locked(request, "abort")
            self._cond.notify_all()
            return [r.rid for r in chosen]

    def wait_prefilled(self, request: Request) -> None:
        """Blocks until the request's prefill is done or it finished (aborted)."""
        with self._cond:
            while request.phase in (Phase.WAITING, Phase.PREFILL):
                self._cond.wait()

    def next_token(self, request: Request) -> bool:
        """Waits for the decode step that makes this request's next token; False when the request
        was aborted (then it is finished)."""
        with self._cond:
            if request.abort_requested or request.phase is Phase.FINISHED:
                self._finish_locked(request, "abort")
                return False
            request.wanted += 1
            self._cond.notify_all()
            while request.generated < request.wanted and not request.abort_requested \
                    and request.phase is not Phase.FINISHED:
                self._cond.wait()
            if request.abort_requested or request.phase is Phase.FINISHED:
                self._finish_locked(request, "abort")
                return False
            return True

    def cancel(self, request: Request) -> None:
        """Aborts one request whose client went away. A prefill in progress ends at the chunk
        boundary (the scheduler owns its memory until then)."""
        with self._cond:
            request.abort_requested = True
            if request.phase in (Phase.WAITING, Phase.DECODE):
                self._finish_locked(request, "abort")
            self._cond.notify_all()

    def finish(self, request: Request, reason: str) -> None:
        with self._cond:
            self._finish_locked(request, "abort" if request.abort_requested else reason)

    def stop_accepting(self) -> None:
        with self._cond:
            self._accepting = False

    @property
    def last_step_at(self) -> float:
        """time.monotonic() when the last forward step completed (-inf before the first)."""
        with self._cond:
            return self._last_step_at

    @property
    def accepting(self) -> bool:
        with self._cond:
            return self._accepting

    def wait_idle(self, timeout_s: float) -> bool:
        """True once no request is in flight; False after timeout_s (real time, not the clock
        that stamps request ages)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._requests:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.1))
            return True

    # --- what the HTTP side reports -------------------------------------------------------------

    def inflight(self) -> list[dict]:
        now = self._clock()
        with self._cond:
            return [{"rid": r.rid, "prompt_tokens": r.prompt_tokens, "prefilled_tokens": r.prefilled,
                     "age_s": round(now - r.created, 3)} for r in self._requests.values()]

    def loads(self) -> dict:
        with self._cond:
            active = list(self._requests.values())
        waiting = [r for r in active if r.phase is Phase.WAITING]
        running = [r for r in active if r.phase in (Phase.PREFILL, Phase.DECODE)]
        used = sum(r.prefilled + r.generated for r in running)
        total = self.config.max_total_tokens
        return {
            "dp_rank": 0,
            "num_running_reqs": len(running),
            "num_waiting_reqs": len(waiting),
            "num_waiting_uncached_tokens": sum(r.prompt_tokens for r in waiting),
            "num_used_tokens": used,
            "num_total_tokens": used,
            "max_total_num_tokens": total,
            "max_running_requests": self.config.max_running,
            "token_usage": round(used / total, 6) if total else 0.0,
            "memory_bytes": sum(r.memory.nbytes for r in active),
        }

    # --- the scheduler --------------------------------------------------------------------------

    def _finish_locked(self, request: Request, reason: str) -> None:
        if request.phase is Phase.FINISHED:
            return
        request.phase = Phase.FINISHED
        request.finish_reason = reason
        request.memory.release()
        self._requests.pop(request.rid, None)
        self._cond.notify_all()

    def _next_batch(self) -> list[tuple[Request, int]] | None:
        """Under the lock: finishes aborted prefills, admits waiting requests, plans a chunk."""
        for request in list(self._requests.values()):
            if request.abort_requested and request.phase in (Phase.WAITING, Phase.PREFILL):
                self._finish_locked(request, "abort")
        running = sum(1 for r in self._requests.values() if r.phase in (Phase.PREFILL, Phase.DECODE))
        for request in self._requests.values():
            if running >= self.config.max_running:
                break
            if request.phase is Phase.WAITING:
                request.phase = Phase.PREFILL
                running += 1
        prefilling = {r.rid: r for r in self._requests.values() if r.phase is Phase.PREFILL}
        batch = plan_chunk([(rid, r.prompt_tokens - r.prefilled) for rid, r in prefilling.items()],
                           self.config.chunk_tokens)
        return [(prefilling[rid], take) for rid, take in batch] or None

    def _decoding(self) -> list[Request]:
        """Under the lock: the requests the next decode step makes a token for."""
        return [r for r in self._requests.values()
                if r.phase is Phase.DECODE and r.wanted > r.generated and not r.abort_requested]

    def _decode_step(self, batch: list[Request]) -> None:
        self._sleep(1.0 / self.config.decode_tokens_per_s)
        with self._cond:
            for request in batch:
                if request.phase is Phase.DECODE and not request.abort_requested:
                    request.generated += 1
            self._last_step_at = time.monotonic()
            self._cond.notify_all()

    def _run(self) -> None:
        # Touching pages takes real time (about 0.4 s per GiB); it counts toward the next chunk's
        # time so that memory grows at the configured rate, not below it.
        debt = 0.0
        while True:
            with self._cond:
                batch = self._next_batch()
                decoding = [] if batch else self._decoding()
                while batch is None and not decoding and not self._closed:
                    debt = 0.0
                    self._cond.wait()
                    batch = self._next_batch()
                    decoding = [] if batch else self._decoding()
                if self._closed:
                    return
            self._begin_step()  # the collective: may wait for a peer, or end the process (watchdog)
            if batch is None:
                self._decode_step(decoding)
                continue
            self._sleep(max(0.0, sum(take for _, take in batch) / self.config.prefill_tokens_per_s - debt))
            started = self._clock()
            for request, take in batch:
                if request.abort_requested:
                    continue  # finished at the top of the next round, at this chunk boundary
                try:
                    request.memory.grow(take * self.config.bytes_per_token)
                except (MemoryError, OSError) as exc:
                    # Like a CUDA out-of-memory error in SGLang's scheduler: the rank dies.
                    self._on_fatal(f"out of memory prefilling request {request.rid} "
                                   f"({take * self.config.bytes_per_token} more bytes): {exc}")
                    return
            debt = self._clock() - started
            with self._cond:
                for request, take in batch:
                    if request.phase is Phase.PREFILL and not request.abort_requested:
                        request.prefilled += take
                        if request.prefilled >= request.prompt_tokens:
                            request.phase = Phase.DECODE
                self._last_step_at = time.monotonic()
                self._cond.notify_all()
