"""A streaming reverse proxy in front of any OpenAI-compatible server, recording one
:class:`~kvdoctor.model.RequestRecord` per completion request.

    runner = await start_proxy("http://127.0.0.1:8080", sink, port=9000)
    ...  # point clients at http://127.0.0.1:9000 instead of :8080
    await runner.cleanup()

What it does:

* Every method and path goes to the upstream unchanged (``/health``, ``/metrics``,
  ``/v1/models`` ... work through the proxy); request and response bodies byte for byte,
  status and end-to-end headers unchanged. Hop-by-hop headers (Connection, Keep-Alive,
  Transfer-Encoding, TE, Trailer, Upgrade, Proxy-*, and those named in Connection) are
  dropped; compressed bodies stay compressed (no decompression on either side).
* Response bodies are forwarded chunk by chunk as they arrive, never buffered whole.
* ``POST /v1/chat/completions`` and ``POST /v1/completions`` are also analysed: arrival,
  first content chunk (TTFT), each later content chunk (ITL), finish, tokens from ``usage``
  or llama.cpp ``timings`` (``cache_n`` -> cached prompt tokens), conversation id, turn,
  prefix block hashes and output repetition (see :mod:`kvdoctor.collect.textstats`). No
  text is kept unless ``store_text``.
* Fail-open: an exception in the analysis is logged once per kind and that request's
  record is dropped; the bytes still flow. Upstream unreachable -> 502 with a short JSON
  error and ``sink.source_status("proxy", False, ...)`` once, ``True`` again on recovery.
* Stale keep-alive connections: llama.cpp closes the connection after every streamed
  response (and any used > 5 s); a request written on such a pooled connection before
  its FIN arrives gets no answer. Such a request (failed within ``RETRY_WITHIN_S``) is sent
  once more on a new connection, and after the first such event streamed responses' upstream
  connections are no longer pooled. Clients never see a spurious 502.

Overhead: on the critical path only a clock read and an incremental SSE split + one
``orjson.loads`` per event; the request body is parsed after the response is complete.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from yarl import URL

from kvdoctor.collect import textstats
from kvdoctor.model import RequestRecord, derive_request

log = logging.getLogger("kvdoctor.proxy")

SOURCE_NAME = "proxy"

#: ``app[PROXY_KEY]`` is the proxy object (its ``stats`` dict counts requests, records, errors)
PROXY_KEY: "web.AppKey[Any]" = web.AppKey("kvdoctor_proxy", object)

#: request paths whose POSTs are analysed, and their kind
ANALYSED_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}

_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "transfer-encoding", "te", "trailer", "trailers", "upgrade",
    "proxy-connection", "proxy-authenticate", "proxy-authorization",
})
#: request headers not forwarded besides hop-by-hop ones: aiohttp sets Host and
#: Content-Length from the URL and body; the body was already read (no 100-continue).
_REQ_DROP = frozenset({"host", "content-length", "expect"})
#: never let the client library add headers the client did not send
_SKIP_AUTO = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")

#: most bytes of a non-SSE response body kept for its analysis (bigger: no analysis)
MAX_ANALYSED_BODY = 16 * 1024 * 1024
#: an SSE event still open past this many bytes is not analysed (the stream is still relayed)
MAX_SSE_EVENT_BYTES = 8 * 1024 * 1024
ERROR_CHARS = 200
#: resend a request once on a new connection if a pooled one failed within this many seconds
RETRY_WITHIN_S = 1.0
#: return a connection to the pool only if its request took less than this (seconds)
REUSE_WITHIN_S = 4.0


def _hop_headers(headers: Any) -> set[str]:
    """Hop-by-hop names: the fixed set, Proxy-*, and those listed in Connection."""
    extra = set()
    for v in headers.getall("Connection", ()):
        for name in v.split(","):
            name = name.strip().lower()
            if name:
                extra.add(name)
    return extra


def _forward_headers(headers: Any, drop: frozenset[str]) -> list[tuple[str, str]]:
    extra = _hop_headers(headers)
    out = []
    for k, v in headers.items():
        lk = k.lower()
        if lk in _HOP_BY_HOP or lk in drop or lk in extra or lk.startswith("proxy-"):
            continue
        out.append((k, v))
    return out


def _log_once(seen: set[str], kind: str, exc: BaseException) -> None:
    key = f"{kind}:{type(exc).__name__}"
    if key in seen:
        return
    seen.add(key)
    log.warning("proxy analysis failed (%s), records for such requests are dropped; "
                "traffic is unaffected: %s: %s", kind, type(exc).__name__, exc, exc_info=exc)


def _error_message(obj: Any) -> str | None:
    """The message of an OpenAI/llama.cpp/vLLM error body or SSE error object."""
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            for k in ("message", "detail", "msg"):
                v = err.get(k)
                if isinstance(v, str):
                    return v
            return orjson.dumps(err).decode()
        if isinstance(err, str):
            return err
        if "detail" in obj:
            return str(obj["detail"])
    if obj is None:
        return None
    return str(obj)


def _is_rejection(http_status: int, message: str | None, err_type: str | None) -> bool:
    """The server or a gateway refused the request (429 rate limit, context too long, 503
    overloaded) rather than failing it: one classifier, kvdoctor/error_classes.py."""
    from .. import error_classes

    cls = error_classes.classify(http_status, err_type, message, status="error")
    return cls is not None and error_classes.CLASSES[cls].status == "rejected"


#: an id we keep verbatim: short, printable, no spaces (anything else gets a random id)
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")


def _one_line(e: BaseException) -> str:
    """An exception's text as one printable line (aiohttp's parser errors span several)."""
    return " ".join(str(e).split())[:200].encode("ascii", "backslashreplace").decode()


def client_request_id(value: str | None) -> str | None:
    """The client's ``X-Request-Id`` (the header vLLM and most gateways honour) when it is a
    plain token; ``None`` otherwise, so an odd header can never break a record."""
    if value and _CLIENT_ID.fullmatch(value):
        return value
    return None


#: W3C trace context: version-traceid-parentid-flags, lower-case hex
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def traceparent_trace_id(value: str | None) -> str | None:
    """The trace id of a valid ``traceparent`` header (the engine's span carries the same one)."""
    m = _TRACEPARENT.fullmatch((value or "").strip())
    if m is None or m.group(1) == "ff" or m.group(2) == "0" * 32:
        return None
    return m.group(2)


def _pct(sorted_xs: list[float], q: float) -> float:
    """Linear-interpolated percentile of a sorted list (numpy's default method), no numpy."""
    pos = (len(sorted_xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def _int(x: Any) -> int | None:
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return int(x)
    return None


class _Analysis:
    """Per-request state; :meth:`feed` runs once per upstream chunk (the hot path)."""

    __slots__ = ("saw_done", "kind", "arrival_s", "store_text", "http_status", "sse", "first_s", "last_s",
                 "finish_s", "itl", "n_content", "usage", "timings", "model", "stream_error",
                 "rep", "out_parts", "_buf", "_crlf", "_body", "_body_len", "status",
                 "note", "client_id", "trace_id")

    def __init__(self, kind: str, arrival_s: float, store_text: bool) -> None:
        self.kind = kind
        self.arrival_s = arrival_s
        self.store_text = store_text
        self.http_status: int | None = None
        self.sse = False
        self.first_s: float | None = None
        self.last_s: float | None = None
        self.finish_s: float | None = None
        self.itl: list[float] = []
        self.n_content = 0
        self.usage: dict | None = None
        self.timings: dict | None = None
        self.model: str | None = None
        self.stream_error: str | None = None
        self.rep = textstats.RepetitionCounter(4)
        self.out_parts: list[str] | None = [] if store_text else None
        self._buf = b""
        self._crlf = False
        self._body: list[bytes] | None = []
        self._body_len = 0
        #: the stream's own end marker was relayed: a client leaving after it did not cancel
        self.saw_done = False
        #: set by the handler: "cancelled" (client left), "error" (upstream broke)
        self.status: str | None = None
        self.note: str | None = None
        #: the client's own id for the request (X-Request-Id), kept so records join the client's logs
        self.client_id: str | None = None
        #: the trace id of the client's W3C traceparent: joins the record to the engine's span
        self.trace_id: str | None = None

    # ---------------------------------------------------------------- response start
    def start(self, http_status: int, content_type: str) -> None:
        self.http_status = http_status
        self.sse = http_status < 300 and content_type.startswith("text/event-stream")
        if self.sse:
            self._body = None

    # ---------------------------------------------------------------- hot path
    def feed(self, chunk: bytes, now: float) -> None:
        if not self.sse:
            if self._body is not None:
                self._body_len += len(chunk)
                if self._body_len > MAX_ANALYSED_BODY:
                    self._body = None
                else:
                    self._body.append(chunk)
            return
        if self._crlf or b"\r" in chunk:
            self._crlf = True
            if chunk[:1] == b"\n" and self._buf[-1:] == b"\r":  # a CRLF split across chunks
                self._buf = self._buf[:-1]
            chunk = chunk.replace(b"\r\n", b"\n")
        # only the new bytes (and the one before them) are searched, and a pending partial
        # event grows in place: linear in the stream, however long an event runs
        if self._buf:
            scan = len(self._buf) - 1
            if not isinstance(self._buf, bytearray):
                self._buf = bytearray(self._buf)
            self._buf += chunk
            buf = self._buf
        else:
            scan, buf = 0, chunk
        start = 0
        find = buf.find
        while True:
            i = find(b"\n\n", max(start, scan))
            if i < 0:
                break
            if i > start:
                self._event(bytes(buf[start:i]), now)
            start = i + 2
        if start >= len(buf):
            self._buf = b""
        elif len(buf) - start > MAX_SSE_EVENT_BYTES:
            self._buf = b""
            raise ValueError(f"an SSE event over {MAX_SSE_EVENT_BYTES >> 20} MiB without its blank line: "
                             "this stream is relayed, not analysed")
        else:
            self._buf = buf[start:] if start else buf

    def _event(self, ev: bytes, now: float) -> None:
        if ev.startswith(b"data: ") and b"\n" not in ev:
            payload = ev[6:]
            field = b"data"
        else:  # general SSE: several lines, comments, other fields
            datas, field = [], b"data"
            for line in ev.split(b"\n"):
                if line.startswith(b"data:"):
                    datas.append(line[5:].lstrip(b" "))
                elif line.startswith(b"error:"):
                    datas.append(line[6:].lstrip(b" "))
                    field = b"error"
            if not datas:
                return
            payload = b"\n".join(datas)
        if payload[:6] == b"[DONE]":
            self.saw_done = True
            return
        obj = orjson.loads(payload)
        if not isinstance(obj, dict):
            return
        if field == b"error" or obj.get("error"):
            self.stream_error = _error_message(obj) or "error event in stream"
            return
        if self.model is None:
            self.model = obj.get("model")
        choices = obj.get("choices")
        if choices:
            content = False
            for c in choices:
                d = c.get("delta")
                if d is not None:
                    t = d.get("content")
                    if t:
                        content = True
                        self.rep.feed(t)
                        if self.out_parts is not None:
                            self.out_parts.append(t)
                    elif d.get("reasoning_content") or d.get("tool_calls"):
                        content = True
                else:
                    t = c.get("text")
                    if t:
                        content = True
                        self.rep.feed(t)
                        if self.out_parts is not None:
                            self.out_parts.append(t)
            if content:
                self.n_content += 1
                if self.first_s is None:
                    self.first_s = now
                else:
                    self.itl.append(now - self.last_s)
                self.last_s = now
        u = obj.get("usage")
        if u:
            self.usage = u
        tm = obj.get("timings")
        if tm:
            self.timings = tm

    def end(self, now: float) -> None:
        self.finish_s = now
        if self.sse and self._buf.strip():
            rest, self._buf = self._buf.strip(), b""
            try:  # a last event without its blank line; a truncated one is dropped
                self._event(rest, now)
            except orjson.JSONDecodeError:
                pass

    # ---------------------------------------------------------------- off the hot path
    def record(self, request_body: bytes, block_chars: int, server: str | None,
               store_text: bool) -> RequestRecord:
        req = orjson.loads(request_body) if request_body else None
        if not isinstance(req, dict):
            req = None
        msgs = textstats._messages(req)
        prompt = textstats.render_prompt(req)
        hashes = textstats.prefix_block_hashes(prompt, block_chars) if prompt else None
        http_status = self.http_status
        status = "ok"
        error: str | None = None
        err_type: str | None = None
        out_text: str | None = None
        obj: Any = None

        if not self.sse and self._body is not None and self._body:
            raw = b"".join(self._body)
            try:
                obj = orjson.loads(raw)
            except orjson.JSONDecodeError:
                obj = None
                if http_status is not None and http_status >= 400:
                    error = raw[:ERROR_CHARS].decode("utf-8", "replace")
        if isinstance(obj, dict):
            if self.model is None and isinstance(obj.get("model"), str):
                self.model = obj["model"]
            if obj.get("usage"):
                self.usage = obj["usage"]
            if obj.get("timings"):
                self.timings = obj["timings"]
            if obj.get("error") or (http_status is not None and http_status >= 400):
                error = _error_message(obj)
                e = obj.get("error", obj)
                if isinstance(e, dict) and isinstance(e.get("type"), str):
                    err_type = e["type"]
            elif http_status is not None and http_status < 300:
                texts = []
                for c in obj.get("choices") or ():
                    if not isinstance(c, dict):
                        continue
                    m = c.get("message")
                    t = m.get("content") if isinstance(m, dict) else c.get("text")
                    if isinstance(t, str):
                        texts.append(t)
                out_text = "".join(texts)
                self.rep.feed(out_text)
        elif obj is not None and http_status is not None and http_status >= 400:
            error = _error_message(obj)

        if http_status is not None and http_status >= 400:
            status = "rejected" if _is_rejection(http_status, error, err_type) else "error"
            error = error or f"HTTP {http_status}"
        elif self.stream_error:
            status, error = "error", self.stream_error
        if self.status == "cancelled":
            status = "cancelled"
        elif self.status == "error":
            status = "error"
            error = self.note or error
        if error:
            error = error[:ERROR_CHARS]

        u = self.usage if isinstance(self.usage, dict) else {}
        tm = self.timings if isinstance(self.timings, dict) else {}
        prompt_tokens = _int(u.get("prompt_tokens"))
        if prompt_tokens is None and tm.get("prompt_n") is not None:
            prompt_tokens = (_int(tm.get("prompt_n")) or 0) + (_int(tm.get("cache_n")) or 0)
        output_tokens = _int(u.get("completion_tokens"))
        if output_tokens is None:
            output_tokens = _int(tm.get("predicted_n"))
        if output_tokens is None and self.n_content:
            output_tokens = self.n_content
        cached = None
        ptd = u.get("prompt_tokens_details")
        if isinstance(ptd, dict):
            cached = _int(ptd.get("cached_tokens"))
        if cached is None:
            cached = _int(tm.get("cache_n"))

        arrival, finish = self.arrival_s, self.finish_s
        e2e = finish - arrival if finish is not None else None
        first, ttft = self.first_s, None
        if first is not None:
            ttft = first - arrival
        elif not self.sse and e2e is not None and status == "ok" and tm.get("predicted_ms") is not None:
            # non-streaming: the last token came at finish; decode took predicted_ms
            ttft = max(0.0, e2e - float(tm["predicted_ms"]) / 1000.0)
            first = arrival + ttft
        queue = None
        if ttft is not None and tm.get("prompt_ms") is not None:
            queue = max(0.0, ttft - float(tm["prompt_ms"]) / 1000.0)

        rep_value = self.rep.finish()  # None below one 4-gram
        if store_text and out_text is None and self.out_parts is not None:
            out_text = "".join(self.out_parts)

        model = self.model
        if model is None and req is not None and isinstance(req.get("model"), str):
            model = req["model"]
        prompt_chars = len(prompt) if prompt else None
        itl = [round(x, 6) for x in self.itl] if self.itl else None
        srt = sorted(itl) if itl else None
        rec = RequestRecord(
            request_id=self.client_id or os.urandom(8).hex(),
            arrival_s=arrival,
            first_token_s=first,
            finish_s=finish,
            ttft_s=ttft,
            itl_s=itl,
            itl_p50_s=_pct(srt, 50) if srt else None,
            itl_p99_s=_pct(srt, 99) if srt else None,
            itl_max_s=srt[-1] if srt else None,
            e2e_s=e2e,
            queue_s=queue,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens if status in ("ok", "cancelled", "error") else None,
            cached_prompt_tokens=cached,
            session_id=textstats.conversation_id(msgs),
            turn=textstats.turn_number(msgs),
            prefix_block_hashes=hashes or None,
            prefix_block_tokens=textstats.prefix_block_tokens(prompt_tokens, prompt_chars, block_chars)
            if hashes else None,
            status=status,
            error=error,
            http_status=http_status,
            model=model,
            server=server,
            trace_id=self.trace_id,
            output_repetition=rep_value,
            prompt_text=prompt if store_text else None,
            output_text=out_text if store_text else None,
        )
        return derive_request(rec)


class _Proxy:
    def __init__(self, upstream_url: str, sink: Any, store_text: bool, block_chars: int,
                 server_label: str | None) -> None:
        if block_chars <= 0:
            raise ValueError("block_chars must be positive")
        self.base = upstream_url.rstrip("/")
        u = URL(self.base)
        if u.scheme not in ("http", "https") or not u.host:
            raise ValueError(f"upstream must be an http(s) URL, got {upstream_url!r}")
        self.sink = sink
        self.store_text = store_text
        self.block_chars = block_chars
        self.server_label = server_label if server_label is not None else f"{u.host}:{u.port}"
        self.session: aiohttp.ClientSession | None = None
        self.fresh_session: aiohttp.ClientSession | None = None
        self.upstream_ok: bool | None = None
        #: set once the upstream was seen dropping pooled connections (see handle)
        self.close_after_stream = False
        self._logged: set[str] = set()
        self.stats = {"requests": 0, "analysed": 0, "records": 0, "analysis_errors": 0,
                      "upstream_errors": 0, "retries": 0}
        #: analysed requests not answered yet: live diagnosis counts them (queued requests
        #: would otherwise be invisible until they finish, exactly when they matter)
        self.in_flight: dict[int, _Analysis] = {}

    def in_flight_records(self) -> list[RequestRecord]:
        """A provisional record per request still in flight: arrival, first token if seen,
        status ``in-flight``. For the live window only; never written to the capture."""
        return [RequestRecord(request_id=f"in-flight-{k:x}", arrival_s=an.arrival_s, first_token_s=an.first_s,
                              ttft_s=(an.first_s - an.arrival_s) if an.first_s is not None else None,
                              status="in-flight", server=self.server_label)
                for k, an in list(self.in_flight.items())]

    def _new_session(self, force_close: bool) -> aiohttp.ClientSession:
        # keepalive below the common 5 s server keep-alive (llama.cpp/cpp-httplib, uvicorn)
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, force_close=force_close,
                                         keepalive_timeout=None if force_close else 4.0)
        return aiohttp.ClientSession(
            connector=connector, auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            skip_auto_headers=_SKIP_AUTO, cookie_jar=aiohttp.DummyCookieJar())

    async def on_startup(self, app: web.Application) -> None:
        self.session = self._new_session(False)
        #: one retry goes here: a new connection, never a pooled one the server may have closed
        self.fresh_session = self._new_session(True)

    async def on_cleanup(self, app: web.Application) -> None:
        for s in (self.session, self.fresh_session):
            if s is not None:
                await s.close()

    def _status(self, ok: bool, detail: str) -> None:
        if self.upstream_ok is ok:
            return
        self.upstream_ok = ok
        try:
            self.sink.source_status(SOURCE_NAME, ok, detail)
        except Exception as e:  # noqa: BLE001 - never let the sink break traffic
            _log_once(self._logged, "sink", e)

    def _fail(self, an: _Analysis | None, where: str, e: BaseException) -> None:
        self.stats["analysis_errors"] += 1
        _log_once(self._logged, where, e)

    def _emit(self, an: _Analysis, body: bytes) -> None:
        try:
            rec = an.record(body, self.block_chars, self.server_label, self.store_text)
        except Exception as e:  # noqa: BLE001
            self._fail(an, "record", e)
            return
        try:
            self.sink.emit(rec)
            self.stats["records"] += 1
        except Exception as e:  # noqa: BLE001
            _log_once(self._logged, "sink", e)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        arrival = time.time()
        self.stats["requests"] += 1
        declared = request.content_length
        if (declared is not None and declared > MAX_ANALYSED_BODY) or (declared is None and request.body_exists):
            # a body too large to analyse (or of unknown length) is streamed upstream as it
            # arrives, never held whole: the record keeps its timings, not its prompt stats
            body, stream = b"", request.content
        else:
            body, stream = await request.read(), None
        kind = ANALYSED_PATHS.get(request.path) if request.method == "POST" else None
        an: _Analysis | None = None
        if kind is not None:
            try:
                an = _Analysis(kind, arrival, self.store_text)
                an.client_id = client_request_id(request.headers.get("X-Request-Id"))
                an.trace_id = traceparent_trace_id(request.headers.get("traceparent"))
                self.stats["analysed"] += 1
            except Exception as e:  # noqa: BLE001
                self._fail(None, "init", e)
                an = None
        if an is not None:
            self.in_flight[id(an)] = an
        try:
            return await self._handle(request, body, an, stream)
        finally:
            if an is not None:
                self.in_flight.pop(id(an), None)

    async def _handle(self, request: web.Request, body: bytes, an: _Analysis | None,
                      stream: Any = None) -> web.StreamResponse:
        assert self.session is not None
        url = URL(self.base + request.raw_path, encoded=True)
        headers = _forward_headers(request.headers, _REQ_DROP)
        data = stream if stream is not None else (body if body else None)
        if stream is not None and request.content_length is not None:  # the client's framing, not chunked
            headers.append(("Content-Length", str(request.content_length)))
        try:
            t_send = time.monotonic()
            try:
                up = await self.session.request(request.method, url, data=data, headers=headers,
                                                allow_redirects=False)
            except aiohttp.ClientConnectorError:
                raise
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
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
                up = await self.fresh_session.request(request.method, url, data=data,
                                                      headers=headers, allow_redirects=False)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            # unreachable, or an answer that is not HTTP (bad status line, oversized or too many
            # headers, bad framing): the client gets a 502 JSON error, the capture an error record
            self.stats["upstream_errors"] += 1
            if isinstance(e, (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError,
                              aiohttp.ClientOSError, asyncio.TimeoutError)):
                detail = f"upstream unreachable: {type(e).__name__}: {e}"[:300]
            else:
                detail = f"upstream_error: malformed response ({type(e).__name__}: {_one_line(e)})"[:300]
            self._status(False, detail)
            if an is not None:
                try:
                    an.start(502, "application/json")
                    an.status, an.note = "error", detail
                    an.end(time.time())
                    self._emit(an, body)
                except Exception as e2:  # noqa: BLE001
                    self._fail(an, "record", e2)
            payload = {"error": {"message": detail, "type": "bad_gateway", "code": 502}}
            return web.Response(status=502, body=orjson.dumps(payload),
                                content_type="application/json")
        self._status(True, "upstream reachable")
        done = False
        try:
            resp, done = await self._relay(request, up, an, body)
            return resp
        finally:
            # keep the connection unless it is broken or the server is about to drop it
            # (cpp-httplib closes a keep-alive connection used longer than 5 s)
            if (done and time.monotonic() - t_send < REUSE_WITHIN_S
                    and not (self.close_after_stream
                             and up.headers.get("Content-Type", "").startswith("text/event-stream"))):
                up.release()
            else:  # drop the upstream connection: the server sees the client go away
                up.close()

    async def _relay(self, request: web.Request, up: aiohttp.ClientResponse,
                     an: _Analysis | None, body: bytes) -> tuple[web.StreamResponse, bool]:
        """Stream the upstream response to the client; returns (response, body fully relayed)."""
        resp = web.StreamResponse(status=up.status, reason=up.reason)
        resp.headers.extend(_forward_headers(up.headers, frozenset()))
        if an is not None:
            try:
                an.start(up.status, up.headers.get("Content-Type", ""))
            except Exception as e:  # noqa: BLE001
                self._fail(an, "start", e)
                an = None
        if request.method == "HEAD":
            await resp.prepare(request)
            await resp.write_eof()
            return resp, True
        try:
            await resp.prepare(request)
        except (ConnectionError, RuntimeError) as e:
            # the client gave up while the request waited upstream (queued behind busy slots)
            if an is not None:
                an.status, an.note = "cancelled", f"client disconnected before the response: {type(e).__name__}"
                try:
                    an.end(time.time())
                    self._emit(an, body)
                except Exception as e2:  # noqa: BLE001
                    self._fail(an, "end", e2)
            return resp, False
        client_gone = False
        try:
            async for chunk in up.content.iter_any():
                now = time.time()
                try:
                    await resp.write(chunk)
                except (ConnectionError, RuntimeError) as e:
                    client_gone = True
                    if an is not None and not an.saw_done:
                        an.status, an.note = "cancelled", f"client disconnected: {type(e).__name__}"
                    break
                if an is not None:
                    try:
                        an.feed(chunk, now)
                    except Exception as e:  # noqa: BLE001
                        self._fail(an, "feed", e)
                        an = None
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
            # upstream broke mid-body: the client must see a broken response, not a clean end
            self.stats["upstream_errors"] += 1
            if an is not None:
                an.status, an.note = "error", f"upstream closed mid-response: {type(e).__name__}"
                try:
                    an.end(time.time())
                except Exception as e2:  # noqa: BLE001
                    self._fail(an, "end", e2)
                    an = None
                if an is not None:
                    self._emit(an, body)
            if request.transport is not None:
                request.transport.close()
            return resp, False
        if an is not None:
            try:
                an.end(time.time())
            except Exception as e:  # noqa: BLE001
                self._fail(an, "end", e)
                an = None
        if not client_gone:
            try:
                await resp.write_eof()
            except (ConnectionError, RuntimeError):
                # a client that read the whole stream ([DONE]) may close before our last write
                if an is not None and not (an.saw_done or not an.sse):
                    an.status = "cancelled"
        if an is not None:
            self._emit(an, body)
        return resp, not client_gone


def make_proxy_app(upstream_url: str, sink: Any, *, store_text: bool = False,
                   block_chars: int = 256, server_label: str | None = None,
                   client_max_size: int = 256 * 1024 * 1024) -> web.Application:
    """An aiohttp application proxying every request to ``upstream_url`` and emitting a
    :class:`RequestRecord` to ``sink`` for each completion request (see module doc).
    ``server_label`` (default ``host:port`` of the upstream) goes into ``record.server``."""
    proxy = _Proxy(upstream_url, sink, store_text, block_chars, server_label)
    app = web.Application(client_max_size=client_max_size)
    app[PROXY_KEY] = proxy
    app.on_startup.append(proxy.on_startup)
    app.on_cleanup.append(proxy.on_cleanup)
    app.router.add_route("*", "/{tail:.*}", proxy.handle)
    return app


async def start_proxy(upstream: str, sink: Any, host: str = "127.0.0.1", port: int = 9000,
                      **kwargs: Any) -> web.AppRunner:
    """Build the proxy app, listen on ``host:port`` (``port=0``: any free port; see
    ``runner.addresses``), return the started runner; stop it with ``await runner.cleanup()``.
    ``kwargs`` go to :func:`make_proxy_app`."""
    app = make_proxy_app(upstream, sink, **kwargs)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    return runner


def proxy_port(runner: web.AppRunner) -> int:
    """The port a started runner listens on (useful with ``port=0``)."""
    return int(runner.addresses[0][1])
