"""Entry point of dsv41-sim-rank: parse the SGLang argv, form the group, serve (rank 0) or follow."""

from __future__ import annotations

import os
import resource
import signal
import sys
import threading
import time
from typing import Callable, Sequence, TextIO

from dsv41.adapterlog import PREFIX as ADAPTER_PREFIX  # the stand-in's gate lines read as the rank's adapter writes them
from dsv41.progress import ProgressWriter

from . import settings as settings_mod
from .allocator import AnonymousMemory
from .args import SimArgs, parse, with_key_file
from .engine import Engine, EngineConfig
from .group import GroupError, Head, StepHung, Worker
from .settings import Settings

DEFAULT_CHUNK = 8192  # SGLang picks per GPU when --chunked-prefill-size is absent
DEFAULT_MAX_RUNNING = 64


class Log:
    """One line per event on a stream, prefixed like SGLang's `[time TPn]`."""

    def __init__(self, rank: int, stream: TextIO, clock: Callable[[], float] = time.time) -> None:
        self._prefix = f"sim-rank{rank}"
        self._stream = stream
        self._clock = clock
        # Reentrant: a signal handler may log while the main thread is writing a line.
        self._lock = threading.RLock()

    def __call__(self, message: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self._clock()))
        with self._lock:
            self._stream.write(f"[{stamp} {self._prefix}] {message}\n")
            self._stream.flush()


def _die(log: Log, message: str, status: int = 1) -> None:
    """Exits at once from any thread, as a crashed rank does (the OS frees its memory)."""
    log(message)
    os._exit(status)


def _watchdog_kill(log: Log, what: str, timeout_s: float) -> None:
    """What SGLang's scheduler watchdog does when a forward step does not complete: it logs, then
    SIGQUITs the process (here without a core file)."""
    log(f"Scheduler watchdog timeout (self.watchdog_timeout={timeout_s:g}, self.soft=False): {what}")
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.kill(os.getpid(), signal.SIGQUIT)
    time.sleep(5)
    os._exit(1)  # not reached: SIGQUIT has no handler


def progress_writer(args: SimArgs, log: Log, env=os.environ) -> ProgressWriter | None:
    """The rank's forward-step counter for its node's agent (DSV41_PROGRESS_DIR, else /dev/shm)."""
    directory = env.get("DSV41_PROGRESS_DIR") or "/dev/shm"
    try:
        return ProgressWriter(args.rank, directory)
    except OSError as exc:
        log(f"warning: no progress counter in {directory}: {exc.strerror or exc}; the agent cannot see this "
            "rank's forward steps")
        return None


def engine_config(args: SimArgs, settings: Settings) -> EngineConfig:
    chunk = args.chunked_prefill_size if args.chunked_prefill_size is not None else DEFAULT_CHUNK
    return EngineConfig(chunk_tokens=int(chunk),
                        max_running=int(args.max_running_requests or DEFAULT_MAX_RUNNING),
                        prefill_tokens_per_s=settings.prefill_tokens_per_s,
                        decode_tokens_per_s=settings.decode_tokens_per_s,
                        bytes_per_token=settings.bytes_per_token,
                        max_total_tokens=int(args.max_total_tokens or 0),
                        context_length=args.context_length,
                        transient_bytes=settings.transient_bytes,
                        empty_cache_tokens=settings.empty_cache_tokens, admission=settings.admission,
                        kv_pool=settings.kv_pool)


LOAD_STEPS = 50


def load_weights(settings: Settings, log: Log, stop: threading.Event, memory=None) -> list:
    """The model load: DSV41_SIM_LOAD_BYTES of real memory taken evenly over DSV41_SIM_LOAD_S (the
    weights, read shard by shard), kept for the life of the process; returns the mappings. A rank
    that cannot get the memory dies as a CUDA out-of-memory error at load kills SGLang's."""
    memory = memory or AnonymousMemory()
    held: list = []
    total = settings.load_bytes
    steps = LOAD_STEPS if total else 0
    for i in range(steps):
        if stop.is_set():
            break
        size = total * (i + 1) // steps - total * i // steps
        try:
            held.append(memory.map(size))
        except (MemoryError, OSError) as exc:
            _die(log, f"error: out of memory loading the model ({total} bytes): {exc}")
        stop.wait(settings.load_s / steps)
    if total and not stop.is_set():
        log(f"model loaded: {total} bytes of weights held")
    return held


