"""The proxy's upstream leg: a lean HTTP/1.1 client on asyncio's protocol API and llhttp's C
parser (httptools, uvicorn's), with a small keep-alive pool.

    client = UpstreamClient("http://127.0.0.1:8080")
    up = await client.send(b"POST", b"/v1/chat/completions", headers, body)  # head parsed
    while chunk := await up.read():  # body bytes as they arrive; b"" at the end
        ...
    client.finish(up, reuse=True)

Why not aiohttp's ClientSession (which this replaced): per request it builds a request and a
response object, timers, trace hooks and a writer task, ~0.3 ms of the ~0.6 ms the proxy added
at the median (benchmarks/bench_proxy.py part B). Here a request is one ``transport.write`` and
each body chunk goes from the protocol callback to the relay's waiting ``read``.

One exchange at a time per connection, no pipelining. A response head is bounded
(:mod:`.limits`): past either bound it is :class:`Malformed`, like a bad status line or bad
chunking. A body is read with flow control: past ``HIGH_WATER_BYTES`` not yet taken by the relay
(a slow client), reading from the upstream pauses.
"""
from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
import time
from typing import Any, NoReturn

import httptools
from yarl import URL

from .response import BrokeMidBody, ClosedEarly, Unrelayable, Malformed, Response, Unreachable, UpstreamError

#: an idle pooled connection older than this is not used (below the common 5 s server
#: keep-alive of llama.cpp/cpp-httplib and uvicorn: the server would be about to close it)
KEEPALIVE_S = 4.0
#: resolved addresses of a named upstream are kept this long (aiohttp's default too)
DNS_TTL_S = 300.0
CONNECT_TIMEOUT_S = 10.0


class UpstreamConnection(asyncio.Protocol):
    __slots__ = ("loop", "transport", "parser", "response", "lost", "reusable", "used", "idle_since",
                 "_drain", "_write_paused")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser: Any = None
        self.response: Response | None = None
        self.lost = False
        self.reusable = True
        #: it carried an exchange before (a pooled one the server may have closed meanwhile)
        self.used = False
        self.idle_since = 0.0
        self._drain: asyncio.Future[None] | None = None
        self._write_paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        r = self.response
        if r is None or r.complete:  # bytes nobody asked for: the connection is not in a known state
            self.reusable = False
            if self.transport is not None:
                self.transport.close()
            return
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade, Unrelayable) as e:
            r.end_read()  # what was parsed before the fault goes on first, as it came
            # HttpParserUpgrade: 101 Switching Protocols, not relayed; raised in a callback, our own
            # refusal reaches us as llhttp's callback error, with ours as its context
            self._broken(e.__context__ if isinstance(e.__context__, Unrelayable) else e)
            return
        r.end_read()

    def _broken(self, e: BaseException) -> None:
        self.reusable = False
        r = self.response
        if r is not None:
            text = " ".join(str(e).split())[:160] or type(e).__name__
            if r._head.done():
                r._fail(BrokeMidBody(f"{type(e).__name__}: {text}"))
            else:
                r._fail(Malformed(f"{type(e).__name__}: {text}"))
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = True
        self.reusable = False
        self._wake_writer(exc or ConnectionResetError("upstream closed the connection"))
        r = self.response
        if r is None or r.complete:
            return
        if not r._head.done():
            r._fail(ClosedEarly(f"connection closed before a response ({type(exc).__name__ if exc else 'EOF'})"))
        elif not r._delimited and exc is None:  # a body that ends where the connection does
            r.complete = True
            r._wake()
        else:
            r._fail(BrokeMidBody(f"connection closed mid-body ({type(exc).__name__ if exc else 'EOF'})"))

    # write flow control (a streamed request body)
    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_writer(None)

    def _wake_writer(self, exc: BaseException | None) -> None:
        d, self._drain = self._drain, None
        if d is not None and not d.done():
            if exc is None:
                d.set_result(None)
            else:
                d.set_exception(exc)

    async def drain(self) -> None:
        if self.lost:
            raise ConnectionResetError("upstream closed the connection")
        if self._write_paused:
            self._drain = self.loop.create_future()
            await self._drain

    def pause(self) -> None:
        if self.transport is not None and not self.lost:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.lost:
            self.transport.resume_reading()


