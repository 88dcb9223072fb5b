"""The relay's fast path (kvdoctor.collect.proxy_plain): a whole plain request sent on before it is
parsed. What it sends must be what the slow path sends (same method, target and end-to-end headers,
Host the upstream's, the body byte for byte), and whatever it accepts, llhttp must accept too, as one
whole request: else the upstream would work on a request the client is told was refused."""
from __future__ import annotations

import asyncio

import aiohttp
import httptools
import pytest
from test_proxy import CHAT_BODY, Started, run

from kvdoctor.collect.base import ListSink
from kvdoctor.collect.proxy import _REQ_DROP, _end_to_end, make_proxy
from kvdoctor.collect.proxy_plain import MAX_PLAIN_HEAD_BYTES, plain_request

HOST = b"10.0.0.7:8000"
BODY = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}'


def _req(*headers: bytes, body: bytes = BODY, line: bytes = b"POST /v1/chat/completions HTTP/1.1") -> bytes:
    return line + b"\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n" + body


def _cl(body: bytes = BODY) -> bytes:
    return b"Content-Length: %d" % len(body)


class _Parsed:
    def __init__(self) -> None:
        self.url, self.headers, self.body, self.complete = b"", [], b"", 0

    def on_url(self, u: bytes) -> None:
        self.url += u

    def on_header(self, k: bytes, v: bytes) -> None:
        self.headers.append((k, v))

    def on_body(self, b: bytes) -> None:
        self.body += b

    def on_message_complete(self) -> None:
        self.complete += 1


def _parse(raw: bytes) -> _Parsed:
    p = _Parsed()
    parser = httptools.HttpRequestParser(p)
    parser.feed_data(raw)
    p.method = parser.get_method()  # type: ignore[attr-defined]
    return p


def _slow_path(raw: bytes, prefix: bytes = b"") -> tuple[bytes, bytes, list[tuple[bytes, bytes]], bytes]:
    """What the slow path sends upstream for ``raw``: method, target, headers (Host first, the
    end-to-end ones in order, Content-Length), body."""
    p = _parse(raw)
    e2e = _end_to_end(p.headers, _REQ_DROP)
    return p.method, prefix + p.url, [(b"Host", HOST)] + e2e + [(b"Content-Length", b"%d" % len(p.body))], p.body


def _sent(head: bytes, body: bytes) -> tuple[bytes, bytes, list[tuple[bytes, bytes]], bytes]:
    p = _parse(head + body)
    assert p.complete == 1
    return p.method, p.url, p.headers, p.body


def _same(fast: tuple, slow: tuple) -> None:
    """Same request; Content-Length may sit where the client put it rather than last."""
    assert fast[0] == slow[0] and fast[1] == slow[1] and fast[3] == slow[3]
    key = lambda h: [(k.lower(), v) for k, v in h]  # noqa: E731
    assert [h for h in key(fast[2]) if h[0] != b"content-length"] == \
        [h for h in key(slow[2]) if h[0] != b"content-length"]
    assert [int(v) for k, v in key(fast[2]) if k == b"content-length"] == [len(fast[3])]


@pytest.mark.parametrize("raw,prefix", [
    # aiohttp's client
    (_req(b"Host: 127.0.0.1:9000", b"Accept: */*", b"Accept-Encoding: gzip, deflate", b"User-Agent: Python/3.11 aiohttp/3.9",
          b"Content-Length: %d" % len(BODY), b"Content-Type: application/json"), b""),
    # httpx (the OpenAI SDK): Connection: keep-alive, Authorization
    (_req(b"Host: localhost:9000", b"Accept-Encoding: gzip, deflate", b"Connection: keep-alive", b"Accept: application/json",
          b"Content-Type: application/json", b"Authorization: Bearer sk-x", b"X-Stainless-Lang: python",
          _cl()), b""),
    # an upstream URL with a path; odd spacing and case; an empty value; a query
    (_req(b"host:x", b"CONTENT-LENGTH:   %d  " % len(BODY), b"X-Empty:", b"connection:  Keep-Alive ",
          line=b"POST /v1/completions?trace=1&a=%2F HTTP/1.1"), b"/engine"),
    # no Host at all; an empty body
    (_req(b"Content-Length: 0", body=b""), b""),
])
def test_plain_request_sends_what_the_slow_path_sends(raw, prefix):
    out = plain_request(raw, HOST, prefix)
    assert out is not None
    head, body = out
    assert head.startswith(b"POST " + prefix + b"/v1/") and head.endswith(b"\r\n\r\n")
    assert body == raw[raw.index(b"\r\n\r\n") + 4:]
    assert head.split(b"\r\n")[1] == b"Host: " + HOST  # Host first, as the slow path writes it
    _same(_sent(head, body), _slow_path(raw, prefix))


