"""One request to the proxy and its reply, as the proxy's server side
(:mod:`kvdoctor.collect.proxy.http.server`) hands them to the relay: the request's head as received
and its body as it arrives (:class:`Request`), the response written with HTTP/1.1 framing
(:class:`Reply`)."""
from __future__ import annotations

import asyncio
import collections
import http
from typing import Any, AsyncIterator

from .limits import HIGH_WATER_BYTES

_NO_BODY_STATUS = frozenset({204, 304})
#: the standard reason phrase per status (for an upstream reason left empty, and own answers)
PHRASES = {int(s): s.phrase.encode() for s in http.HTTPStatus}


class Request:
    """One request: ``method`` (str; ``method_raw`` the bytes as sent), ``target`` (raw bytes as
    sent), ``path`` (str, no query), ``headers`` (raw ``(name, value)`` bytes pairs as received),
    its body via :meth:`read` or :meth:`iter_any`."""

    __slots__ = ("method", "method_raw", "target", "_path", "headers", "version", "keep_alive", "content_length",
                 "chunked", "head_s", "early", "_conn", "_chunks", "_queued", "_done", "_waiter", "_head_bytes", "_deferred")

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self.method = ""
        self.method_raw = b""
        self.target = b""
        self._path: str | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.version = "1.1"
        self.keep_alive = True
        self.content_length: int | None = None
        self.chunked = False
        self._chunks: collections.deque[bytes] = collections.deque()
        self._queued = 0
        self._done = False
        self._waiter: asyncio.Future[None] | None = None
        self._head_bytes = 0
        #: when its head was complete: ``(time.time(), time.perf_counter())``
        self.head_s = (0.0, 0.0)
        #: what the server's ``early`` step returned for this request (None: it did not run)
        self.early: Any = None
        self._deferred = False

    @property
    def path(self) -> str:
        """The target's path, decoded, without the query (made when first asked: after the
        request was sent on)."""
        if self._path is None:
            t = self.target
            q = t.find(b"?")
            self._path = (t if q < 0 else t[:q]).decode("utf-8", "surrogateescape")
        return self._path

    def header(self, name: bytes) -> bytes | None:
        """The first header of that (lower-case) name, or None."""
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    # ---- fed by the connection
    def _feed(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._queued += len(chunk)
        if self._queued > HIGH_WATER_BYTES:
            self._conn.pause_reading()
        self._wake()

    def _finish(self) -> None:
        self._done = True
        self._wake()

    def _wake(self, exc: BaseException | None = None) -> None:
        w, self._waiter = self._waiter, None
        if w is not None and not w.done():
            if exc is not None:
                w.set_exception(exc)
            else:
                w.set_result(None)

    # ---- for the handler
    async def iter_any(self) -> AsyncIterator[bytes]:
        """The body's chunks as they arrive; ConnectionResetError if the client leaves mid-body."""
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                self._queued -= len(chunk)
                if self._queued <= HIGH_WATER_BYTES // 4:
                    self._conn.resume_reading()
                yield chunk
            elif self._done:
                return
            elif self._conn.lost:
                raise ConnectionResetError("client closed the connection during the request body")
            else:
                self._waiter = asyncio.get_running_loop().create_future()
                await self._waiter

    def body_if_complete(self) -> bytes | None:
        """The whole body, taken without a wait, when all of it has arrived (the common case: head
        and body in one read); else None (then :meth:`read`)."""
        if not self._done:
            return None
        data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._queued = 0
        self._conn.resume_reading()
        return data

    async def read(self) -> bytes:
        """The whole body (the caller bounds its size by ``content_length`` first)."""
        return b"".join([c async for c in self.iter_any()])


class Reply:
    """Writes one response to the client: :meth:`start` (status line and headers), :meth:`write`
    per body chunk, :meth:`end`. Writes raise ConnectionResetError once the client is gone."""

    __slots__ = ("_conn", "_req", "started", "_chunked", "_no_body", "_close", "ended")

    def __init__(self, conn: Any, req: Request) -> None:
        self._conn, self._req = conn, req
        self.started = self.ended = False
        self._chunked = self._no_body = False
        self._close = not req.keep_alive

    def start(self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        """Send the head. ``headers`` are end-to-end (no Connection or Transfer-Encoding);
        ``reason`` as received, the standard phrase when empty."""
        if self._conn.lost:
            raise ConnectionResetError("client closed the connection")
        self.started = True
        self._no_body = self._req.method == "HEAD" or status in _NO_BODY_STATUS or status < 200
        has_length = any(k.lower() == b"content-length" for k, _ in headers)
        if not self._no_body and not has_length:
            if self._req.version == "1.1":
                self._chunked = True
            else:
                self._close = True  # HTTP/1.0: the body ends with the connection
        out = [b"HTTP/1.1 %d %s\r\n" % (status, reason or PHRASES.get(status, b"-"))]
        for k, v in headers:
            out += (k, b": ", v, b"\r\n")
        if self._chunked:
            out.append(b"Transfer-Encoding: chunked\r\n")
        if self._close:
            out.append(b"Connection: close\r\n\r\n")
        else:  # an HTTP/1.0 client keeps the connection only when told so
            out.append(b"\r\n" if self._req.version == "1.1" else b"Connection: keep-alive\r\n\r\n")
        self._conn.transport.write(b"".join(out))

    @property
    def write_paused(self) -> bool:
        """The client's buffer is past its high-water mark: :meth:`write` would wait."""
        return self._conn.write_paused

    def write_now(self, chunk: bytes) -> None:
        """Write a body chunk without waiting for the client to read (the caller checks
        ``write_paused`` after it); ConnectionResetError, nothing written, once the client is gone."""
        conn = self._conn
        if conn.lost:
            raise ConnectionResetError("client closed the connection")
        if self._no_body or not chunk:
            return
        if self._chunked:
            if len(chunk) < 65536:  # one buffer: uvloop's write() is ~0.5 us cheaper than writelines() a chunk
                conn.transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            else:  # not copied
                conn.transport.writelines((b"%x\r\n" % len(chunk), chunk, b"\r\n"))
        else:
            conn.transport.write(chunk)

    async def write(self, chunk: bytes) -> None:
        """Write a body chunk; wait while the client's buffer is over its high-water mark."""
        self.write_now(chunk)
        if self._conn.write_paused:
            await self._conn.drain()

    async def end(self) -> None:
        conn = self._conn
        if conn.lost:
            raise ConnectionResetError("client closed the connection")
        self.ended = True
        if self._chunked:
            conn.transport.write(b"0\r\n\r\n")
        if self._close:
            conn.transport.close()

    def respond(self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """A whole small response at once (errors)."""
        self.start(status, reason, [*headers, (b"Content-Length", b"%d" % len(body))])
        if not self._no_body:
            self._conn.transport.write(body)
        self.ended = True
        if self._close:
            self._conn.transport.close()

    def abort(self) -> None:
        """Cut the connection: the client sees a broken response, not a clean end."""
        self._close = True
        if self._conn.transport is not None:
            self._conn.transport.close()
