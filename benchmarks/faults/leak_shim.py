"""A serving front process that leaks: it relays every request to the engine unchanged (streams
included) and keeps ``leak_kib`` KiB per request forever, so its resident memory grows in a
straight line at flat load. kvdoctor watches this process as the server (``attach --pid``).

    python -m benchmarks.faults.leak_shim UPSTREAM_URL PORT LEAK_KIB
"""
from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

_KEPT: list[bytearray] = []


def app(upstream: str, leak_kib: int) -> web.Application:
    session: dict = {}

    async def start(_app):
        # force_close: llama-server may drop a keep-alive connection after a stream (harness/loadgen.py)
        session["s"] = ClientSession(timeout=ClientTimeout(total=600), connector=TCPConnector(force_close=True))

    async def stop(_app):
        await session["s"].close()

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.path.startswith("/v1/"):
            _KEPT.append(bytearray(leak_kib * 1024))  # never freed: the leak
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with session["s"].request(request.method, upstream + request.path_qs, data=body, headers=headers) as up:
            resp = web.StreamResponse(status=up.status, headers={
                k: v for k, v in up.headers.items() if k.lower() in ("content-type", "x-request-id")})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    a = web.Application()
    a.on_startup.append(start)
    a.on_cleanup.append(stop)
    a.router.add_route("*", "/{tail:.*}", relay)
    return a


@contextlib.contextmanager
def running(upstream: str, leak_kib: int):
    """The shim in a process of its own; yields (its url, its pid)."""
    from harness.server_base import free_port, wait_listening

    port = free_port()
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.faults.leak_shim", upstream, str(port), str(leak_kib)],
                            cwd=root)
    try:
        wait_listening(port, 20.0, proc, "the leak shim not")
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    web.run_app(app(sys.argv[1], int(sys.argv[3])), host="127.0.0.1", port=int(sys.argv[2]), print=None)