@pytest.mark.parametrize("raw", [
    _req(_cl(), line=b"GET /v1/models HTTP/1.1", body=BODY),  # not a POST
    _req(_cl(), line=b"POST /v1/chat/completions HTTP/1.0"),  # HTTP/1.0: its keep-alive differs
    _req(_cl(), line=b"POST http://up:8000/v1/chat/completions HTTP/1.1"),  # absolute form
    _req(b"Transfer-Encoding: chunked", body=b"5\r\nhello\r\n0\r\n\r\n"),
    _req(_cl(), b"Expect: 100-continue"),
    _req(_cl(), b"Connection: close"),
    _req(_cl(), b"Connection: keep-alive, X-Hop", b"X-Hop: 1"),
    _req(_cl(), b"Connection: keep-alive", b"Connection: keep-alive"),
    _req(_cl(), b"Keep-Alive: timeout=5"),
    _req(_cl(), b"Proxy-Authorization: Basic x"),
    _req(_cl(), b"TE: trailers"),
    _req(_cl(), b"Trailer: X"),
    _req(_cl(), b"Upgrade: websocket"),
    _req(_cl(), b"Host: a", b"Host: b"),
    _req(_cl(), _cl()),  # two lengths
    _req(b"Content-Length: +%d" % len(BODY)),
    _req(b"Content-Length: %d" % (len(BODY) + 1)),  # the body is not all here yet
    _req(_cl()) + b"POST /v1/chat/completions HTTP/1.1\r\n",  # pipelined: more after it
    _req(),  # no length
    _req(_cl(), b"X-Folded: a", b" b"),  # obs-fold
    _req(_cl(), b"X-Utf8: caf\xc3\xa9"),  # obs-text: not printable ASCII
    _req(_cl(), b"Bad Name: x"),
    _req(_cl(), b"X-Big: " + b"a" * MAX_PLAIN_HEAD_BYTES),
    _req(_cl())[:40],  # a head split across reads
])
def test_plain_request_leaves_everything_else_to_the_slow_path(raw):
    assert plain_request(raw, HOST) is None


def test_plain_request_bounds_the_body():
    raw = _req(_cl())
    assert plain_request(raw, HOST, max_body_bytes=len(BODY)) is not None
    assert plain_request(raw, HOST, max_body_bytes=len(BODY) - 1) is None


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

# repeated entries weight the draw: most requests are plain (so the property is exercised), some not
_NAMES = st.sampled_from([b"Content-Type", b"Accept", b"X-A", b"Authorization", b"traceparent"] * 3 + [
    b"Host", b"Connection", b"content-length", b"TE", b"Expect", b"Keep-Alive", b"Transfer-Encoding", b"Proxy-X"])
_VALUES = st.sampled_from([b"keep-alive", b"x", b"", b" a b ", b"Bearer k", b"1, 2"] * 3 + [
    b"close", b"chunked", b"5", b"100-continue", b"a\x00b", b"caf\xc3\xa9", b"a\rb"])


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(headers=st.lists(st.tuples(_NAMES, _VALUES), max_size=8), body=st.binary(max_size=40),
       with_length=st.sampled_from([True] * 4 + [False]), cut=st.sampled_from([0] * 6 + [1, 2, 5]),
       junk=st.sampled_from([b""] * 6 + [b"x", b"\r\n", b"POST / HTTP/1.1\r\n"]))
def test_whatever_the_fast_path_sends_llhttp_reads_as_one_whole_request(headers, body, with_length, cut, junk):
    """Any request it accepts parses, as it came from the client, to exactly one complete message
    with that body, and what it sends is the slow path's request."""
    lines = [k + b": " + v for k, v in headers] + ([_cl(body)] if with_length else [])
    raw = _req(*lines, body=body)
    raw = raw[:len(raw) - cut] + junk if cut or junk else raw
    out = plain_request(raw, HOST)
    if out is None:
        return
    p = _parse(raw)  # must not raise: the client would get a 400 for a request already sent
    assert p.complete == 1 and p.body == out[1]
    _same(_sent(*out), _slow_path(raw))


def test_the_relay_sends_plain_requests_before_parsing_them_and_records_them_the_same():
    """Through the proxy: the first request opens the upstream connection (slow path), the next
    ones on the pooled connection go the fast way; the upstream gets the same requests and the
    records are complete either way."""
    got: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
                got.append(head + await reader.readexactly(n))
                events = (b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'
                          b'data: {"choices":[{"delta":{}}],"usage":{"prompt_tokens":9,"completion_tokens":1}}\n\n'
                          b"data: [DONE]\n\n")
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(events), events))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        up = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        sink, app = ListSink(), make_proxy(up, ListSink())
        app.proxy.sink = sink
        try:
            async with Started(app) as px, aiohttp.ClientSession() as s:
                for i in range(3):
                    async with s.post(px + "/v1/chat/completions", json=CHAT_BODY,
                                      headers={"X-Request-Id": f"r{i}", "Connection": "keep-alive"}) as r:
                        assert r.status == 200 and (await r.read()).endswith(b"data: [DONE]\n\n")
        finally:
            server.close()
            await server.wait_closed()
        return sink, app.proxy.stats

    sink, stats = run(main())
    assert stats["fast_path"] == 2 and stats["records"] == 3
    first, *fast = [_parse(g) for g in got]
    for p in fast:
        assert p.body == first.body and p.url == first.url
        names = [k.lower() for k, _ in p.headers]
        assert b"connection" not in names and names.count(b"host") == 1
        assert dict(p.headers)[b"Host"] == up_host(got[0])
    assert [r.request_id for r in sink.records] == ["r0", "r1", "r2"]
    for r in sink.records:
        assert r.status == "ok" and r.output_tokens == 1 and r.prompt_tokens == 9
        assert 0 <= r.ttft_s < 5 and r.arrival_s <= r.first_token_s


def up_host(raw: bytes) -> bytes:
    """The Host the slow path wrote (the upstream's address)."""
    return next(ln.split(b": ", 1)[1] for ln in raw.split(b"\r\n") if ln.lower().startswith(b"host:"))
