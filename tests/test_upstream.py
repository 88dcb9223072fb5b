"""The proxy's own HTTP/1.1 upstream client (kvdoctor/collect/proxy/http/client.py), through the proxy:
the response shapes a server may send that the relay must pass on as they are (a body that ends
with the connection, a HEAD answer, an interim 103 before the answer), a path the upstream URL
carries, and a slow client that must not make the proxy buffer the whole response."""
from __future__ import annotations

import asyncio
import tracemalloc

import aiohttp
from aiohttp import web
from test_proxy import CHAT_BODY, RawUpstream, Started, run

from kvdoctor.collect.proxy import http as upstreammod
from kvdoctor.collect.base import ListSink
from kvdoctor.collect.proxy import make_proxy


async def _through(head: bytes, pieces: list[bytes], method: str = "POST", path: str = "/v1/chat/completions",
                   prefix: str = "") -> tuple[int, dict, bytes, list[bytes], ListSink]:
    sink = ListSink()
    upstream = RawUpstream(head, pieces, pause_s=0.01)
    async with upstream as up:
        async with Started(make_proxy(up + prefix, sink)) as px:
            async with aiohttp.ClientSession(auto_decompress=False) as s:
                kw = {"json": CHAT_BODY} if method == "POST" else {}
                async with s.request(method, px + path, **kw) as r:
                    return r.status, dict(r.headers), await r.read(), upstream.requests, sink


def test_a_body_that_ends_with_the_connection_is_relayed_whole():
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n"  # no length, not chunked
    pieces = [b'{"choices": [{"message": {"content": "hel', b'lo"}}], ', b'"usage": {"completion_tokens": 2}}']
    status, _, body, _, sink = run(_through(head, pieces))
    assert status == 200 and body == b"".join(pieces)
    (rec,) = sink.records
    assert rec.status == "ok" and rec.output_tokens == 2


def test_a_head_answer_has_no_body_whatever_its_length_says():
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1234\r\n\r\n"
    status, headers, body, requests, _ = run(_through(head, [], method="HEAD", path="/health"), timeout=10)
    assert status == 200 and body == b"" and headers["Content-Length"] == "1234"
    assert requests[0].startswith(b"HEAD /health HTTP/1.1\r\n")


def test_an_interim_103_is_skipped_and_the_answer_relayed():
    head = (b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Final: yes\r\nContent-Length: 2\r\n\r\nok")
    status, headers, body, _, _ = run(_through(head, []))
    assert status == 200 and body == b"ok" and headers["X-Final"] == "yes" and "Link" not in headers


def test_a_path_on_the_upstream_url_goes_before_every_request_path():
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    status, _, _, requests, _ = run(_through(head, [], method="GET", path="/v1/models?x=1", prefix="/engine/"))
    assert status == 200 and requests[0].startswith(b"GET /engine/v1/models?x=1 HTTP/1.1\r\n")


def test_a_slow_client_pauses_the_upstream_instead_of_filling_the_proxy():
    """A 48 MiB answer read slowly: the proxy holds at most about its high-water mark, not the
    answer (traced Python allocations of the proxy and this client together)."""
    size = 48 << 20
    block = bytes(range(256)) * 4096  # 1 MiB

    async def big(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream",
                                           "Content-Length": str(size)})
        await resp.prepare(request)
        for _ in range(size >> 20):
            await resp.write(block)
        await resp.write_eof()
        return resp

    async def main() -> tuple[int, int]:
        app = web.Application()
        app.router.add_get("/big", big)
        async with Started(app) as up, Started(make_proxy(up, ListSink())) as px:
            tracemalloc.start()
            n = 0
            async with aiohttp.ClientSession() as s:
                async with s.get(px + "/big") as r:
                    while chunk := await r.content.read(256 << 10):
                        n += len(chunk)
                        await asyncio.sleep(0.002)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        return n, peak

    n, peak = run(main(), timeout=120)
    assert n == size
    # ~5 MiB measured with the 1 MiB high-water mark; ~106 MiB when the upstream is never paused
    assert upstreammod.HIGH_WATER_BYTES <= 1 << 20
    assert peak < 12 << 20, f"peak {peak >> 20} MiB for a {size >> 20} MiB answer"
