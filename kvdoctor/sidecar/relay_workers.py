"""More relay processes on the proxy's port (``kvdoctor attach --workers N``): one process's event
loop, GIL-bound, relays ~16-60k SSE events/s on a core (benchmarks/bench_relay_scale.py); an H200
serving 1,024 streams sends ~100k.

The agent's own relay binds the proxy address with ``SO_REUSEPORT`` and so do ``N - 1`` relay
processes (:func:`_relay_main`, spawned: no copy of the agent's threads or sockets); the kernel
spreads new client connections over the listening sockets. Each process relays and builds its
records itself; the records come to the agent over a pipe in batches (every 50 ms, or 64 records),
where they go the way of its own: into the one capture writer (so the capture is written by one
writer, in arrival order), the live diagnosis and /metrics. Each process also sends the requests it
has in flight once a second (the live window counts them) and its counters, and says when the
upstream goes away or comes back (``source_status``).

A relay process that dies is started again (its streams in flight are cut, as they would be if
the whole sidecar died; the capture records what was relayed). At close each stops listening,
gives its streams in flight the grace the agent's own get, and sends what it recorded last.
Only the same user can join a ``SO_REUSEPORT`` group (Linux), and the address is the agent's.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import pickle
import socket
import struct
import time
from typing import Any, Callable

from ..model import RequestRecord

log = logging.getLogger("kvdoctor.attach")

#: records are sent in batches: when this many are waiting, or this long after the first
BATCH_RECORDS = 64
BATCH_S = 0.05
#: how often a relay process sends the requests it has in flight (the live step reads them)
STATE_S = 1.0
#: how long a relay process may take to listen (a spawned interpreter importing the proxy)
START_TIMEOUT_S = 60.0


# ---------------------------------------------------------------------------------- the process

class _PipeSink:
    """A relay process's sink: records batched to the agent, source changes at once."""

    def __init__(self, conn: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.conn, self.loop = conn, loop
        self.batch: list[Any] = []
        self.timer: asyncio.TimerHandle | None = None

    def emit(self, record: Any) -> None:
        self.batch.append(record)
        if len(self.batch) >= BATCH_RECORDS:
            self.flush()
        elif self.timer is None:
            self.timer = self.loop.call_later(BATCH_S, self.flush)

    def flush(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        batch, self.batch = self.batch, []
        if batch:
            self.conn.send(("records", batch))

    def source_status(self, name: str, ok: bool, detail: str = "") -> None:
        self.conn.send(("status", name, ok, detail))


async def _serve(conn: Any, upstream: str, host: str, port: int, store_text: bool, grace_s: float) -> None:
    from ..collect.proxy import make_proxy
    from ..idle_gc import IdleCollector

    loop = asyncio.get_running_loop()
    sink = _PipeSink(conn, loop)
    server = make_proxy(upstream, sink, store_text=store_text)
    relay = server.proxy
    await server.start(host, port, reuse_port=True)
    gc_ = IdleCollector(busy=lambda: server.busy)
    gc_.start(loop)
    stop = asyncio.Event()
    # the agent writes one message only, "stop"; EOF (the agent gone) stops too
    loop.add_reader(conn.fileno(), stop.set)
    conn.send(("ready", os.getpid()))

    def state() -> None:
        conn.send(("state", [(k, an.arrival_s, an.first_seen_s()) for k, an in list(relay.in_flight.items())],
                   dict(relay.stats)))
        handle[0] = loop.call_later(STATE_S, state)

    handle = [loop.call_later(STATE_S, state)]
    await stop.wait()
    loop.remove_reader(conn.fileno())
    handle[0].cancel()
    await server.close(grace_s)
    gc_.close()
    sink.flush()
    conn.send(("state", [], dict(relay.stats)))
    conn.send(("done",))


def _relay_main(conn: Any, parent_pid: int, upstream: str, host: str, port: int, store_text: bool,
                grace_s: float) -> None:
    """A relay process: the proxy on ``host:port`` beside the agent's (``SO_REUSEPORT``), records to ``conn``."""
    import gc
    import signal

    from ..workers import exit_with_parent

    exit_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the agent says when to stop
    gc.collect()
    gc.freeze()
    try:
        import uvloop

        run: Callable[[Any], Any] = uvloop.run
    except ImportError:
        run = asyncio.run
    try:
        run(_serve(conn, upstream, host, port, store_text, grace_s))
    except Exception as e:  # noqa: BLE001 - told to the agent, which logs it
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except OSError:
            pass


# ---------------------------------------------------------------------------------- the agent's side

class _Worker:
    def __init__(self, index: int) -> None:
        self.index = index
        self.process: Any = None
        self.conn: Any = None
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.task: asyncio.Task | None = None
        self.ready: asyncio.Future | None = None
        self.done: asyncio.Future | None = None
        self.in_flight: list[tuple[int, float, float | None]] = []
        self.stats: dict[str, int] = {}


class RelayWorkers:
    """``n`` relay processes on ``host:port`` (which the agent's own relay holds with ``SO_REUSEPORT``).
    ``emit(record)`` and ``source_status(name, ok, detail)``: the agent's sink, called on its loop."""

    def __init__(self, n: int, upstream: str, host: str, port: int, store_text: bool, sink: Any,
                 server_label: str, grace_s: float = 2.0) -> None:
        self.n, self.upstream, self.host, self.port = n, upstream, host, port
        self.store_text, self.sink, self.server_label, self.grace_s = store_text, sink, server_label, grace_s
        self.workers = [_Worker(i + 1) for i in range(n)]
        self.closing = False
        self.restarts = 0
        self._ctx = multiprocessing.get_context("spawn")

    async def start(self) -> None:
        await asyncio.gather(*(self._spawn(w) for w in self.workers))

    async def _spawn(self, w: _Worker) -> None:
        loop = asyncio.get_running_loop()
        ours, theirs = self._ctx.Pipe()
        w.process = self._ctx.Process(
            target=_relay_main, name=f"kvdoctor-relay-{w.index}", daemon=True,
            args=(theirs, os.getpid(), self.upstream, self.host, self.port, self.store_text, self.grace_s))
        w.process.start()
        theirs.close()
        w.conn = ours
        # the agent reads the pipe on its loop: multiprocessing's framing (a 4-byte length, pickle)
        w.reader, w.writer = await asyncio.open_connection(sock=socket.socket(fileno=os.dup(ours.fileno())))
        w.ready, w.done = loop.create_future(), loop.create_future()
        w.task = loop.create_task(self._read(w))
        try:
            await asyncio.wait_for(asyncio.shield(w.ready), START_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise RuntimeError(f"relay process {w.index} did not listen within {START_TIMEOUT_S:.0f} s") from None

    async def _recv(self, w: _Worker) -> Any:
        assert w.reader is not None
        size, = struct.unpack("!i", await w.reader.readexactly(4))
        if size == -1:
            size, = struct.unpack("!Q", await w.reader.readexactly(8))
        return pickle.loads(await w.reader.readexactly(size))

    async def _read(self, w: _Worker) -> None:
        why = "its pipe closed"
        try:
            while True:
                msg = await self._recv(w)
                kind = msg[0]
                if kind == "records":
                    for r in msg[1]:
                        self.sink.emit(r)
                elif kind == "state":
                    w.in_flight, w.stats = msg[1], msg[2]
                elif kind == "status":
                    self.sink.source_status(*msg[1:])
                elif kind == "ready":
                    w.ready.set_result(msg[1])
                elif kind == "done":
                    w.done.set_result(None)
                    return
                elif kind == "error":
                    why = msg[1]
        except (asyncio.IncompleteReadError, ConnectionError, OSError, EOFError, pickle.UnpicklingError) as e:
            why = why if isinstance(e, asyncio.IncompleteReadError) else f"{type(e).__name__}: {e}"
        finally:
            w.in_flight = []
            if w.writer is not None:
                w.writer.close()
        if not w.ready.done():
            w.ready.set_exception(RuntimeError(f"relay process {w.index} failed to start: {why}"))
            return
        if not self.closing:
            self.restarts += 1
            log.warning("relay process %d stopped (%s); starting another", w.index, why)
            try:
                await self._spawn(w)
            except Exception as e:  # noqa: BLE001 - the agent's own relay and the others go on
                log.error("relay process %d could not be started again: %s", w.index, e)

    def in_flight_records(self) -> list[RequestRecord]:
        """The relay processes' requests in flight as of their last report (at most STATE_S old)."""
        return [RequestRecord(request_id=f"in-flight-{w.index}-{k:x}", arrival_s=arrival, first_token_s=first,
                              ttft_s=(first - arrival) if first is not None else None,
                              status="in-flight", server=self.server_label)
                for w in self.workers for k, arrival, first in w.in_flight]

    @property
    def stats(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for w in self.workers:
            for k, v in w.stats.items():
                out[k] = out.get(k, 0) + v
        return out

    async def close(self) -> None:
        """Stop every relay process: its streams get ``grace_s``, its last records come in."""
        self.closing = True
        for w in self.workers:
            try:
                w.conn.send(("stop",))
            except (OSError, AttributeError):
                pass
        deadline = time.monotonic() + self.grace_s + 5.0
        for w in self.workers:
            if w.done is not None and not w.done.done():
                try:
                    await asyncio.wait_for(asyncio.shield(w.done), max(0.1, deadline - time.monotonic()))
                except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - it is ended below either way
                    pass
            if w.task is not None and not w.task.done():
                w.task.cancel()
            if w.process is not None:
                w.process.join(max(0.1, deadline - time.monotonic()))
                if w.process.is_alive():
                    w.process.kill()
                    w.process.join(1.0)
            if w.conn is not None:
                w.conn.close()


class Relays:
    """What the live diagnosis reads as ``proxy``: the agent's own relay and the relay processes."""

    def __init__(self, own: Any, workers: RelayWorkers) -> None:
        self.own, self.workers = own, workers

    def in_flight_records(self) -> list[RequestRecord]:
        return self.own.in_flight_records() + self.workers.in_flight_records()

    @property
    def stats(self) -> dict[str, int]:
        out = dict(self.own.stats)
        for k, v in self.workers.stats.items():
            out[k] = out.get(k, 0) + v
        return out
