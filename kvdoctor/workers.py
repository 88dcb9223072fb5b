"""The sidecar's worker processes: Python work kept off the process the proxy relays in.

A thread's Python work holds the GIL the relay's event loop needs for every chunk it passes; a
stream waiting for it carries the wait in its TTFT (benchmarks/bench_proxy.py). So the sidecar's
heavier Python (the live step, /report renders, parsing an engine's /metrics page) runs in
processes of its own: one worker each, started with ``spawn`` (no copy of the agent's threads or
sockets), at :data:`WORKER_NICENESS`, and gone when the agent is gone.
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import threading
import time
from typing import Any, Callable

#: the niceness of the worker processes: when the cores are busy, the relay's streams and the
#: engine beside it run first, the analysis after
WORKER_NICENESS = 10


def exit_with_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """In a worker process: exit when the agent (``parent_pid``, passed in: it may be gone
    before the worker has started) is gone. A SIGKILLed agent leaves its workers blocked on
    their call queue (each holds both ends of it, so it never reads EOF), and with them the
    agent's stdout and stderr, so whoever waits on those would wait forever."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="kvdoctor-parent-watch").start()


def _init(parent_pid: int, init: Callable[..., None] | None, init_args: tuple[Any, ...]) -> None:
    if hasattr(os, "nice"):  # POSIX; lowering one's own priority needs no privilege
        os.nice(WORKER_NICENESS)
    exit_with_parent(parent_pid)
    if init is not None:
        init(*init_args)


def worker_pool(init: Callable[..., None] | None = None, *init_args: Any) -> concurrent.futures.ProcessPoolExecutor:
    """A one-process pool for the sidecar's background work; ``init(*init_args)`` runs in the
    worker once it is up (after its niceness and parent watch are set)."""
    return concurrent.futures.ProcessPoolExecutor(
        max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=_init,
        initargs=(os.getpid(), init, init_args))


def stop_pool(pool: concurrent.futures.ProcessPoolExecutor, kill: bool = False) -> None:
    """Shut ``pool`` down without waiting. ``kill``: also end its worker now (SIGKILL): one that
    timed out may be stuck in its call for good, and ``shutdown`` alone would leave it running
    (a core spent, its memory held) beside the worker that replaces it."""
    procs = list((getattr(pool, "_processes", None) or {}).values())  # before shutdown clears it
    pool.shutdown(wait=False, cancel_futures=True)
    if kill:
        for p in procs:
            try:
                if p.is_alive():
                    p.kill()
            except (OSError, ValueError):  # already gone, or closed
                pass
