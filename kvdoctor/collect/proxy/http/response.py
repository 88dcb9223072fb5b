"""One upstream response as :class:`~kvdoctor.collect.proxy.http.client.UpstreamClient` parses it:
the httptools parser's callbacks fill it (status, headers within bounds, body chunks), the relay
takes the body with :meth:`Response.read`; and the errors an exchange can end in."""
from __future__ import annotations

import asyncio
import collections
from typing import Any, AsyncIterator, Protocol

from .limits import HIGH_WATER_BYTES, MAX_HEAD_BYTES, MAX_HEADERS, chunked_only


class Connection(Protocol):
    """What a response needs of the upstream connection it arrives on
    (:class:`~kvdoctor.collect.proxy.http.client.UpstreamConnection`)."""

    loop: asyncio.AbstractEventLoop
    transport: Any
    parser: Any
    reusable: bool

    def pause(self) -> None: ...

    def resume(self) -> None: ...


class UpstreamError(Exception):
    """The upstream exchange failed; subclasses say how."""


class Unreachable(UpstreamError):
    """No connection could be made (refused, unresolvable, timed out)."""


class ClosedEarly(UpstreamError):
    """The connection closed before a whole response head arrived."""


class Malformed(UpstreamError):
    """What came back is not an HTTP/1.x response within the bounds above."""


class BrokeMidBody(UpstreamError):
    """The response head arrived, then the body broke (closed early, bad chunking)."""


class Unrelayable(Exception):
    """A response head the relay will not pass on: past MAX_HEAD_BYTES or MAX_HEADERS, or framed
    by a transfer coding other than chunked (raised inside the parser; the exchange then ends as
    :class:`Malformed`)."""



class Response:
    """One response: ``status``, ``reason`` and ``headers`` (``(name, value)`` pairs; both bytes as
    received), ``content_type`` once :meth:`UpstreamClient.send` returned; the body through
    :meth:`read`."""

    __slots__ = ("status", "reason", "headers", "complete", "_chunks", "_buffered", "_exc", "_waiter",
                 "_conn", "_head", "_head_bytes", "_reason_parts", "_head_only",
                 "_delimited", "_paused", "keep_alive", "content_type", "pooled", "eager", "_read")

    def __init__(self, conn: Connection, head_only: bool) -> None:
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.content_type = ""
        #: the whole body arrived (a connection may then be reused)
        self.complete = False
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._conn = conn
        #: resolved once the head is parsed (or the exchange failed before)
        self._head: asyncio.Future[None] = conn.loop.create_future()
        self._head_bytes = 0
        self._reason_parts: list[bytes] = []
        self._head_only = head_only
        #: the body's end is marked (Content-Length or chunked), not the connection's close
        self._delimited = False
        self._paused = False
        #: the server allows another request on this connection (read at the head: llhttp
        #: resets the flag once the message is complete)
        self.keep_alive = False
        #: sent on a connection that carried an exchange before (which the server may have closed)
        self.pooled = False
        #: the relay's hook, if any: ``head(self)`` from the parser once the final head is in, and
        #: ``body(self, chunks)`` once per read with the body chunks parsed from it while nothing is
        #: queued and ``eager.on`` (True: it took them) (:class:`~kvdoctor.collect.proxy.eager.EagerRelay`)
        self.eager: Any = None
        #: the body chunks of the read being parsed, for the hook (:meth:`end_read`)
        self._read: list[bytes] = []

    async def read(self) -> bytes:
        """The body bytes arrived since the last call, joined (waits for some); ``b""`` at its
        end. Raises :class:`BrokeMidBody` if it broke."""
        while not self._chunks:
            if self._exc is not None:
                raise self._exc
            if self.complete:
                return b""
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        if self._paused:
            self._paused = False
            self._conn.resume()
        return data

    async def iter_any(self) -> AsyncIterator[bytes]:
        while True:
            data = await self.read()
            if not data:
                return
            yield data

    def abandon(self) -> None:
        """The request was sent, but its client's request turned out unanswerable: close the
        connection (the upstream sees the client go away), never reuse it."""
        self._conn.reusable = False
        if self._conn.transport is not None:
            self._conn.transport.close()

    # -- from the protocol --------------------------------------------------------------------
    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self._exc is None and not self.complete:
            self._exc = exc
        if not self._head.done():
            self._head.set_exception(exc)
            self._head.exception()  # retrieved here: a caller that left must not log it
        self._wake()

    # httptools callbacks (called by UpstreamConnection.data_received through the parser)
    def on_message_begin(self) -> None:
        if self.complete:  # bytes after the whole response (a 204's "body"): never a new head over this one
            raise Unrelayable("bytes after the end of the response")
        self.headers.clear()
        self._reason_parts.clear()

    def on_status(self, part: bytes) -> None:
        self._reason_parts.append(part)
        self._count(len(part))

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self.headers) >= MAX_HEADERS:
            raise Unrelayable(f"more than {MAX_HEADERS} header lines")
        self._count(len(name) + len(value) + 4)
        self.headers.append((name, value))

    def _count(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > MAX_HEAD_BYTES:
            raise Unrelayable(f"response head over {MAX_HEAD_BYTES} bytes")

    def on_headers_complete(self) -> None:
        parser = self._conn.parser
        status = parser.get_status_code()
        if 100 <= status < 200 and status != 101:  # an interim answer (103 Early Hints): the final one follows
            self._head_bytes = 0
            return
        self.status = status
        self.reason = b"".join(self._reason_parts)
        self._delimited = status in (204, 304)
        for k, v in self.headers:
            lk = k.lower()
            if lk == b"transfer-encoding" and not chunked_only(v):
                raise Unrelayable(f"Transfer-Encoding {v[:40]!r}: only chunked is relayed")
            if lk in (b"content-length", b"transfer-encoding"):
                self._delimited = True
            elif lk == b"content-type":
                self.content_type = v.decode("latin-1")
        self.keep_alive = parser.should_keep_alive()
        if not self._head.done():
            self._head.set_result(None)
        if self._head_only:  # HEAD: no body follows whatever the headers say
            self.complete = True
            self._conn.reusable = False
            self._wake()
        if self.eager is not None:
            self.eager.head(self)

    def end_read(self) -> None:
        """The read is parsed: hand its body chunks to the hook at once (one write and one stamp a
        read, however many chunks it held), or queue them for :meth:`read` in order if it declines."""
        chunks = self._read
        if chunks:
            self._read = []
            if not self.eager.body(self, chunks):
                for c in chunks:
                    self._queue(c)

    def on_body(self, body: bytes) -> None:
        if self._head_only:
            return
        eager = self.eager
        if eager is not None and eager.on and not self._chunks:
            self._read.append(body)  # handed over at the end of the read (end_read)
            return
        self._queue(body)

    def _queue(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER_BYTES and not self._paused:
            self._paused = True
            self._conn.pause()
        self._wake()

    def on_message_complete(self) -> None:
        if 100 <= self.status < 200 or not self._head.done():
            return  # the end of an interim response
        self.complete = True
        self._wake()