class _SourceFailed(Exception):
    """Reading a streamed request body failed; its cause is re-raised to the caller as is."""


class UpstreamClient:
    """Connections to one upstream (``http(s)://host[:port]``), pooled while idle < KEEPALIVE_S."""

    def __init__(self, base_url: str) -> None:
        u = URL(base_url)
        if u.scheme not in ("http", "https") or not u.host:
            raise ValueError(f"upstream must be an http(s) URL, got {base_url!r}")
        self.host: str = u.raw_host or u.host  # IDNA-encoded: what DNS and TLS want
        self.port: int = u.port or (443 if u.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if u.scheme == "https" else None
        default = self.port == (443 if u.scheme == "https" else 80)
        host = f"[{u.raw_host}]" if ":" in (u.raw_host or "") else u.raw_host  # raw: IDNA-encoded, ASCII
        self.host_header = (host if default else f"{host}:{self.port}").encode("ascii")
        try:
            ipaddress.ip_address(u.host)
            self._literal = True
        except ValueError:
            self._literal = False
        self._addrs: list[tuple[Any, ...]] = []
        self._addrs_at = 0.0
        self._idle: list[UpstreamConnection] = []
        self._closed = False

    async def _resolve(self, loop: asyncio.AbstractEventLoop) -> list[tuple[Any, ...]]:
        now = time.monotonic()
        if not self._addrs or now - self._addrs_at > DNS_TTL_S:
            infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            self._addrs = [(fam, addr) for fam, _, _, _, addr in infos]
            self._addrs_at = now
        return self._addrs

    async def _connect(self) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(self._open(loop), CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError, ssl.SSLError) as e:
            raise Unreachable(f"cannot connect to {self.host}:{self.port}: {type(e).__name__}: {e}") from None

    async def _open(self, loop: asyncio.AbstractEventLoop) -> UpstreamConnection:
        if self._literal:
            _, conn = await loop.create_connection(lambda: UpstreamConnection(loop), self.host, self.port, ssl=self.ssl)
            return conn  # type: ignore[return-value]
        last: BaseException | None = None
        for _fam, addr in await self._resolve(loop):
            try:
                _, conn = await loop.create_connection(lambda: UpstreamConnection(loop), addr[0], addr[1], ssl=self.ssl,
                                                       server_hostname=self.host if self.ssl else None)
                return conn  # type: ignore[return-value]
            except OSError as e:
                last = e
        raise last or OSError(f"no address for {self.host}")

    def _pooled(self) -> UpstreamConnection | None:
        now = time.monotonic()
        while self._idle:
            c = self._idle.pop()
            if not c.lost and now - c.idle_since < KEEPALIVE_S and c.transport is not None \
                    and not c.transport.is_closing():
                return c
            if c.transport is not None:
                c.transport.close()
        return None

    def begin(self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> Response | None:
        """The relay's hot path: write a request with its whole ``body`` now, on a pooled connection,
        before anything else is done for it; None when no connection is idle (then :meth:`send`).
        Its head: ``await client.head(r)``."""
        conn = self._pooled()
        return None if conn is None else self._write(conn, method, target, headers, body, None, None)

    async def send(self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]],
                   body: bytes | None = None, stream: Any = None, stream_length: int | None = None,
                   fresh: bool = False) -> Response:
        """Send one request; return once its response head is parsed. ``body``: the whole body;
        ``stream``: anything with ``iter_any()`` (the proxy's :class:`~kvdoctor.collect.proxy.http.exchange.Request`)
        to forward as it arrives (``stream_length`` its declared length, else chunked); an error
        reading it reaches the caller as raised. ``fresh``: never a pooled connection. Raises
        :class:`UpstreamError` subclasses."""
        conn = None if fresh else self._pooled()
        if conn is None:
            conn = await self._connect()
        r = self._write(conn, method, target, headers, body, stream, stream_length)
        if stream is not None:
            try:
                await self._send_stream(conn, stream, stream_length is None)
            except _SourceFailed as e:
                conn.transport.close()  # type: ignore[union-attr]
                raise e.__cause__ from None  # type: ignore[misc]
            except BaseException as e:
                self._head_failed(r, e)
        return await self.head(r)

    def _write(self, conn: UpstreamConnection, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]],
               body: bytes | None, stream: Any, stream_length: int | None) -> Response:
        """Start the exchange on ``conn``: the head (and ``body``) written at once, then the
        response's object and parser made (nothing can arrive before this returns to the loop,
        and the bytes leave ~10 us sooner, measured cold)."""
        head = [method, b" ", target, b" HTTP/1.1\r\nHost: ", self.host_header, b"\r\n"]
        for k, v in headers:
            head += (k, b": ", v, b"\r\n")
        if stream is not None:
            head.append(b"Content-Length: %d\r\n\r\n" % stream_length if stream_length is not None
                        else b"Transfer-Encoding: chunked\r\n\r\n")
        elif body or method in (b"POST", b"PUT", b"PATCH"):
            head.append(b"Content-Length: %d\r\n\r\n" % len(body or b""))
        else:
            head.append(b"\r\n")
        assert conn.transport is not None
        failed: BaseException | None = None
        try:
            if body:
                conn.transport.writelines((b"".join(head), body))
            else:
                conn.transport.write(b"".join(head))
        except (ConnectionError, OSError) as e:
            failed = e
        return self._exchange(conn, failed, method == b"HEAD")

    def _exchange(self, conn: UpstreamConnection, failed: BaseException | None, head_only: bool) -> Response:
        """The response object and its parser for a request just written on ``conn``."""
        r = Response(conn, head_only=head_only)
        conn.parser = httptools.HttpResponseParser(r)
        conn.response = r
        r.pooled, conn.used = conn.used, True
        if failed is not None:
            conn.transport.close()
            r._fail(ClosedEarly(f"connection lost while sending: {type(failed).__name__}"))
        return r

    async def head(self, r: Response) -> Response:
        """Wait for the response head of a request written by :meth:`begin` or :meth:`send`."""
        try:
            await r._head
        except BaseException as e:
            self._head_failed(r, e)
        return r

    def _head_failed(self, r: Response, e: BaseException) -> NoReturn:
        """The exchange failed before its head: close the connection, raise what the caller expects."""
        r._conn.transport.close()  # type: ignore[union-attr]
        if isinstance(e, ClosedEarly):
            raise ClosedEarly(str(e) + (" (a pooled connection)" if r.pooled else "")) from None
        if isinstance(e, UpstreamError):
            raise e
        if isinstance(e, (ConnectionError, OSError)):
            raise ClosedEarly(f"connection lost while sending: {type(e).__name__}") from None
        raise e

    async def _send_stream(self, conn: UpstreamConnection, stream: Any, chunked: bool) -> None:
        assert conn.transport is not None
        chunks = stream.iter_any()
        while True:
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                break
            except Exception as e:  # the body's source failed (the client left): not the upstream's doing
                raise _SourceFailed() from e
            if conn.lost:
                break
            conn.transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
            await conn.drain()
        if chunked and not conn.lost:
            conn.transport.write(b"0\r\n\r\n")

    def finish(self, r: Response, reuse: bool) -> None:
        """Done with ``r``: its connection goes back to the pool when ``reuse``, the body was read
        to its end and the server allows keep-alive; else it is closed (the server sees the
        client go away)."""
        conn = r._conn
        conn.response = None
        keep = (reuse and r.complete and conn.reusable and not conn.lost and not self._closed
                and r.keep_alive)
        conn.parser = None
        if keep:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        elif conn.transport is not None:
            conn.transport.close()

    def close(self) -> None:
        self._closed = True
        for c in self._idle:
            if c.transport is not None:
                c.transport.close()
        self._idle.clear()
