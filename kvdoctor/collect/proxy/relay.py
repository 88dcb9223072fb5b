"""The relay: each request to the proxy goes upstream, each response back to its client, and
completion requests are annotated and recorded on the way (fail-open: analysis never stands in
the way of traffic). The retry of a request a stale pooled connection swallowed lives here too.

:func:`make_proxy` wires it to its HTTP server (:mod:`.http`); the per-chunk analysis is
:mod:`.sse`, the record built from it :mod:`.record`, and the response is written from the
upstream's read callbacks while nothing makes it wait (:mod:`.eager`).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import orjson
from yarl import URL

from ...model import RequestRecord
from .eager import EagerRelay
from .http import ClosedEarly, Malformed, ProxyServer, Reply, Request, Response, UpstreamClient, UpstreamError
from .record import ANALYSED_PATHS, build_record, client_request_id, traceparent_trace_id
from .sse import MAX_ANALYSED_BODY, StreamAnnotator

log = logging.getLogger("kvdoctor.proxy")

SOURCE_NAME = "proxy"

_HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"trailers", b"upgrade",
    b"proxy-connection", b"proxy-authenticate", b"proxy-authorization",
})
#: Connection tokens that are options, not header names (close, keep-alive and upgrade are dropped
#: as hop-by-hop headers anyway)
_CONNECTION_OPTIONS = frozenset({b"", b"close", b"keep-alive", b"upgrade"})
#: request headers not forwarded besides hop-by-hop ones: the upstream client writes Host and
#: the body's framing itself; the body was already read (no 100-continue)
_REQ_DROP = frozenset({b"host", b"content-length", b"expect"})

#: resend a request once on a new connection if a pooled one failed within this many seconds
RETRY_WITHIN_S = 1.0
#: return a connection to the pool only if its request took less than this (seconds)
REUSE_WITHIN_S = 4.0


def end_to_end(raw: Sequence[tuple[bytes, bytes]], drop: frozenset[bytes] = frozenset()
                ) -> list[tuple[bytes, bytes]]:
    """Headers as received (bytes) less the hop-by-hop ones (the fixed set, Proxy-*, those named
    in Connection) and ``drop``. One pass (it is on the relay's hot path, both legs)."""
    out = []
    named: set[bytes] | None = None
    for k, v in raw:
        lk = k.lower()
        if lk in _HOP_BY_HOP or lk in drop or lk.startswith(b"proxy-"):
            if lk == b"connection":
                names = {n.strip().lower() for n in v.split(b",")} - _CONNECTION_OPTIONS
                if names:
                    named = names if named is None else named | names
            continue
        out.append((k, v))
    if named:  # rare: headers the client marked hop-by-hop by naming them in Connection
        out = [(k, v) for k, v in out if k.lower() not in named]
    return out


def _log_once(seen: set[str], kind: str, exc: BaseException) -> None:
    key = f"{kind}:{type(exc).__name__}"
    if key in seen:
        return
    seen.add(key)
    log.warning("proxy analysis failed (%s), records for such requests are dropped; "
                "traffic is unaffected: %s: %s", kind, type(exc).__name__, exc, exc_info=exc)


def _text(v: bytes | None) -> str | None:
    return None if v is None else v.decode("latin-1")


def _one_line(e: BaseException) -> str:
    """An exception's text as one printable line (aiohttp's parser errors span several)."""
    return " ".join(str(e).split())[:200].encode("ascii", "backslashreplace").decode()


class Relay:
    """What serves a :class:`ProxyServer`'s requests (``server.proxy``): its ``stats``, the
    requests in flight, the upstream pool (``client``)."""

    def __init__(self, upstream_url: str, sink: Any, store_text: bool, block_chars: int,
                 server_label: str | None) -> None:
        if block_chars <= 0:
            raise ValueError("block_chars must be positive")
        self.base = upstream_url.rstrip("/")
        self.client = UpstreamClient(self.base)  # raises ValueError unless an http(s) URL
        u = URL(self.base)
        #: a path the upstream URL carries goes before every request's
        self.prefix = u.raw_path.rstrip("/").encode()
        self.sink = sink
        self.store_text = store_text
        self.block_chars = block_chars
        self.server_label = server_label if server_label is not None else f"{u.host}:{u.port}"
        self.upstream_ok: bool | None = None
        #: set once the upstream was seen dropping pooled connections (see handle)
        self.close_after_stream = False
        self._logged: set[str] = set()
        self.stats = {"requests": 0, "analysed": 0, "records": 0, "analysis_errors": 0,
                      "upstream_errors": 0, "retries": 0}
        #: analysed requests not answered yet: live diagnosis counts them (queued requests
        #: would otherwise be invisible until they finish, exactly when they matter)
        self.in_flight: dict[int, StreamAnnotator] = {}

    def in_flight_records(self) -> list[RequestRecord]:
        """A provisional record per request still in flight: arrival, first token if seen,
        status ``in-flight``. For the live window only; never written to the capture."""
        out = []
        for k, an in list(self.in_flight.items()):
            first = an.first_seen_s()  # reads kept since are analysed in their own time
            out.append(RequestRecord(request_id=f"in-flight-{k:x}", arrival_s=an.arrival_s, first_token_s=first,
                                     ttft_s=(first - an.arrival_s) if first is not None else None,
                                     status="in-flight", server=self.server_label))
        return out

    def _status(self, ok: bool, detail: str) -> None:
        if self.upstream_ok is ok:
            return
        self.upstream_ok = ok
        try:
            self.sink.source_status(SOURCE_NAME, ok, detail)
        except Exception as e:  # noqa: BLE001 - never let the sink break traffic
            _log_once(self._logged, "sink", e)

    def _fail(self, an: StreamAnnotator | None, where: str, e: BaseException) -> None:
        self.stats["analysis_errors"] += 1
        _log_once(self._logged, where, e)

    def _emit(self, an: StreamAnnotator, body: bytes) -> None:
        if an.failed is not None:  # the stream's analysis failed (after end(), which analyses the rest)
            self._fail(an, "feed", an.failed)
            return
        try:
            rec = build_record(an, body, self.block_chars, self.server_label, self.store_text)
        except Exception as e:  # noqa: BLE001
            self._fail(an, "record", e)
            return
        try:
            self.sink.emit(rec)
            self.stats["records"] += 1
        except Exception as e:  # noqa: BLE001
            _log_once(self._logged, "sink", e)

    def _abort(self, an: StreamAnnotator, body: bytes, status: str, note: str) -> None:
        """Record a request the relay cut short: the client left, or the upstream broke."""
        an.status, an.note = status, note
        try:
            an.end(an.now())
        except Exception as e:  # noqa: BLE001
            self._fail(an, "end", e)
            return
        self._emit(an, body)

    def early(self, request: Request) -> tuple[Any, ...]:
        """The server's early step (a request parsed whole, body included): send it on now, in the
        read callback, before the handler's task starts."""
        return self._forward(request, request.body_if_complete())

    def _forward(self, request: Request, body: bytes, send: bool = True) -> tuple[Any, ...]:
        """Write a request with its whole body upstream at once on an idle pooled connection (its
        bookkeeping follows while the upstream works on it); ``sent`` None: no connection was idle
        (or not ``send``: a streamed body, which :meth:`_handle` sends). ``out`` (method, target,
        headers) is what a retry sends."""
        out = (request.method_raw, self.prefix + request.target, end_to_end(request.headers, _REQ_DROP))
        sent = self.client.begin(*out, body) if send else None
        return body, out, sent, time.monotonic()

    async def handle(self, request: Request, reply: Reply) -> None:
        self.stats["requests"] += 1
        arrival, arrival_mono = request.head_s  # its arrival: the head, not the body's end
        stream: Request | None = None
        if request.early is not None:
            body, out, sent, t_send = request.early
            # taken: left on the request it closes a cycle (request -> its upstream response -> the
            # eager relay -> reply -> request) that only the cyclic collector frees, a stall on
            # the loop that grows with the requests it holds (idle_gc.py)
            request.early = None
        else:
            declared = request.content_length
            if (declared is not None and declared > MAX_ANALYSED_BODY) or (declared is None and request.chunked):
                # a body too large to analyse (or of unknown length) is streamed upstream as it
                # arrives, never held whole: the record keeps its timings, not its prompt stats
                stream = request
                body = b""
            else:  # a pipelined request (its turn came after its body), or the early step failed
                body = await request.read()
            body, out, sent, t_send = self._forward(request, body, send=stream is None)
        kind = ANALYSED_PATHS.get(request.path) if request.method == "POST" else None
        an: StreamAnnotator | None = None
        if kind is not None:
            try:
                an = StreamAnnotator(kind, arrival, self.store_text, arrival_mono)
                an.client_id = client_request_id(_text(request.header(b"x-request-id")))
                an.trace_id = traceparent_trace_id(_text(request.header(b"traceparent")))
                self.stats["analysed"] += 1
            except Exception as e:  # noqa: BLE001
                self._fail(None, "init", e)
                an = None
        if an is not None:
            self.in_flight[id(an)] = an
        try:
            await self._handle(request, reply, body, an, stream, out, sent, t_send)
        finally:
            if an is not None:
                self.in_flight.pop(id(an), None)

    async def _handle(self, request: Request, reply: Reply, body: bytes, an: StreamAnnotator | None,
                      stream: Request | None, out: tuple[bytes, bytes, list[tuple[bytes, bytes]]],
                      sent: Response | None, t_send: float) -> None:
        method, target, headers = out
        length = request.content_length if stream is not None else None  # the client's framing, else chunked
        # the response's head and chunks go to the client from the upstream's read callbacks while
        # they can (eager.py); the analysis state lives there, for this task to take over
        rs = EagerRelay(reply, an, request.method == "HEAD", end_to_end, self._fail)
        try:
            try:
                if sent is not None:
                    sent.eager = rs
                    up = await self.client.head(sent)
                else:
                    up = await self.client.send(method, target, headers, body, stream, length)
            except ConnectionError:  # only from a streamed body: the client left while sending it
                if an is not None:
                    self._abort(an, body, "cancelled", "client disconnected during the request body")
                raise
            except ClosedEarly:
                # A pooled keep-alive connection the server had already closed (llama.cpp
                # closes it after a response that outlived its 5 s keep-alive timer): the
                # request never got an answer; send it once more on a new connection. Only
                # when that happened at once, not after the server worked on it a while.
                if time.monotonic() - t_send > RETRY_WITHIN_S or stream is not None:  # a stream cannot be re-sent
                    raise
                self.stats["retries"] += 1
                # llama.cpp closes the connection after every streamed response: from now
                # on do not pool those, so the next request does not race the server's FIN
                self.close_after_stream = True
                up = await self.client.send(method, target, headers, body, fresh=True)
        except UpstreamError as e:
            # unreachable, or an answer that is not HTTP (bad status line, oversized or too many
            # headers, bad framing): the client gets a 502 JSON error, the capture an error record
            self.stats["upstream_errors"] += 1
            if isinstance(e, Malformed):
                detail = f"upstream_error: malformed response ({_one_line(e)})"[:300]
            else:
                detail = f"upstream unreachable: {type(e).__name__}: {e}"[:300]
            self._status(False, detail)
            if an is not None:
                try:
                    an.start(502, "application/json")
                    an.status, an.note = "error", detail
                    an.end(an.now())
                    self._emit(an, body)
                except Exception as e2:  # noqa: BLE001
                    self._fail(an, "record", e2)
            payload = {"error": {"message": detail, "type": "bad_gateway", "code": 502}}
            reply.respond(502, b"", [(b"Content-Type", b"application/json")], orjson.dumps(payload))
            return
        self._status(True, "upstream reachable")
        done = False
        try:
            done = await self._relay(request, reply, up, rs, body)
        finally:
            # keep the connection unless it is broken or the server is about to drop it
            # (cpp-httplib closes a keep-alive connection used longer than 5 s)
            self.client.finish(up, done and time.monotonic() - t_send < REUSE_WITHIN_S
                               and not (self.close_after_stream
                                        and up.content_type.startswith("text/event-stream")))

    async def _relay(self, request: Request, reply: Reply, up: Response, rs: EagerRelay, body: bytes) -> bool:
        """Stream the upstream response to the client (what the read callbacks did not already:
        ``rs``); True when its body was fully relayed."""
        if not rs.started:
            try:
                rs.start(up)
            except ConnectionError as e:
                # the client gave up while the request waited upstream (queued behind busy slots)
                if rs.an is not None:
                    self._abort(rs.an, body, "cancelled",
                                f"client disconnected before the response: {type(e).__name__}")
                return False
        if request.method == "HEAD":
            await reply.end()
            return True
        client_gone = False
        try:
            async for chunk in up.iter_any():  # what the read callbacks queued (once one is, they write no more)
                an = rs.an
                now = an.now() if an is not None else 0.0
                try:
                    await reply.write(chunk)
                except ConnectionError as e:
                    client_gone = True
                    if an is not None and not an.saw_done:
                        an.status, an.note = "cancelled", f"client disconnected: {type(e).__name__}"
                    break
                rs.feed(chunk, now)
        except UpstreamError as e:
            # upstream broke mid-body: the client must see a broken response, not a clean end
            self.stats["upstream_errors"] += 1
            if rs.an is not None:
                self._abort(rs.an, body, "error", f"upstream closed mid-response: {type(e).__name__}")
            reply.abort()
            return False
        an = rs.an
        if an is not None:
            try:
                an.end(an.now())
            except Exception as e:  # noqa: BLE001
                self._fail(an, "end", e)
                an = None
        if not client_gone:
            try:
                await reply.end()
            except ConnectionError:
                # a client that read the whole stream ([DONE]) may close before our last write
                if an is not None and not (an.saw_done or not an.sse):
                    an.status = "cancelled"
        if an is not None:
            self._emit(an, body)
        return not client_gone


def make_proxy(upstream_url: str, sink: Any, *, store_text: bool = False,
               block_chars: int = 256, server_label: str | None = None) -> ProxyServer:
    """A proxy server (not yet listening: ``await server.start(host, port)``) relaying every
    request to ``upstream_url`` and emitting a :class:`RequestRecord` to ``sink`` for each
    completion request (see module doc). ``server.proxy`` holds its ``stats`` and in-flight
    requests. ``server_label`` (default ``host:port`` of the upstream) goes into ``record.server``."""
    proxy = Relay(upstream_url, sink, store_text, block_chars, server_label)
    server = ProxyServer(proxy.handle, proxy.early, whole_body_max=MAX_ANALYSED_BODY)
    server.proxy = proxy
    server.on_close.append(proxy.client.close)
    return server


async def start_proxy(upstream: str, sink: Any, host: str = "127.0.0.1", port: int = 9000,
                      **kwargs: Any) -> ProxyServer:
    """:func:`make_proxy`, listening on ``host:port`` (``port=0``: any free port, see
    ``server.port``); stop it with ``await server.close()``."""
    server = make_proxy(upstream, sink, **kwargs)
    await server.start(host, port)
    return server
