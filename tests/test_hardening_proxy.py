"""Hardening of the streaming proxy (issue 14, points 5 and 6): a malformed upstream answer is a
502 JSON error and an error record with one log line, not aiohttp's 500 and a traceback; an SSE
event that never ends is parsed in linear time and given up past a bound, the bytes still relayed."""
from __future__ import annotations

import logging
import time

import aiohttp
import orjson
import pytest
from test_proxy import CHAT_BODY, RawUpstream, Started, _chat_events, _chunked, run

from kvdoctor.collect.proxy import sse as proxymod
from kvdoctor.collect.base import ListSink
from kvdoctor.collect.proxy import MAX_SSE_EVENT_BYTES, make_proxy

MALFORMED = {
    "bad-status-line": b"HTTP/1.1 abc Nope\r\nContent-Length: 0\r\n\r\n",
    "garbage": b"\x16\x03\x01 this is not http at all\r\n\r\n",
    "oversized-header": b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 100_000 + b"\r\nContent-Length: 0\r\n\r\n",
    "too-many-headers": b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(20_000))
                        + b"Content-Length: 0\r\n\r\n",
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_a_malformed_upstream_answer_is_a_502_json_error_and_a_record(name, caplog):
    async def main():
        sink = ListSink()
        async with RawUpstream(MALFORMED[name], [], pause_s=0.01) as up:
            async with Started(make_proxy(up, sink)) as px:
                async with aiohttp.ClientSession() as s:
                    async with s.post(px + "/v1/chat/completions", json=CHAT_BODY) as r:
                        return sink, r.status, r.headers.get("Content-Type"), await r.read()

    with caplog.at_level(logging.DEBUG):
        sink, status, ctype, body = run(main())
    assert status == 502 and ctype == "application/json"
    err = orjson.loads(body)["error"]
    assert err["code"] == 502 and err["message"].startswith("upstream_error: malformed response")
    (rec,) = sink.records
    assert rec.status == "error" and rec.error.startswith("upstream_error") and rec.http_status == 502
    assert sink.status["proxy"][0] is False
    ours = [r for r in caplog.records if r.name.startswith(("kvdoctor", "aiohttp"))]  # not the fake upstream's
    assert not any(r.exc_info for r in ours), [r.getMessage() for r in ours if r.exc_info]
    assert not any("Error handling request" in r.getMessage() for r in ours)


