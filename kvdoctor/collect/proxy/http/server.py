"""The proxy's client side: a lean HTTP/1.1 server on asyncio's protocol API and llhttp's C parser
(``httptools``), in place of aiohttp's web server, whose request objects, router, middleware hooks
and header serialisation cost ~0.2 ms a request on the relay's critical path (measured, see
docs/proxy.md).

    server = ProxyServer(handler, early)  # async def handler(request: Request, reply: Reply)
    port = await server.start("127.0.0.1", 0)
    ...
    await server.close(grace_s=2.0)

Per connection, one request is handled at a time; pipelined requests wait their turn (reading from
the client pauses meanwhile). ``early(request)`` (optional, synchronous) runs in the read callback
as soon as a request's whole body is in, before the handler's task starts (a relay sends the request
on there: a task start and a loop step less before the bytes leave); what it returns is
``request.early``. Only for a request served at once whose body is declared at most
``whole_body_max`` bytes; a larger or chunked body goes to the handler at its head, to stream.
Nothing is sent on before llhttp has parsed the whole request: what the upstream gets is what
the parser read, never a guess at it.
Request bodies are handed over as they arrive, with a high-water mark that pauses reading from the
client. A request head over :data:`MAX_HEAD_BYTES` or :data:`MAX_HEADERS` lines gets 431, one the
parser rejects 400, both with ``Connection: close``.
Response framing (:class:`~kvdoctor.collect.proxy.http.exchange.Reply`): the upstream's
``Content-Length`` when it sent one, else chunked to an HTTP/1.1 client, else (HTTP/1.0) the body
ends with the connection.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any, Awaitable, Callable

import httptools

from .exchange import PHRASES, Reply, Request
from .limits import MAX_HEAD_BYTES, MAX_HEADERS, chunked_only

log = logging.getLogger("kvdoctor.proxy")

#: a client connection with no request in progress is closed after this (aiohttp's server: 75 s)
KEEPALIVE_S = 75.0
#: pending connections the listening socket holds (the kernel caps it at net.core.somaxconn)
LISTEN_BACKLOG = 4096

Handler = Callable[[Request, Reply], Awaitable[None]]


class ClientConnection(asyncio.Protocol):
    """One client connection: parses requests, runs the handler for one at a time."""

    def __init__(self, server: "ProxyServer") -> None:
        self.server = server
        self.transport: Any = None
        self.parser = httptools.HttpRequestParser(self)
        self.lost = False
        self.write_paused = False
        self._drain: asyncio.Future[None] | None = None
        self._reading_paused = False
        self._req: Request | None = None  # being parsed
        self._queue: collections.deque[Request] = collections.deque()  # parsed heads, not yet handled
        self._task: asyncio.Task[None] | None = None
        self._bad = False
        #: when the connection last had nothing to do (ProxyServer._sweep closes it after KEEPALIVE_S)
        self.idle_since = time.monotonic()

    def _start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._serve())
        self.server._tasks.add(self._task)
        self._task.add_done_callback(self.server._tasks.discard)

    @property
    def idle(self) -> bool:
        return self._req is None and not self._queue

    # ---- asyncio.Protocol
    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.server._conns.add(self)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = True
        self.server._conns.discard(self)
        err = ConnectionResetError("client closed the connection")
        for r in ([self._req] if self._req is not None else []) + list(self._queue):
            r._wake(err)
        d, self._drain = self._drain, None
        if d is not None and not d.done():
            d.set_exception(err)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        d, self._drain = self._drain, None
        if d is not None and not d.done():
            d.set_result(None)

    async def drain(self) -> None:
        if self.lost:
            raise ConnectionResetError("client closed the connection")
        if self.write_paused:
            self._drain = asyncio.get_running_loop().create_future()
            await self._drain

    def pause_reading(self) -> None:
        if not self._reading_paused and not self.lost:
            self._reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_paused and not self.lost and len(self._queue) <= 1:
            self._reading_paused = False
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self._bad:
            return
        try:
            self.parser.feed_data(data)
        except _Refused as e:
            self._refuse(e.status, e.message)
        except httptools.HttpParserError as e:  # also an upgrade's HttpParserUpgrade
            cause = e.__context__ if isinstance(e.__context__, _Refused) else None
            if cause is not None:  # raised in a callback: llhttp reports it as its own error
                self._refuse(cause.status, cause.message)
            else:
                self._refuse(400, f"malformed request: {' '.join(str(e).split())[:120]}")

    def _refuse(self, status: int, message: str) -> None:
        """An answer the handler never sees: the head could not be read. Closes after it."""
        self._bad = True
        if self._task is None or self._task.done():
            body = b'{"error":{"message":"%s","type":"bad_request","code":%d}}' % (
                message.replace('"', "'").encode("ascii", "backslashreplace"), status)
            self.transport.write(b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                                 b"Connection: close\r\n\r\n%s" % (status, PHRASES[status], len(body), body))
        self.transport.close()

    # ---- httptools callbacks
    def on_message_begin(self) -> None:
        self._req = Request(self)

    def on_url(self, url: bytes) -> None:
        r = self._req
        r.target += url
        r._head_bytes += len(url)
        if r._head_bytes > MAX_HEAD_BYTES:
            raise _Refused(431, f"request line over {MAX_HEAD_BYTES >> 10} KiB")

    def on_header(self, name: bytes, value: bytes) -> None:
        r = self._req
        r._head_bytes += len(name) + len(value) + 4
        if r._head_bytes > MAX_HEAD_BYTES or len(r.headers) >= MAX_HEADERS:
            raise _Refused(431, f"request head over {MAX_HEAD_BYTES >> 10} KiB or {MAX_HEADERS} header lines")
        if r.head_s[1]:  # a trailer, after a chunked body: not one of the request's headers, never forwarded
            return
        r.headers.append((name, value))

    def on_headers_complete(self) -> None:
        r, p = self._req, self.parser
        r.head_s = (time.time(), time.perf_counter())
        r.method_raw = m = p.get_method()
        r.method = m.decode("ascii", "replace")
        r.version = p.get_http_version()
        r.keep_alive = p.should_keep_alive()
        if p.should_upgrade():
            raise _Refused(501, "protocol upgrades (and CONNECT) are not proxied")
        if not r.target.startswith(b"/"):  # absolute-form (http://host/path) or "*"
            u = httptools.parse_url(r.target) if r.target != b"*" else None
            if u is not None:
                r.target = (u.path or b"/") + (b"?" + u.query if u.query else b"")
        for k, v in r.headers:
            lk = k.lower()
            if lk == b"content-length":
                r.content_length = int(v)  # llhttp has validated it
            elif lk == b"transfer-encoding":
                if not chunked_only(v):
                    raise _Refused(501, "transfer codings other than chunked are not proxied")
                r.chunked = True
            elif lk == b"expect" and v.lower() == b"100-continue" and r.version == "1.1":
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self._queue.append(r)
        if self._task is None or self._task.done():
            srv = self.server
            if srv.early is not None and not r.chunked and (r.content_length or 0) <= srv.whole_body_max:
                r._deferred = True  # started once the body is in (on_message_complete)
            else:
                self._start()
        else:  # pipelined behind a request still being answered: take nothing more until then
            self.pause_reading()

    def on_body(self, body: bytes) -> None:
        self._req._feed(body)

    def on_message_complete(self) -> None:
        r = self._req
        r._finish()
        self._req = None
        if r._deferred:
            r._deferred = False
            try:
                r.early = self.server.early(r)  # type: ignore[misc]
            except Exception as e:  # noqa: BLE001 - the handler then does it all itself
                log.error("proxy: the early step failed for %s %s: %s: %s", r.method, r.path[:80],
                          type(e).__name__, e, exc_info=e)
            self._start()

    # ---- the requests, one at a time
    async def _serve(self) -> None:
        while self._queue:
            req = self._queue[0]
            if self.lost and req.early is None:
                break  # a request already sent on (early) is still answered: its record says cancelled
            reply = Reply(self, req)
            try:
                await self.server.handler(req, reply)
                if not req._done and not self.lost:
                    # answered before the whole body came: the connection is out of step
                    reply.abort()
            except ConnectionError:
                reply.abort()
            except asyncio.CancelledError:  # shutdown
                reply.abort()
                raise
            except Exception as e:  # noqa: BLE001 - one request's failure is not the server's
                log.error("proxy: unexpected error answering %s %s: %s: %s", req.method, req.path[:80],
                          type(e).__name__, e, exc_info=e)
                if not reply.started and not self.lost:
                    reply._close = True
                    reply.respond(500, b"", [(b"Content-Type", b"application/json")],
                                  b'{"error":{"message":"kvdoctor proxy internal error","code":500}}')
                else:
                    reply.abort()
            self._queue.popleft()
            if not req.keep_alive or reply._close or not reply.ended or self.server.closing:
                if self.transport is not None:
                    self.transport.close()
                return
            self.resume_reading()
        self.idle_since = time.monotonic()


class _Refused(Exception):
    """A request head the server will not pass on: answered ``status`` with ``message``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class ProxyServer:
    """Listens and serves ``handler`` (``async (Request, Reply) -> None``) on every connection."""

    def __init__(self, handler: Handler, early: Callable[[Request], Any] | None = None,
                 whole_body_max: int = 0) -> None:
        self.handler = handler
        self.early = early
        self.whole_body_max = whole_body_max
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[ClientConnection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.port: int | None = None
        #: set by close(): a connection is closed after its answer in progress
        self.closing = False
        self._sweeper: asyncio.TimerHandle | None = None
        #: what serves the requests, for its owner to reach (the proxy: stats, in-flight requests)
        self.proxy: Any = None
        #: called once at close, after the connections (the proxy closes its upstream pool here)
        self.on_close: list[Callable[[], None]] = []

    @property
    def busy(self) -> bool:
        """A request is being answered (or waits its turn) on some connection."""
        return bool(self._tasks)

    async def start(self, host: str = "127.0.0.1", port: int = 0, reuse_port: bool = False) -> int:
        """Listen on ``host:port`` (0: any free port); return the bound port. OSError if taken.
        ``reuse_port``: with ``SO_REUSEPORT``, so relay processes of the same user can listen on
        the same address and the kernel spreads connections over them."""
        loop = asyncio.get_running_loop()
        # a backlog for a burst of streams connecting at once (asyncio's default, 100, drops the
        # SYNs past it: each such client waits a second for its retry)
        self._server = await loop.create_server(lambda: ClientConnection(self), host, port, reuse_address=True,
                                                reuse_port=reuse_port, backlog=LISTEN_BACKLOG)
        self.port = int(self._server.sockets[0].getsockname()[1])
        self._sweeper = loop.call_later(KEEPALIVE_S / 5, self._sweep)
        return self.port

    def _sweep(self) -> None:
        """Close connections idle past KEEPALIVE_S (a timer per request would cost the hot path)."""
        cutoff = time.monotonic() - KEEPALIVE_S
        for c in list(self._conns):
            if c.idle and c.idle_since < cutoff and c.transport is not None:
                c.transport.close()
        self._sweeper = asyncio.get_running_loop().call_later(KEEPALIVE_S / 5, self._sweep)

    async def close(self, grace_s: float = 2.0) -> None:
        """Stop listening, give answers in progress ``grace_s``, then cut what is left."""
        self.closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        for c in list(self._conns):  # idle keep-alive connections: nothing to wait for
            if c._task is None or c._task.done():
                c.transport.close()
        if self._tasks:
            _, pending = await asyncio.wait(list(self._tasks), timeout=grace_s)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
        for c in list(self._conns):
            c.transport.close()
        if self._server is not None:
            await self._server.wait_closed()
        for f in self.on_close:
            f()
