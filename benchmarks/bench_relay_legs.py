"""The relay's own cost per request, in one process, without the host's noise: a proxy
(``kvdoctor.collect.proxy.make_proxy``) driven through in-memory transports on a running event loop.

    python benchmarks/bench_relay_legs.py [--n 3000] [--warm] [--json out.json]

Per request, two legs are stamped, as ``bench_proxy.py`` sees them from outside:

* **request leg**: from the client's bytes handed to the proxy (``data_received``) to the proxy's
  write to the upstream connection;
* **first-chunk leg**: from the upstream's response head and first SSE chunk handed to the proxy to
  its write of that chunk to the client (the loop turn that wakes the relay and the head's write
  included);
* **chunk leg**: each of ``--events`` later reads, one SSE event each (a paced stream: an engine's
  decode step per read), through the proxy's read callback (its write to the client and whatever
  analysis it does there), the caches thrashed lightly (2 MiB) before each, as a core another
  process ran on since;
* **end leg**: from the response's last read to its record emitted (what was left of the analysis,
  the record built); ``per_event_us``: a request's chunk legs and end leg over its events, the
  relay's CPU per streamed event.

Variants run interleaved, request by request, so drift hits them alike: ``kvdoctor`` (as shipped: the
request parsed by llhttp, then sent from the read callback, and the response written from the
upstream's read callbacks, ``kvdoctor.collect.proxy.eager``) and ``task`` (the response written by
the handler's task once the loop wakes it). Between requests the CPU caches
are thrashed (a 32 MiB buffer walked), as on a host where the client, the engine and other processes
ran since the proxy last did: what the relay costs there is mostly cache misses, ~5x its warm cost.
``--warm`` leaves them warm. Prints P50/P90/P99 per leg and variant, in microseconds.

A benchmark of the relay's code, not of a deployment: ``bench_proxy.py`` measures the real
``kvdoctor attach --proxy`` over sockets against nginx.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.memory_transport import MemoryTransport  # noqa: E402
from kvdoctor.collect.proxy import eager, make_proxy  # noqa: E402
from kvdoctor.collect.proxy.http import ClientConnection, UpstreamConnection  # noqa: E402

BODY = (b'{"model":"m","stream":true,"max_tokens":2,"messages":[{"role":"user","content":'
        b'"Name three colours, then say why the sky is blue."}]}')
#: what aiohttp's client sends (bench_proxy's load generator)
REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:9000\r\nAccept: */*\r\n"
           b"Accept-Encoding: gzip, deflate\r\nUser-Agent: Python/3.11 aiohttp/3.9.5\r\n"
           b"Content-Length: %d\r\nContent-Type: application/json\r\n\r\n%s" % (len(BODY), BODY))


def _chunk(b: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(b), b)


FIRST = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
         b"Date: Thu, 03 Dec 2026 10:00:00 GMT\r\nServer: Python/3.11 aiohttp/3.9.5\r\n\r\n"
         + _chunk(b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,'
                  b'"delta":{"content":"Red"}}]}\n\n'))
REST = (_chunk(b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},'
               b'"finish_reason":"length"}],"usage":{"prompt_tokens":24,"completion_tokens":2}}\n\n')
        + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")


class _Sink:
    def emit(self, record: Any) -> None:
        self.last = record

    def source_status(self, name: str, ok: bool, detail: str = "") -> None:
        pass


_THRASH = bytearray(32 << 20)
_THRASH_LIGHT = bytearray(2 << 20)


def thrash() -> None:
    """Walk a buffer larger than the caches (one write per 64-byte line, in C)."""
    _THRASH[::64] = b"\x01" * (len(_THRASH) // 64)


def thrash_light() -> None:
    """Walk a buffer larger than a core's own caches (L1, L2), not the shared L3."""
    _THRASH_LIGHT[::64] = b"\x02" * (len(_THRASH_LIGHT) // 64)


def later_chunk(i: int) -> bytes:
    return _chunk(b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,'
                  b'"delta":{"content":" w%d"},"finish_reason":null}]}\n\n' % i)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


async def run(n: int, warm: bool, events: int) -> dict[str, dict[str, float]]:
    loop = asyncio.get_running_loop()
    server = make_proxy("http://127.0.0.1:9", _Sink())
    proxy = server.proxy
    client = ClientConnection(server)
    client.connection_made(MemoryTransport(keep=False))
    up = UpstreamConnection(loop)
    up.connection_made(MemoryTransport(keep=False))
    up.used = True
    variants = ("kvdoctor", "task")
    eager_head = eager.EagerRelay.head
    legs: dict[str, dict[str, list[float]]] = {v: {"request": [], "first_chunk": [], "chunk": [], "end": [],
                                                    "per_event": []} for v in variants}
    chunks = [later_chunk(k) for k in range(events)]
    for i in range(n + 44):  # the first 44: warm-up, not counted
        variant = variants[i % len(variants)]
        # "task": the hook does nothing, so the task starts the head and writes every chunk
        eager.EagerRelay.head = (lambda self, up: None) if variant == "task" else eager_head  # type: ignore
        up.idle_since = time.monotonic()
        up.transport = MemoryTransport(keep=False)  # type: ignore[assignment]
        proxy.client._idle.append(up)
        client.transport = MemoryTransport(mark=b"Red", keep=False)  # the first content chunk, not the head
        if not warm:
            thrash()
        t0 = time.perf_counter()
        client.data_received(REQUEST)
        t_up = up.transport.first_write_s  # type: ignore[union-attr]
        for _ in range(3):  # the handler's task runs up to its wait for the response head
            await asyncio.sleep(0)
        if not warm:
            thrash()
        t1 = time.perf_counter()
        up.data_received(FIRST)
        while client.transport.first_write_s is None:
            await asyncio.sleep(0)
        t_client = client.transport.first_write_s
        chunk_us = []
        for c in chunks:
            if not warm:
                thrash_light()
            t2 = time.perf_counter()
            up.data_received(c)
            chunk_us.append((time.perf_counter() - t2) * 1e6)
            await asyncio.sleep(0)
        if not warm:
            thrash_light()
        t3 = time.perf_counter()
        up.data_received(REST)
        while server.busy:
            await asyncio.sleep(0)
        end_us = (time.perf_counter() - t3) * 1e6
        if t_up is None or up not in proxy.client._idle:
            raise SystemExit(f"request {i} ({variant}) did not go through the pooled connection")
        proxy.client._idle.remove(up)
        if i >= 44:
            legs[variant]["request"].append((t_up - t0) * 1e6)
            legs[variant]["first_chunk"].append((t_client - t1) * 1e6)
            legs[variant]["chunk"] += chunk_us
            legs[variant]["end"].append(end_us)
            legs[variant]["per_event"].append((sum(chunk_us) + end_us) / (events + 1))
    eager.EagerRelay.head = eager_head  # type: ignore[method-assign]
    if proxy.stats["records"] != n + 44:
        raise SystemExit(f"unexpected proxy stats: {proxy.stats}")
    return {v: {f"{leg}_p{q}_us": round(pct(xs, q), 1) for leg, xs in d.items() for q in (50, 90, 99)}
            for v, d in legs.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=3000, help="requests, all variants together (default 3000)")
    ap.add_argument("--warm", action="store_true", help="leave the CPU caches warm between requests")
    ap.add_argument("--events", type=int, default=32, help="later one-event reads per response (default 32)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    try:
        import uvloop  # the loop kvdoctor attach runs on
        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency
        runner = asyncio.run
    out = runner(run(args.n, args.warm, args.events))
    print(f"relay legs, in-process, {args.n} requests, caches {'warm' if args.warm else 'thrashed'} (us)")
    names = list(out)
    print(f"{'':22}" + "".join(f"{v:>10}" for v in names))
    for c in next(iter(out.values())):
        print(f"{c:22}" + "".join(f"{out[v][c]:>10}" for v in names))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
