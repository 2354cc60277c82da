"""Running one blocking call per node at once, on daemon threads.

Daemon threads, not a ThreadPoolExecutor: when the supervisor stops waiting for a call (an
operator's stop cancelled the step), the call is left to finish on its own, and the coordinator
must be able to exit meanwhile; the interpreter joins executor threads at exit.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Callable, Iterable, TypeVar

K = TypeVar("K")
T = TypeVar("T")


def spawn(fn: Callable[[], T], name: str = "call", on_done: Callable[[], None] | None = None) -> Future:
    """fn() on a daemon thread; its result or exception goes to the returned Future."""
    future: Future = Future()
    future.set_running_or_notify_cancel()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(exc)
        if on_done is not None:
            on_done()
    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def on_each(fn: Callable[[K], T], keys: Iterable[K], catch: tuple[type[BaseException], ...] = ()) -> dict[K, object]:
    """fn(key) for every key at once; returns key -> result, in the keys' order. An exception of a
    type in `catch` becomes that key's value; any other is raised (the first, in key order)."""
    keys = list(keys)
    futures = {key: spawn(lambda key=key: fn(key), name=f"each-{key}") for key in keys}
    out: dict[K, object] = {}
    for key, future in futures.items():
        try:
            out[key] = future.result()
        except catch as exc:
            out[key] = exc
    return out