def _feed_seconds(total_bytes: int, chunk_bytes: int = 4096) -> float:
    an = proxymod.StreamAnnotator("chat", time.time(), False)
    an.start(200, "text/event-stream")
    chunk = b"data: " + b"x" * (chunk_bytes - 6)
    t0 = time.perf_counter()
    for _ in range(total_bytes // chunk_bytes):
        an.feed(chunk, 0.0)
    return time.perf_counter() - t0


def test_an_sse_event_without_its_blank_line_is_parsed_in_linear_time():
    small, large = 1 << 20, 4 << 20  # both under the give-up bound
    t_small = min(_feed_seconds(small) for _ in range(3))
    t_large = min(_feed_seconds(large) for _ in range(3))
    # linear: 4x the bytes, ~4x the time; the former re-copying was quadratic (~16x)
    assert t_large < 8 * t_small + 0.02, (t_small, t_large)


def test_an_endless_sse_event_is_given_up_but_every_byte_is_relayed(caplog):
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    piece = b"data: " + b"y" * (1 << 20)
    pieces = [piece] * (MAX_SSE_EVENT_BYTES // len(piece) + 2) + [b"\n\n"]
    payload = b"".join(pieces)

    async def main():
        sink = ListSink()
        async with RawUpstream(head, _chunked(pieces), pause_s=0.001) as up:
            async with Started(make_proxy(up, sink)) as px:
                async with aiohttp.ClientSession() as s:
                    async with s.post(px + "/v1/chat/completions", json=CHAT_BODY) as r:
                        assert r.status == 200 and await r.read() == payload
        return sink

    with caplog.at_level(logging.WARNING, logger="kvdoctor.proxy"):
        sink = run(main())
    assert sink.records == []  # not analysed: said once in the log
    assert sum("without its blank line" in r.getMessage() for r in caplog.records) == 1


def test_crlf_split_across_chunks_still_parses():
    payload = _chat_events(["a ", "b ", "c "]).replace(b"\n", b"\r\n")
    an = proxymod.StreamAnnotator("chat", time.time(), False)
    an.start(200, "text/event-stream")
    for i in range(0, len(payload), 7):  # splits land between \r and \n many times
        an.feed(payload[i:i + 7], float(i))
    an.end(float(len(payload)))
    assert an.n_content == 3 and an.saw_done


# -- 6. OTLP receiver limits --------------------------------------------------------------------
def test_otlp_gzip_bomb_and_oversized_export_are_413_and_the_receiver_goes_on():
    import gzip

    from google.rpc import status_pb2
    from test_otlp_receiver import Receiver, captured_request, post

    from kvdoctor.collect.otlp_receiver import MAX_BODY_BYTES, MAX_INFLATED_BYTES

    r = Receiver()
    try:
        bomb = gzip.compress(b"\0" * (MAX_INFLATED_BYTES + (1 << 20)), 9)  # ~33 MiB of zeros in ~33 KiB
        assert len(bomb) < 100_000
        status, _, out = post(r.url, bomb, "application/x-protobuf", "gzip")
        assert status == 413 and "inflates to more than" in status_pb2.Status.FromString(out).message
        status, _, out = post(r.url, b"\n" * (MAX_BODY_BYTES + 1), "application/x-protobuf")
        assert status == 413 and "over the 8 MiB limit" in status_pb2.Status.FromString(out).message
        ok = post(r.url, gzip.compress(captured_request().SerializeToString()), "application/x-protobuf", "gzip")
        assert ok[0] == 200 and len(r.sink.records) > 0
    finally:
        r.close()


def test_a_huge_request_body_is_streamed_upstream_not_held(tmp_path):
    """64 MiB posted through the proxy: the upstream gets every byte, the proxy never holds it
    whole (traced Python allocations stay far below the body's size), and a record is kept."""
    import hashlib
    import tracemalloc

    from aiohttp import web

    size = 64 << 20
    got = {}

    async def upstream(request):
        h, n = hashlib.sha256(), 0
        async for chunk in request.content.iter_any():
            h.update(chunk)
            n += len(chunk)
        got.update(n=n, sha=h.hexdigest(), length=request.headers.get("Content-Length"))
        return web.json_response({"choices": [{"message": {"content": "ok"}}], "usage": {"completion_tokens": 1}})

    async def body():
        for i in range(size >> 20):
            yield bytes([i % 251]) * (1 << 20)

    expected = hashlib.sha256(b"".join(bytes([i % 251]) * (1 << 20) for i in range(size >> 20))).hexdigest()

    async def main():
        sink = ListSink()
        app = web.Application(client_max_size=size * 2)
        app.router.add_post("/v1/chat/completions", upstream)
        async with Started(app) as up, Started(make_proxy(up, sink)) as px:
            tracemalloc.start()
            async with aiohttp.ClientSession() as s:
                async with s.post(px + "/v1/chat/completions", data=body(),
                                  headers={"Content-Length": str(size), "Content-Type": "application/json"}) as r:
                    assert r.status == 200
                    await r.read()
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        return sink, peak

    sink, peak = run(main(), timeout=120)
    assert got == {"n": size, "sha": expected, "length": str(size)}
    assert peak < size / 4, f"peak {peak >> 20} MiB for a {size >> 20} MiB body"
    (rec,) = sink.records
    assert rec.status == "ok" and rec.prompt_tokens is None


def test_a_wall_clock_step_mid_request_does_not_bend_its_timings(monkeypatch):
    """A wall clock stepped while a request streams (NTP, or a VM snapshot resumed: seen once in
    a full run, +15.4 s) must not reach the record: its stamps are its wall-clock arrival plus
    monotonic time since. The upstream steps the clock 100 s ahead after sending the head."""
    import asyncio

    from aiohttp import web

    real_time = time.time

    async def upstream(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(0.05)
        monkeypatch.setattr(time, "time", lambda: real_time() + 100.0)
        await resp.write(_chat_events(["a ", "b ", "c "]))
        await resp.write_eof()
        return resp

    async def main():
        sink = ListSink()
        app = web.Application()
        app.router.add_post("/v1/chat/completions", upstream)
        t0 = real_time()
        async with Started(app) as up, Started(make_proxy(up, sink)) as px:
            async with aiohttp.ClientSession() as s:
                async with s.post(px + "/v1/chat/completions", json=CHAT_BODY) as r:
                    await r.read()
        return sink, t0

    sink, t0 = run(main())
    (rec,) = sink.records
    assert rec.status == "ok" and abs(rec.arrival_s - t0) < 5
    assert 0.04 < rec.ttft_s < 5 and 0.04 < rec.e2e_s < 5, (rec.ttft_s, rec.e2e_s)
