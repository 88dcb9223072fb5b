"""The proxy's own HTTP/1.1 server side (kvdoctor.collect.proxy.http.server), spoken to over raw
sockets: what a client may send that aiohttp's server used to handle for it."""
from __future__ import annotations

import asyncio
import time

from aiohttp import web
from test_proxy import RawUpstream, Started, run

from kvdoctor.collect.base import ListSink
from kvdoctor.collect.proxy import make_proxy


def _upstream() -> web.Application:
    """Echoes method, path and body size; ``/chunked`` answers without a Content-Length;
    ``/slow`` streams for 30 s."""
    async def echo(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        text = f"{request.method} {request.path_qs} {len(body)}"
        if request.path == "/chunked":
            resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
            await resp.prepare(request)
            for part in ("one ", "two ", text):
                await resp.write(part.encode())
            await resp.write_eof()
            return resp
        if request.path == "/slow":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for _ in range(300):
                await resp.write(b"data: {}\n\n")
                await asyncio.sleep(0.1)
            return resp
        return web.Response(text=text)

    app = web.Application(client_max_size=1 << 26)
    app.router.add_route("*", "/{t:.*}", echo)
    return app


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            body += await reader.readexactly(size + 2)
            body = body[:-2]
            if size == 0:
                break
    elif status in (100, 204, 304):
        body = b""
    else:
        body = await reader.read()
    return status, headers, body


async def _exchange(raw: bytes, n: int = 1, wait_eof: bool = False):
    """Send ``raw`` to a fresh proxy (echo upstream) over one connection; read ``n`` responses."""
    async with Started(_upstream()) as up, Started(make_proxy(up, ListSink())) as px:
        port = int(px.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(raw)
        out = [await _read_response(reader) for _ in range(n)]
        eof = (await asyncio.wait_for(reader.read(), 5)) == b"" if wait_eof else None
        writer.close()
        return out, eof


def test_pipelined_requests_are_answered_in_order_on_one_connection():
    raw = (b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n"
           b"POST /b?q=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
           b"GET /c HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    out, eof = run(_exchange(raw, 3, wait_eof=True))
    assert [(s, b) for s, _, b in out] == [(200, b"GET /a 0"), (200, b"POST /b?q=1 5"), (200, b"GET /c 0")]
    assert out[2][1].get("connection") == "close" and eof


def test_an_http10_client_gets_a_body_that_ends_with_the_connection():
    out, eof = run(_exchange(b"GET /chunked HTTP/1.0\r\n\r\n", wait_eof=True))
    ((status, headers, body),) = out
    assert status == 200 and "transfer-encoding" not in headers
    assert body == b"one two GET /chunked 0" and eof


def test_an_http11_client_gets_an_unsized_body_chunked_and_keeps_the_connection():
    raw = b"GET /chunked HTTP/1.1\r\nHost: x\r\n\r\nGET /after HTTP/1.1\r\nHost: x\r\n\r\n"
    out, _ = run(_exchange(raw, 2))
    assert out[0][1]["transfer-encoding"] == "chunked" and out[0][2] == b"one two GET /chunked 0"
    assert out[1][2] == b"GET /after 0"


def test_a_chunked_request_body_reaches_the_upstream_whole():
    body = b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    out, _ = run(_exchange(b"POST /up HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + body))
    assert out[0][2] == b"POST /up 11"


def test_expect_100_continue_is_answered_before_the_body():
    async def main():
        async with Started(_upstream()) as up, Started(make_proxy(up, ListSink())) as px:
            reader, writer = await asyncio.open_connection("127.0.0.1", int(px.rsplit(":", 1)[1]))
            writer.write(b"POST /e HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n")
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            writer.write(b"abc")
            final = await _read_response(reader)
            writer.close()
            return interim, final

    interim, (status, _, body) = run(main())
    assert interim.startswith(b"HTTP/1.1 100 ") and status == 200 and body == b"POST /e 3"


def test_an_oversized_or_overlong_request_head_is_431():
    big = b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n"
    many = b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(300)) + b"\r\n"
    for raw in (big, many):
        ((status, headers, body),), eof = run(_exchange(raw, wait_eof=True))
        assert status == 431 and headers["connection"] == "close" and b'"code":431' in body and eof


def test_garbage_is_400_and_an_upgrade_is_501():
    ((status, _, body),), eof = run(_exchange(b"\x16\x03\x01 not http at all\r\n\r\n", wait_eof=True))
    assert status == 400 and b"malformed request" in body and eof
    raw = b"GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
    ((status, _, body),), eof = run(_exchange(raw, wait_eof=True))
    assert status == 501 and b"upgrade" in body and eof


def test_a_trailer_is_not_forwarded_as_a_header():
    """A chunked request's trailer fields come after its body: they are not the request's headers. A
    pipelined request is read whole before its turn; its trailer was once sent upstream in its head
    (found by tests/test_fuzz.py's differential test against h11)."""
    upstream = RawUpstream(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok", [])

    async def main():
        async with upstream as up, Started(make_proxy(up, ListSink())) as px:
            reader, writer = await asyncio.open_connection("127.0.0.1", int(px.rsplit(":", 1)[1]))
            writer.write(b"GET /first HTTP/1.1\r\nHost: x\r\n\r\n"
                         b"POST /second HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"2\r\nhi\r\n0\r\nX-Forwarded-For: 10.9.8.7\r\n\r\n")
            out = [await _read_response(reader) for _ in range(2)]
            writer.close()
            return out

    assert [status for status, _, _ in run(main())] == [200, 200]
    first, second = upstream.requests
    assert second.startswith(b"POST /second HTTP/1.1\r\n") and b"10.9.8.7" not in second


def test_a_transfer_coding_other_than_chunked_is_501():
    """llhttp undoes only the chunked framing: a gzip-coded body would go upstream still coded, with the
    header that says so dropped (hop-by-hop). Refused, as h11 refuses it."""
    raw = b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n"
    ((status, headers, body),), eof = run(_exchange(raw, wait_eof=True))
    assert status == 501 and b"transfer codings" in body and eof


def test_an_absolute_form_target_is_sent_upstream_as_a_path():
    upstream = RawUpstream(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", [])

    async def main():
        async with upstream as up, Started(make_proxy(up, ListSink())) as px:
            reader, writer = await asyncio.open_connection("127.0.0.1", int(px.rsplit(":", 1)[1]))
            writer.write(b"GET http://example.test/p?x=1 HTTP/1.1\r\nHost: example.test\r\n\r\n")
            out = await _read_response(reader)
            writer.close()
            return out

    status, _, body = run(main())
    assert status == 200 and body == b"ok"
    assert upstream.requests[0].startswith(b"GET /p?x=1 HTTP/1.1\r\n")


def test_close_cuts_a_stream_still_open_after_the_grace():
    async def main():
        async with Started(_upstream()) as up:
            server = make_proxy(up, ListSink())
            port = await server.start("127.0.0.1", 0)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            await reader.readuntil(b"data: {}")
            t0 = time.monotonic()
            await server.close(grace_s=0.3)
            took = time.monotonic() - t0
            rest = await asyncio.wait_for(reader.read(), 5)  # EOF: the stream was cut
            writer.close()
            return took, rest

    took, rest = run(main())
    assert took < 2.0 and not rest.endswith(b"0\r\n\r\n")


def test_an_idle_keepalive_connection_is_closed_after_the_timeout(monkeypatch):
    from kvdoctor.collect.proxy.http import server as proxy_server

    monkeypatch.setattr(proxy_server, "KEEPALIVE_S", 0.3)

    async def main():
        async with Started(_upstream()) as up, Started(make_proxy(up, ListSink())) as px:
            reader, writer = await asyncio.open_connection("127.0.0.1", int(px.rsplit(":", 1)[1]))
            writer.write(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
            status, _, _ = await _read_response(reader)
            t0 = time.monotonic()
            rest = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            return status, rest, time.monotonic() - t0

    status, rest, waited = run(main())
    assert status == 200 and rest == b"" and 0.2 < waited < 2.0


def test_a_client_leaving_mid_body_is_a_cancelled_record_not_an_upstream_failure():
    async def main():
        sink = ListSink()
        async with Started(_upstream()) as up:
            server = make_proxy(up, sink)
            port = await server.start("127.0.0.1", 0)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"5\r\n{\"a\":\r\n")
            await asyncio.sleep(0.2)
            writer.close()
            for _ in range(100):
                if sink.records:
                    break
                await asyncio.sleep(0.02)
            await server.close()
        return sink, server.proxy.stats

    sink, stats = run(main())
    (rec,) = sink.records
    assert rec.status == "cancelled" and stats["upstream_errors"] == 0
    assert sink.status.get("proxy", (True, ""))[0] is not False


def test_a_request_whose_body_is_in_is_sent_on_from_the_read_callback_before_its_handler_starts():
    """``early`` runs once the whole body is in, before the handler's task; a chunked body goes
    to the handler at its head (to stream), a pipelined request waits its turn without it."""
    from kvdoctor.collect.proxy import ProxyServer

    seen: list[tuple] = []

    def early(request):
        seen.append(("early", request.target, request.body_if_complete()))
        return "sent"

    async def handler(request, reply):
        body = await request.read() if request.early is None else b""
        seen.append(("handler", request.target, request.early, body))
        reply.respond(200, b"", [], b"ok")

    async def main():
        server = ProxyServer(handler, early, whole_body_max=1 << 20)
        port = await server.start("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
                     b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
        out = [await _read_response(reader) for _ in range(2)]
        writer.write(b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
        out.append(await _read_response(reader))
        writer.close()
        await server.close()
        return out

    out = run(main())
    assert [s for s, _, _ in out] == [200, 200, 200]
    assert seen == [("early", b"/a", b"hello"), ("handler", b"/a", "sent", b""),
                    ("handler", b"/b", None, b"hi"),  # pipelined: handled in turn, body read then
                    ("handler", b"/c", None, b"abc")]  # chunked: to the handler at its head


def test_a_request_sent_on_early_whose_client_leaves_is_a_cancelled_record_and_frees_the_upstream():
    """The request left for the upstream from the read callback; its client closes before the
    answer: the answer is still taken (a record, status cancelled), and the upstream connection
    is closed, not pooled with an answer half read."""
    served: list[str] = []

    async def slow_chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        served.append(request.path)
        await asyncio.sleep(0.3)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n')
        return resp

    async def main():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", slow_chat)
        sink = ListSink()
        async with Started(app) as up:
            server = make_proxy(up, sink)
            port = await server.start("127.0.0.1", 0)
            body = b'{"messages": [{"role": "user", "content": "hi"}], "stream": true}'
            req = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(req)  # the first: opens the upstream connection the second is sent on
            await _read_response(reader)
            writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(req)
            await writer.drain()
            writer.close()
            for _ in range(200):
                if len(sink.records) == 2:
                    break
                await asyncio.sleep(0.02)
            idle = list(server.proxy.client._idle)
            await server.close()
        return sink, served, idle, server.proxy.stats

    sink, served, idle, stats = run(main())
    assert served == ["/v1/chat/completions"] * 2
    assert [r.status for r in sink.records] == ["ok", "cancelled"]
    assert stats["upstream_errors"] == 0 and idle == []
