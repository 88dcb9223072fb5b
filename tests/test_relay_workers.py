"""`kvdoctor attach --workers N`: relay processes beside the agent's own on the proxy's address
(SO_REUSEPORT), their records in the one capture, their requests in flight in the live view, one
that dies started again (kvdoctor/sidecar/relay_workers.py). A real agent, real processes, real
sockets; a fake SSE upstream."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from contextlib import contextmanager

import aiohttp
import orjson
import pytest
from aiohttp import web

import kvdoctor
from harness.llama_server import free_port
from kvdoctor.sidecar.agent import Agent, AttachConfig

pytestmark = pytest.mark.skipif(not hasattr(socket, "SO_REUSEPORT"), reason="no SO_REUSEPORT (Linux, BSD)")


@contextmanager
def upstream():
    """An SSE upstream on a loop of its own: ``max_tokens`` events ``gap_s`` apart, then usage and [DONE]."""
    loop = asyncio.new_event_loop()
    port = free_port()

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(body["max_tokens"]):
            await asyncio.sleep(body.get("gap_s", 0.001))
            await resp.write(b"data: " + orjson.dumps({"model": "m", "choices": [{"delta": {"content": f"w{i} "}}]})
                             + b"\n\n")
        await resp.write(b'data: {"model":"m","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":%d}}\n\n'
                         b"data: [DONE]\n\n" % body["max_tokens"])
        return resp

    async def start():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    runner = loop.run_until_complete(start())
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)


@contextmanager
def running_agent(cfg: AttachConfig):
    agent = Agent(cfg)
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=lambda: loop.run_until_complete(agent.run()), daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while agent._proxy_server is None or (cfg.proxy_workers > 1 and agent.live.proxy is agent._proxy_server.proxy):
        assert time.monotonic() < deadline and t.is_alive(), "the agent's proxy did not start"
        time.sleep(0.05)
    try:
        yield agent
    finally:
        loop.call_soon_threadsafe(agent.stop)
        t.join(30)
        assert not t.is_alive(), "the agent did not stop"


async def streams(proxy: str, n: int, max_tokens: int, gap_s: float) -> list[tuple[int, bytes]]:
    # a connection per request: the kernel spreads connections, not requests, over the relays
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0)) as s:
        async def one(i: int) -> tuple[int, bytes]:
            body = {"model": "m", "stream": True, "max_tokens": max_tokens, "gap_s": gap_s,
                    "messages": [{"role": "user", "content": f"q{i}"}]}
            async with s.post(proxy + "/v1/chat/completions", json=body) as r:
                return r.status, await r.read()
        return await asyncio.gather(*(one(i) for i in range(n)))


def config(up: str, tmp_path, workers: int) -> tuple[AttachConfig, str]:
    port = free_port()
    cfg = AttachConfig(server_url=up, capture_dir=tmp_path / "cap", listen=None, proxy=f"127.0.0.1:{port}",
                       identify=False, proxy_workers=workers)
    return cfg, f"http://127.0.0.1:{port}"


def test_relay_processes_share_the_port_and_every_record_reaches_the_one_capture(tmp_path):
    with upstream() as up:
        cfg, proxy = config(up, tmp_path, 3)
        with running_agent(cfg) as agent:
            out = asyncio.run(streams(proxy, 60, 5, 0.002))
        # after the stop: each relay process sent its counters last
        own = agent._proxy_server.proxy.stats["records"]
        others = agent._relay_workers.stats.get("records", 0)
    assert [s for s, _ in out] == [200] * 60 and all(b.endswith(b"data: [DONE]\n\n") for _, b in out)
    # the kernel spread the 60 connections: the agent's own relay and its processes each took some
    assert 0 < own < 60 and own + others == 60, (own, others)
    cap = kvdoctor.load(tmp_path / "cap")
    assert len(cap.requests) == 60 and set(cap.requests.strings("status")) == {"ok"}
    assert set(cap.requests.num("output_tokens")) == {5}


def test_requests_in_flight_in_relay_processes_are_in_the_live_view(tmp_path):
    with upstream() as up:
        cfg, proxy = config(up, tmp_path, 2)
        with running_agent(cfg) as agent:
            async def main():
                task = asyncio.ensure_future(streams(proxy, 16, 8, 0.4))  # ~3.2 s each
                await asyncio.sleep(2.0)  # a state report (every second) from each relay process
                seen = agent.live.proxy.in_flight_records()
                await task
                return seen
            seen = asyncio.run(main())
            theirs = sum(1 for r in seen if r.request_id.startswith("in-flight-1-"))
    assert len(seen) == 16 and all(r.status == "in-flight" for r in seen)
    assert 0 < theirs < 16
    assert sum(r.first_token_s is not None for r in seen) == 16  # their first tokens came ~0.4 s in


def test_a_relay_process_that_dies_is_started_again(tmp_path):
    with upstream() as up:
        cfg, proxy = config(up, tmp_path, 2)
        with running_agent(cfg) as agent:
            workers = agent._relay_workers
            first = workers.workers[0].process.pid
            os.kill(first, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while not (workers.restarts == 1 and workers.workers[0].ready.done()
                       and workers.workers[0].process.pid != first):
                assert time.monotonic() < deadline, "no relay process was started again"
                time.sleep(0.1)
            out = asyncio.run(streams(proxy, 40, 3, 0.001))
        others = workers.stats.get("records", 0)
    assert [s for s, _ in out] == [200] * 40
    assert others > 0  # the new process relays
    assert len(kvdoctor.load(tmp_path / "cap").requests) == 40


def test_workers_without_a_proxy_is_one_line_and_exit_2(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "kvdoctor", "attach", "--server", "http://127.0.0.1:9", "--workers", "2",
                        "--capture", str(tmp_path / "cap")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == ["kvdoctor: error: --workers 2: relay processes need --proxy HOST:PORT"]
    assert not (tmp_path / "cap").exists()
