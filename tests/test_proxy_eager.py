"""The relay writing a response from the upstream's read callbacks (kvdoctor.collect.proxy.eager),
driven through in-memory transports so each step can be seen: what reaches the client before the
handler's task runs again, the hand-over to the task under back-pressure, a client that leaves."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import httptools

from harness.memory_transport import MemoryTransport as Transport
from kvdoctor.collect.base import ListSink
from kvdoctor.collect.proxy import make_proxy
from kvdoctor.collect.proxy.http import ClientConnection as ClientConn
from kvdoctor.collect.proxy.http import UpstreamConnection

BODY = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}'
REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY))
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def chunk(b: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(b), b)


def event(word: str) -> bytes:
    return b'data: {"choices":[{"delta":{"content":"%s"}}]}\n\n' % word.encode()


END = chunk(b'data: {"choices":[{"delta":{}}],"usage":{"prompt_tokens":5,"completion_tokens":4}}\n\n'
            b"data: [DONE]\n\n") + b"0\r\n\r\n"


class Body:
    """The client's view: the de-chunked body of what the proxy wrote."""

    def __init__(self) -> None:
        self.status, self.body, self.complete = 0, b"", False

    def on_body(self, b: bytes) -> None:
        self.body += b

    def on_message_complete(self) -> None:
        self.complete = True


def client_view(raw: bytes) -> Body:
    b = Body()
    p = httptools.HttpResponseParser(b)
    p.feed_data(bytes(raw))
    b.status = p.get_status_code()
    return b


async def relay(pieces: list[bytes], high_water: int | None = None, leave_after: int | None = None,
                settle: int = 3) -> tuple[Any, Transport, list[int], Any]:
    """One streamed request through a proxy on in-memory transports. ``pieces`` reach the proxy's
    upstream connection one read each; returns the proxy, the client transport, the client's byte
    count right after each read (before the loop runs again), and the upstream connection."""
    loop = asyncio.get_running_loop()
    server = make_proxy("http://127.0.0.1:9", ListSink())
    client = ClientConn(server)
    client.connection_made(Transport())
    ct = Transport(client, high_water)
    client.transport = ct
    up = UpstreamConnection(loop)
    up.connection_made(Transport())
    up.used, up.idle_since = True, time.monotonic()
    server.proxy.client._idle.append(up)
    client.data_received(REQUEST)  # sent on from the read callback (a pooled connection is idle)
    for _ in range(settle):  # the handler's task runs up to its wait for the head
        await asyncio.sleep(0)
    seen = []
    for i, p in enumerate(pieces):
        up.data_received(p)
        seen.append(len(ct.data))
        if leave_after is not None and i == leave_after:
            client.connection_lost(None)
        await asyncio.sleep(0)
        if high_water is not None and i >= len(pieces) // 2:
            ct.drain()  # the client reads again from the middle on (until then its buffer stays full)
    for _ in range(200):
        if not server.busy:
            break
        if high_water is not None:
            ct.drain()
        await asyncio.sleep(0)
    return server, ct, seen, up


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_head_and_each_chunk_reach_the_client_in_the_read_callback():
    words = ["Red", "green", "blue"]
    pieces = [HEAD + chunk(event(words[0]))] + [chunk(event(w)) for w in words[1:]] + [END]
    server, ct, seen, _ = run(relay(pieces))
    # each read's bytes were with the client before the loop ran again (no task wake-up between)
    view_first = client_view(bytes(ct.data[:seen[0]]))
    assert view_first.status == 200 and view_first.body == event("Red")
    for i in range(1, 3):
        assert client_view(bytes(ct.data[:seen[i]])).body == b"".join(event(w) for w in words[:i + 1])
    view = client_view(bytes(ct.data))
    assert view.complete and view.body.endswith(b"data: [DONE]\n\n")
    (rec,) = server.proxy.sink.records
    assert rec.status == "ok" and rec.output_tokens == 4 and rec.ttft_s is not None and rec.ttft_s >= 0
    assert len(rec.itl_s) == 2


def test_chunks_of_one_read_share_its_timestamp():
    """Two events in one read reach the client together: their gap is 0, as the client sees it."""
    pieces = [HEAD + chunk(event("Red")), chunk(event("green")) + chunk(event("blue")), END]
    server, ct, seen, _ = run(relay(pieces))
    assert client_view(bytes(ct.data[:seen[1]])).body == event("Red") + event("green") + event("blue")
    (rec,) = server.proxy.sink.records
    assert rec.itl_s[0] > 0 and rec.itl_s[1] == 0.0


def test_a_head_before_the_task_waits_is_left_to_the_task():
    """The answer came before the handler's task ran: nothing was hooked, the task relays it all."""
    pieces = [HEAD + chunk(event("Red")), END]
    server, ct, seen, _ = run(relay(pieces, settle=0))
    assert seen[0] == 0  # not written from the callback
    view = client_view(bytes(ct.data))
    assert view.complete and view.body.startswith(event("Red"))
    assert [r.status for r in server.proxy.sink.records] == ["ok"]


def test_a_full_client_buffer_hands_the_rest_to_the_task_in_order():
    words = [f"w{i:03d}" + "x" * 200 for i in range(40)]
    pieces = [HEAD] + [chunk(event(w)) for w in words] + [END]
    server, ct, seen, _ = run(relay(pieces, high_water=2000))
    view = client_view(bytes(ct.data))
    assert view.complete
    assert view.body == b"".join(event(w) for w in words) + \
        b'data: {"choices":[{"delta":{}}],"usage":{"prompt_tokens":5,"completion_tokens":4}}\n\ndata: [DONE]\n\n'
    # past the high-water mark the callbacks stopped writing (reads that added nothing at once):
    # the task wrote the rest, in order, once the client read again
    assert any(seen[i] == seen[i - 1] for i in range(1, len(seen)))
    (rec,) = server.proxy.sink.records
    assert rec.status == "ok" and len(rec.itl_s) == len(words) - 1


def test_a_client_that_leaves_mid_stream_is_recorded_cancelled_and_the_upstream_cut():
    pieces = [HEAD + chunk(event("Red"))] + [chunk(event("more")) for _ in range(5)] + [END]
    server, ct, seen, up = run(relay(pieces, leave_after=1))
    assert seen[2] == seen[1]  # nothing written once it left
    (rec,) = server.proxy.sink.records
    assert rec.status == "cancelled"
    assert up.transport.closing  # the upstream sees the client go away
