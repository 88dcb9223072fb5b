"""Garbage collection between the requests a process relays, not inside them.

CPython collects when allocations pass a threshold, that is in the middle of whatever allocates:
in ``kvdoctor attach --proxy``, a relayed request. Measured in the sidecar on this project's 2-core
host (bench_proxy part B, gc callbacks): a young collection ~0.1 ms every ~20 requests, a middle
one ~1.3 ms (up to 3.8) every ~200, each on a stream's TTFT; the middle ones alone land on about
one request in a hundred, which is exactly the P99.

:class:`IdleCollector` turns the automatic collector off and runs the same collections from a loop
timer, when nothing is in flight (``busy()`` false). Under unbroken traffic it collects anyway
once allocations run ``force_factor`` times past the threshold (a full collection waits for a
gap until ``force_factor`` times its own threshold too), so memory stays bounded as before.

    gc_ = IdleCollector(busy=lambda: server.busy)
    gc_.start(loop)
    ...
    gc_.close()  # the automatic collector back on
"""
from __future__ import annotations

import asyncio
import gc
from typing import Callable

#: how often the timer looks: bench_attach --traffic measured the sidecar at 1.38% of a core with
#: it, 0.82% without (the wake-ups and the same collections moved); the target is <= 2%
TICK_S = 0.02
#: past this many times the young threshold, collect even while busy
FORCE_FACTOR = 8


class IdleCollector:
    """Runs CPython's generational collections when ``busy()`` says nothing is in flight."""

    def __init__(self, busy: Callable[[], bool], tick_s: float = TICK_S, force_factor: int = FORCE_FACTOR) -> None:
        self.busy = busy
        self.tick_s = tick_s
        self.force_factor = force_factor
        #: collections run, per generation (and how many of them while busy)
        self.collections = [0, 0, 0]
        self.forced = 0
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._was_enabled = False

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._was_enabled = gc.isenabled()
        gc.disable()
        self._handle = loop.call_later(self.tick_s, self._tick)

    def _tick(self) -> None:
        try:
            self.collect_if_due()
        finally:
            if self._loop is not None:
                self._handle = self._loop.call_later(self.tick_s, self._tick)

    def collect_if_due(self) -> int | None:
        """The collection CPython would run now, if nothing is in flight (or allocations ran far
        past the threshold); the generation collected, or None."""
        c0, c1, c2 = gc.get_count()
        t0, t1, t2 = gc.get_threshold()
        if t0 <= 0 or c0 <= t0:
            return None
        if self.busy():
            if c0 <= t0 * self.force_factor:
                return None
            # a full collection waits for a gap, but not for ever: under unbroken traffic (long
            # streams, always some in flight) garbage cycles that reached the old generation
            # would otherwise never be freed
            gen = 2 if c2 > t2 * self.force_factor else 1 if c1 > t1 else 0
            self.forced += 1
        else:
            gen = 2 if c2 > t2 else 1 if c1 > t1 else 0
        gc.collect(gen)
        self.collections[gen] += 1
        return gen

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._loop = None
        if self._was_enabled:
            gc.enable()