def run_head(args: SimArgs, settings: Settings, log: Log) -> int:
    # Imported here: http.server pulls in ssl and email (~8 MB) that worker ranks never need.
    from .api import ApiState, serve

    stop = threading.Event()
    received: list[str] = []

    def on_signal(signum: int, _frame: object) -> None:
        # Only record it: the main thread drains (and logs) once it wakes up.
        received.append(signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    head: Head | None = None
    if int(args.nnodes) > 1:
        def on_lost(rank: int, reason: str) -> None:
            log(f"lost rank {rank} ({reason}); the TP group cannot continue, exiting")
            assert head is not None
            head.report_lost(rank, reason)
            _die(log, f"exit 1: rank {rank} lost")

        head = Head(args, settings.peer_timeout_s, settings.heartbeat_s, log, on_lost)
        try:
            head.listen()
            formed = head.gather(settings.rendezvous_timeout_s, stop)
        except GroupError as exc:
            log(f"error: {exc}")
            return 1
        if not formed:
            head.shutdown_workers()
            log("stopped before the group formed; exit 0")
            return 0

    progress = progress_writer(args, log)
    watchdog_s = float(args.watchdog_timeout)
    steps = [0]

    def begin_step() -> None:
        # Like forward_ct in SGLang's run_batch: counted when the step starts; the hung rank is the
        # one that never starts the step its peers wait in.
        steps[0] += 1
        if progress is not None:
            progress.step()
        if head is not None:
            try:
                head.step(steps[0], watchdog_s)
            except StepHung as exc:
                _watchdog_kill(log, str(exc), watchdog_s)

    engine = Engine(engine_config(args, settings), on_fatal=lambda why: _die(log, f"error: {why}"),
                    begin_step=begin_step, log=lambda line: log(ADAPTER_PREFIX + line))
    engine.start()
    state = ApiState(args, engine, log)
    try:
        server = serve(state, args.host, int(args.port))
    except OSError as exc:
        # Exiting closes the group's connections: the workers fail too, as with a crashed rank 0.
        log(f"error: cannot serve HTTP on {args.host}:{args.port}: {exc.strerror or exc}")
        return 1
    weights: list = []  # held until the process exits
    if settings.load_s > 0 or settings.load_bytes:
        log(f"HTTP up on {args.host}:{args.port}; /health answers 503 while 'loading' for {settings.load_s:g} s"
            + (f" ({settings.load_bytes} bytes of weights)" if settings.load_bytes else ""))
        weights.extend(load_weights(settings, log, stop))
        if not settings.load_bytes:
            stop.wait(settings.load_s)
    if not stop.is_set():
        state.set_state("serving")
        log(f"serving {args.model_name} on http://{args.host}:{args.port} (stand-in engine, no model)")
    while not stop.wait(0.5):
        pass

    state.set_state("draining")
    engine.stop_accepting()
    log(f"{received[0] if received else 'stop'} received: /health answers 503, new requests are refused; "
        f"draining {len(engine.inflight())} in-flight requests (up to {settings.drain_timeout_s:g} s), "
        "then shutting down all ranks")
    if not engine.wait_idle(settings.drain_timeout_s):
        left = engine.abort("", abort_all=True)
        log(f"drain budget of {settings.drain_timeout_s:g} s spent; aborted {len(left)} requests")
        engine.wait_idle(5.0)
    state.wait_responses(5.0)
    if head:
        stuck = head.shutdown_workers()
        if stuck:
            log(f"ranks {stuck} did not confirm the shutdown")
    server.shutdown()
    engine.close()
    log("drained; all ranks told to exit; exit 0")
    return 0


def run_worker(args: SimArgs, settings: Settings, log: Log) -> int:
    def on_term(_signum: int, _frame: object) -> None:
        # Like SGLang: a worker's launcher only logs SIGTERM; it exits when rank 0 shuts the group
        # down or goes away (stop the head first).
        log("SIGTERM received and ignored: a worker rank exits when rank 0 shuts the group down or is lost")

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, lambda *_: _die(log, "SIGINT: exiting", 130))
    progress = progress_writer(args, log)
    worker = Worker(args, settings.peer_timeout_s, settings.heartbeat_s, log,
                    on_step=lambda n: progress.step() if progress is not None else None)
    watchdog_s = float(args.watchdog_timeout)

    def watchdog() -> None:
        # SGLang's watchdog on every rank: a step this rank is in that does not complete.
        while True:
            time.sleep(min(watchdog_s / 2, 1.0))
            if worker.stuck_for() > watchdog_s:
                _watchdog_kill(log, f"waited {worker.stuck_for():.0f} s in a forward step for the other ranks",
                               watchdog_s)
    threading.Thread(target=watchdog, name="watchdog", daemon=True).start()
    try:
        formed = worker.join(settings.rendezvous_timeout_s)
    except GroupError as exc:
        log(f"error: {exc}")
        return 1
    if not formed:
        log("rank 0 shut down before the group formed; exit 0")
        return 0
    # Every rank loads its own shard of the weights once the group has formed, as SGLang does.
    weights: list = []  # held until the process exits
    threading.Thread(target=lambda: weights.extend(load_weights(settings, log, threading.Event())), name="load",
                     daemon=True).start()
    ok, why = worker.follow()
    if ok:
        log(f"{why}; exit 0")
        return 0
    log(f"error: {why}; the TP group cannot continue, exiting")
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    log = Log(args.rank, sys.stderr)
    try:
        settings = settings_mod.from_env(os.environ, args.dist_timeout)
    except ValueError as exc:
        log(f"error: {exc}")
        return 2
    try:
        args = with_key_file(args, os.environ)
    except ValueError as exc:
        # Like the adapter in SGLang: a key that cannot be read stops the rank, never "serve without one".
        log(f"error: {exc}; the rank does not start")
        return 1
    log(f"dsv41-sim-rank (a stand-in for SGLang: no model, no GPU) rank {args.rank} of {args.nnodes}, "
        f"pid {os.getpid()}")
    # The watchdog ends the rank with SIGQUIT whatever it inherited: SGLang's launcher installs its
    # own SIGQUIT handler, and a shell's background job starts with SIGQUIT ignored.
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)
    if args.rank == 0:
        return run_head(args, settings, log)
    return run_worker(args, settings, log)


if __name__ == "__main__":
    sys.exit(main())
