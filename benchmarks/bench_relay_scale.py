#!/usr/bin/env python3
"""The sidecar at an H200's stream rates: many concurrent SSE streams through ``kvdoctor attach``
and through nginx, CPU per relayed event and the delay each adds, in the same run.

    .venv/bin/python benchmarks/bench_relay_scale.py [--streams 64,256,1024] [--modes paced,unpaced]
        [--measure-s 4] [--rounds 2] [--workers 1] [--json out.json]

An H200 serving 256-1,024 streams at ~100 tokens/s each puts 25k-100k SSE events/s through the
proxy. Here a fake upstream (its own process, uvloop, a single timer for all the streams) serves streaming
chat completions of ``--events`` (100) events each, vLLM-shaped (~230 bytes, one HTTP chunk per
event), each stamped with its send time; a client (this process, uvloop) keeps ``S`` streams
going, each a keep-alive connection that asks for the next completion as soon as one ends.

* **paced**: each stream's events come ``--gap-ms`` (5-20) ms apart, drawn uniformly per event,
  like an engine's decode steps; on time as long as the upstream keeps up (a late event is sent at
  once, so a machine that cannot keep up shows as fewer events/s, not as added delay).
* **unpaced**: the upstream writes each stream's next event as fast as the stream takes them
  (round robin over the streams, one event per stream per pass, waiting on no stream that is
  full): the most a target can carry, with as many events per read as its lag makes.

Targets, each its own process tree: ``direct`` (the upstream alone: the baseline for delay),
``attach`` (``kvdoctor attach --proxy``: relay, capture writer, live worker, /metrics scrape of a
real vLLM page every second, host sampler; ``--workers 2,..`` adds ``attach-w2`` ... with that many
relay processes), ``nginx`` (``proxy_buffering off``, one worker process, keepalive upstream). For
every level (streams x mode) the targets take turns (``--rounds`` times, the order reversed every
round), each phase ``--warmup-s`` then ``--measure-s`` measured; the figures of a target are over
its phases together.

Per target and level:

* ``events_s``: events the client received per second of the measured windows;
* ``cpu_us_per_event``: CPU time (user + system) of the target's whole process tree over the
  windows (psutil: the process and every descendant), per event received; ``per_core_events_s`` is
  its inverse (events one core would carry at that cost), ``ratio`` attach's over nginx's;
* ``delay_p50/p99_ms``: per event, receive time minus the upstream's send stamp; ``added_*``: the
  same minus ``direct``'s at that level;
* ``itl_p99_ms``: the gap between successive events of one response at the client (events of one
  read: 0); ``added_itl_p99_ms``: minus ``direct``'s.

The goal (issue 33, paced): attach <= 3x nginx's CPU per event, >= 50k events/s per core, and at
256 streams an added per-event delay (P99) within 1 ms of nginx's. Only 127.0.0.1 is used; every
loop is bounded in count and time. The host's load average is printed at the start and the end:
on a shared 2-core host the client and the upstream compete with the target for the same cores,
which the figures of every target carry alike.
"""
from __future__ import annotations

import argparse
import array
import asyncio
import heapq
import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httptools  # noqa: E402
import orjson  # noqa: E402
import psutil  # noqa: E402

from harness.nginx import write_conf  # noqa: E402
from harness.server_base import free_port  # noqa: E402

METRICS_PAGE = ROOT / "tests" / "data" / "metrics" / "vllm-0.32-cpu-under-load.prom"

NGINX_SERVER = """
    upstream up {{ server 127.0.0.1:{up_port}; keepalive 1024; }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://up;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 300s;
        }}
    }}
"""

#: the send stamp every event carries (the client reads it back with one regular expression a read)
STAMP = re.compile(rb'"t":([0-9]+\.[0-9]+)')


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 16384)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def _uvloop_run(coro: Any) -> Any:
    import uvloop

    return uvloop.run(coro)


# --------------------------------------------------------------------------- the fake upstream

_HEAD_SSE = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"


class _Upstream:
    """Every stream's timer in one heap; unpaced streams served round robin."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.heap: list[tuple[float, int, Any]] = []
        self.seq = 0
        self.timer: asyncio.Handle | None = None
        self.timer_due = 0.0
        self.unpaced: set[Any] = set()
        self.pass_scheduled = False
        self.in_tick = False
        self.page = METRICS_PAGE.read_bytes() if METRICS_PAGE.exists() else b""

    # paced ------------------------------------------------------------------------------------
    def at(self, due: float, stream: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (due, self.seq, stream))
        if self.in_tick:  # the tick sets the next timer once it is done
            return
        if self.timer is None or due < self.timer_due:
            if self.timer is not None:
                self.timer.cancel()
            self.timer_due = due
            self.timer = self.loop.call_at(due, self._tick)

    def _tick(self) -> None:
        self.timer = None
        now = self.loop.time()
        heap = self.heap
        self.in_tick = True
        try:
            while heap and heap[0][0] <= now + 0.0002:
                _, _, s = heapq.heappop(heap)
                s.next_event()
        finally:
            self.in_tick = False
        if heap:
            self.timer_due = max(heap[0][0], now + 0.0005)
            self.timer = self.loop.call_at(self.timer_due, self._tick)

    # unpaced ----------------------------------------------------------------------------------
    def ready(self, stream: Any) -> None:
        self.unpaced.add(stream)
        if not self.pass_scheduled:
            self.pass_scheduled = True
            self.loop.call_soon(self._pass)

    def _pass(self) -> None:
        self.pass_scheduled = False
        wrote = False
        for s in list(self.unpaced):
            if s.paused:
                continue
            s.next_event()
            wrote = True
        if wrote and self.unpaced:
            self.pass_scheduled = True
            self.loop.call_soon(self._pass)


class _UpConn(asyncio.Protocol):
    def __init__(self, up: _Upstream) -> None:
        self.up = up
        self.parser = httptools.HttpRequestParser(self)
        self.transport: Any = None
        self.paused = False
        self.closed = False
        self._body: list[bytes] = []
        self._url = b""
        self.left = 0
        self.k = 0
        self.gap = (0.005, 0.02)
        self.rng = random.Random()
        self.paced = True
        self.prefix = b""
        self.due = 0.0

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def connection_lost(self, exc: Any) -> None:
        self.closed = True
        self.up.unpaced.discard(self)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.left > 0 and not self.paced:
            self.up.ready(self)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            print(f"upstream: a request it cannot parse ({e}; {e.__context__!r}): {data[:200]!r}", file=sys.stderr, flush=True)
            self.transport.close()

    def on_message_begin(self) -> None:
        self._body, self._url = [], b""

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        path = self._url.split(b"?")[0]
        if path == b"/v1/chat/completions":
            self._stream(orjson.loads(b"".join(self._body)))
        elif path == b"/metrics" and self.up.page:
            self._plain(200, self.up.page, b"text/plain; version=0.0.4")
        elif path == b"/health":
            self._plain(200, b'{"status":"ok"}', b"application/json")
        else:
            self._plain(404, b'{"error":{"message":"not found","code":404}}', b"application/json")

    def _plain(self, status: int, body: bytes, ctype: bytes) -> None:
        self.transport.write(b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s"
                             % (status, b"OK" if status == 200 else b"Not Found", ctype, len(body), body))

    def _stream(self, req: dict) -> None:
        self.left = int(req.get("max_tokens", 100))
        self.k = 0
        gap = req.get("gap_ms")
        self.paced = gap is not None
        self.rng.seed(req.get("seed", 0))
        if gap is not None:
            self.gap = (gap[0] / 1000.0, gap[1] / 1000.0)
        rid = req.get("seed", 0)
        self.prefix = (b'data: {"id":"chatcmpl-%d","object":"chat.completion.chunk","created":1700000000,'
                       b'"model":"fake-model","choices":[{"index":0,"delta":{"content":"' % rid)
        self.transport.write(_HEAD_SSE)
        if self.paced:
            self.due = self.up.loop.time() + self.rng.uniform(*self.gap)
            self.up.at(self.due, self)
        else:
            self.up.ready(self)

    def next_event(self) -> None:
        if self.closed or self.left <= 0:
            self.up.unpaced.discard(self)
            return
        self.left -= 1
        self.k += 1
        t = time.time()
        if self.left:
            ev = self.prefix + b'tok%d "},"logprobs":null,"finish_reason":null}],"t":%.6f}\n\n' % (self.k, t)
            self.transport.write(b"%x\r\n%s\r\n" % (len(ev), ev))
            if self.paced:
                self.due = max(self.due + self.rng.uniform(*self.gap), self.up.loop.time())
                self.up.at(self.due, self)
            return
        # the last event: finish reason and usage, then [DONE] and the end of the body
        ev = (self.prefix + b'"},"logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":12,'
              b'"completion_tokens":%d,"total_tokens":%d},"t":%.6f}\n\ndata: [DONE]\n\n' % (self.k, self.k + 12, t))
        self.transport.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(ev), ev))
        self.up.unpaced.discard(self)


async def _upstream_main(port: int) -> None:
    loop = asyncio.get_running_loop()
    up = _Upstream(loop)
    server = await loop.create_server(lambda: _UpConn(up), "127.0.0.1", port, backlog=4096, reuse_address=True)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await asyncio.wait_for(stop.wait(), 3600)
    server.close()


# --------------------------------------------------------------------------- the client

class _Phase:
    """What one phase (a target at a level) measured."""

    def __init__(self) -> None:
        self.measuring = False
        self.running = True
        self.events = 0
        self.requests = 0
        self.bad = 0
        self.delay = array.array("d")
        self.itl = array.array("d")
        self.req_s = array.array("d")


class _Stream(asyncio.Protocol):
    def __init__(self, phase: _Phase, k: int, events: int, gap_ms: tuple[float, float] | None,
                 done: asyncio.Future) -> None:
        self.phase = phase
        self.k = k
        self.events = events
        self.gap_ms = gap_ms
        self.done = done
        self.transport: Any = None
        self.parser: Any = None
        self.parts: list[bytes] = []
        self.rest = b""
        self.last: float | None = None
        self.sent = 0.0
        self.complete = False
        self.n = 0
        self.seq = 0

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def connection_lost(self, exc: Any) -> None:
        if not self.done.done():
            if self.phase.running:
                self.phase.bad += 1
                if self.phase.bad <= 3:
                    print(f"  a connection closed mid-phase ({exc!r}) after {self.n} events", file=sys.stderr)
            self.done.set_result(None)

    def send(self) -> None:
        self.seq += 1
        body = orjson.dumps({"model": "fake-model", "stream": True, "max_tokens": self.events,
                             "gap_ms": self.gap_ms, "seed": self.k * 100000 + self.seq,
                             "messages": [{"role": "user", "content": f"stream {self.k} request {self.seq}: "
                                           "tell me about rivers, bread and clocks."}]})
        self.parser = httptools.HttpResponseParser(self)
        self.rest, self.last, self.complete, self.n = b"", None, False, 0
        self.sent = time.time()
        self.transport.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

    def on_body(self, body: bytes) -> None:
        self.parts.append(body)

    def on_message_complete(self) -> None:
        self.complete = True

    def data_received(self, data: bytes) -> None:
        now = time.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.phase.bad += 1
            self.transport.close()
            return
        ph = self.phase
        if self.parts:
            buf = self.rest + (self.parts[0] if len(self.parts) == 1 else b"".join(self.parts))
            self.parts.clear()
            cut = buf.rfind(b"\n\n") + 2
            whole, self.rest = buf[:cut], buf[cut:]
            stamps = STAMP.findall(whole)
            self.n += len(stamps)
            if stamps and ph.measuring:
                ph.events += len(stamps)
                ph.delay.extend(now - float(t) for t in stamps)
                itl = ph.itl
                if self.last is not None:
                    itl.append(now - self.last)
                for _ in range(len(stamps) - 1):
                    itl.append(0.0)
            if stamps:
                self.last = now
        if self.complete:
            if self.n != self.events or self.rest.strip() not in (b"", b"data: [DONE]"):
                ph.bad += 1
                if ph.bad <= 3:
                    print(f"  bad response: {self.n} events of {self.events}, rest {self.rest[-80:]!r}", file=sys.stderr)
            if ph.measuring:
                ph.requests += 1
                ph.req_s.append(now - self.sent)
            if ph.running:
                self.send()
            elif not self.done.done():
                self.done.set_result(None)


async def _open(base_port: int, phase: _Phase, n: int, events: int, gap_ms: tuple[float, float] | None
                ) -> list[_Stream]:
    loop = asyncio.get_running_loop()
    streams: list[_Stream] = []
    for i in range(0, n, 64):  # in batches: a listen backlog never overflows (a dropped SYN costs 1 s)
        batch = []
        for k in range(i, min(n, i + 64)):
            done = loop.create_future()
            batch.append(loop.create_connection(lambda k=k, done=done: _Stream(phase, k, events, gap_ms, done),
                                                "127.0.0.1", base_port))
        for _, s in await asyncio.gather(*batch):
            streams.append(s)
    return streams


def _tree_cpu(pid: int) -> tuple[float, float, float, float]:
    """CPU seconds of ``pid`` and every process below it, now (this process: only itself, the
    client; the targets are its children): (user, system, the main thread's share, the share of
    the processes below it)."""
    try:
        p = psutil.Process(pid)
        procs = [p] + (p.children(recursive=True) if pid != os.getpid() else [])
    except psutil.NoSuchProcess:
        return 0.0, 0.0, 0.0, 0.0
    user = system = main = below = 0.0
    for q in procs:
        try:
            c = q.cpu_times()
            user += c.user
            system += c.system
            if q.pid != pid:
                below += c.user + c.system
            else:
                main = sum(t.user_time + t.system_time for t in q.threads() if t.id == pid)
        except psutil.NoSuchProcess:
            pass
    return user, system, main, below


async def run_phase(port: int, pids: dict[str, int], n: int, mode: str, args: argparse.Namespace,
                    spy: tuple[int, str] | None = None) -> tuple[_Phase, dict[str, float], float]:
    """One target at one level: (what the client measured, CPU seconds per process tree in the
    window, the window's length in seconds). ``spy``: (pid, file) to sample with py-spy over the
    window (its own process: not in any tree measured, but its stops slow the target)."""
    phase = _Phase()
    gap = tuple(args.gap_ms) if mode == "paced" else None
    streams = await _open(port, phase, n, args.events, gap)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    spread = (gap[1] / 1000.0) if gap else 0.01
    for s in streams:  # staggered starts: the streams' events do not come in lockstep
        loop.call_later(random.random() * spread, s.send)
    await asyncio.sleep(args.warmup_s)
    sampler = None
    if spy is not None:
        sampler = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(spy[0]),
                                    "--subprocesses", "--rate", "250",
                                    # KVD_SPY_NATIVE=1: C frames too (the target is paused at each sample)
                                    *(["--native"] if os.environ.get("KVD_SPY_NATIVE") else ["--nonblocking"]), "--format", "raw",
                                    "--duration", str(int(args.measure_s)), "-o", spy[1]],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cpu0 = {k: _tree_cpu(p) for k, p in pids.items()}
    t0 = time.monotonic()
    phase.measuring = True
    await asyncio.sleep(args.measure_s)
    phase.measuring = False
    t1 = time.monotonic()
    cpu1 = {k: _tree_cpu(p) for k, p in pids.items()}
    phase.running = False
    if sampler is not None:
        await asyncio.get_running_loop().run_in_executor(None, sampler.wait)
    drain = (args.events * (gap[1] if gap else 1.0) / 1000.0) + 10.0
    try:
        await asyncio.wait_for(asyncio.gather(*(s.done for s in streams)), drain)
    except asyncio.TimeoutError:
        print(f"  ({sum(not s.done.done() for s in streams)} streams did not finish within {drain:.0f} s)", file=sys.stderr)
    for s in streams:
        if s.transport is not None:
            s.transport.close()
    await asyncio.sleep(0.3)
    cpu = {k: cpu1[k][0] + cpu1[k][1] - cpu0[k][0] - cpu0[k][1] for k in pids}
    cpu |= {k + ":sys": cpu1[k][1] - cpu0[k][1] for k in pids}
    cpu |= {k + ":main": cpu1[k][2] - cpu0[k][2] for k in pids}
    cpu |= {k + ":below": cpu1[k][3] - cpu0[k][3] for k in pids}
    return phase, cpu, t1 - t0


# --------------------------------------------------------------------------- processes

class Proc:
    def __init__(self, name: str, cmd: list[str], port: int, env: dict[str, str] | None = None,
                 cwd: str | None = None) -> None:
        self.name, self.cmd, self.port = name, cmd, port
        self.log = tempfile.NamedTemporaryFile(prefix=f"kvd-scale-{name}-", suffix=".log", delete=False)
        self.p = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  env=env, cwd=cwd, start_new_session=True)

    def wait_listening(self, timeout_s: float = 60.0) -> None:
        import socket

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {Path(self.log.name).read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"{self.name} did not listen on {self.port} within {timeout_s} s")

    def stop(self) -> None:
        died = self.p.poll() is not None
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()
        text = Path(self.log.name).read_text(errors="replace").strip()
        if text and (self.name == "upstream" or died):
            if died:
                print(f"{self.name} exited early ({self.p.returncode})", file=sys.stderr)
            print(f"{self.name} said: {text[-3000:]}", file=sys.stderr)
        Path(self.log.name).unlink(missing_ok=True)


def start_attach(upstream: str, tmp: Path, name: str, workers: int, extra: list[str], tree: str | None = None) -> Proc:
    """``kvdoctor attach --proxy`` in front of ``upstream``; ``tree``: run the kvdoctor of that source
    tree instead of this one (another commit, for a before/after in the same run)."""
    pport, lport = free_port(), free_port()
    cmd = [sys.executable, "-m", "kvdoctor", "attach", "--server", upstream, "--proxy", f"127.0.0.1:{pport}",
           "--listen", f"127.0.0.1:{lport}", "--gpu", "none", "--capture", str(tmp / f"cap-{name}"), "-q", *extra]
    if workers != 1:
        cmd += ["--workers", str(workers)]
    env = cwd = None
    if tree:
        # started in that tree: `python -m` puts the working directory ahead of PYTHONPATH, so from
        # here it would import this tree's kvdoctor whatever PYTHONPATH says
        cwd = str(Path(tree).resolve())
        env = dict(os.environ, PYTHONPATH=cwd)
    return Proc(name, cmd, pport, env=env, cwd=cwd)


# --------------------------------------------------------------------------- figures

def _pct(xs: Any, q: float) -> float | None:
    import numpy as np

    return float(np.percentile(np.frombuffer(xs, dtype=float), q)) if len(xs) else None


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000.0, 3)


def summarize(phases: dict[str, list[tuple[_Phase, dict[str, float], float]]], key: dict[str, str]
              ) -> dict[str, dict[str, Any]]:
    """Per target: its phases at one level together. ``key``: target -> the pids key of its tree."""
    out: dict[str, dict[str, Any]] = {}
    for name, runs in phases.items():
        ev = sum(p.events for p, _, _ in runs)
        wall = sum(w for _, _, w in runs)
        delay, itl, req = array.array("d"), array.array("d"), array.array("d")
        for p, _, _ in runs:
            delay.extend(p.delay)
            itl.extend(p.itl)
            req.extend(p.req_s)
        cpu = {k: sum(c[k] for _, c, _ in runs) for k in runs[0][1]}
        row: dict[str, Any] = {"events_s": round(ev / wall) if wall else 0,
                               "requests": sum(p.requests for p, _, _ in runs),
                               "bad": sum(p.bad for p, _, _ in runs),
                               "delay_p50_ms": _ms(_pct(delay, 50)), "delay_p99_ms": _ms(_pct(delay, 99)),
                               "itl_p99_ms": _ms(_pct(itl, 99)), "req_s_p50": round(_pct(req, 50) or 0, 3)}
        own = key.get(name)
        if own and ev:
            us = cpu[own] / ev * 1e6
            row["cpu_us_per_event"] = round(us, 2)
            row["sys_us_per_event"] = round(cpu[own + ":sys"] / ev * 1e6, 2)
            row["per_core_events_s"] = round(1e6 / us) if us > 0 else None
            row["target_cores"] = round(cpu[own] / wall, 2)
        if own and ev and name.startswith("attach"):
            # where in the tree: the event loop's thread, the process's other threads (capture
            # writer, sources), the processes below it (live step, /metrics parse, relay workers)
            row["main_thread_us"] = round(cpu[own + ":main"] / ev * 1e6, 2)
            row["other_threads_us"] = round((cpu[own] - cpu[own + ":main"] - cpu[own + ":below"]) / ev * 1e6, 2)
            row["child_procs_us"] = round(cpu[own + ":below"] / ev * 1e6, 2)
        if ev:
            row["upstream_us_per_event"] = round(cpu["upstream"] / ev * 1e6, 2)
            row["client_us_per_event"] = round(cpu["client"] / ev * 1e6, 2)
        out[name] = row
    d = out.get("direct")
    for name, row in out.items():
        if name == "direct" or d is None:
            continue
        for k in ("delay_p50_ms", "delay_p99_ms", "itl_p99_ms"):
            if row.get(k) is not None and d.get(k) is not None:
                row["added_" + k] = round(row[k] - d[k], 3)
        if "cpu_us_per_event" in row and "cpu_us_per_event" in out.get("nginx", {}) and name != "nginx":
            row["ratio_to_nginx"] = round(row["cpu_us_per_event"] / out["nginx"]["cpu_us_per_event"], 2)
    return out


COLUMNS = ("events_s", "cpu_us_per_event", "sys_us_per_event", "main_thread_us", "other_threads_us",
           "child_procs_us", "ratio_to_nginx", "per_core_events_s", "target_cores",
           "delay_p50_ms", "delay_p99_ms", "added_delay_p50_ms", "added_delay_p99_ms", "itl_p99_ms",
           "added_itl_p99_ms", "req_s_p50", "upstream_us_per_event", "client_us_per_event", "requests", "bad")


def print_level(title: str, rows: dict[str, dict[str, Any]]) -> None:
    names = list(rows)
    print(f"\n== {title}")
    print(f"{'':<24}" + "".join(f"{n:>12}" for n in names))
    for c in COLUMNS:
        if any(c in r for r in rows.values()):
            print(f"{c:<24}" + "".join(f"{'' if rows[n].get(c) is None else rows[n][c]:>12}" for n in names))


def verdict(levels: dict[str, dict[str, dict[str, Any]]], attach: str = "attach") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for lv, rows in levels.items():
        a, n = rows.get(attach), rows.get("nginx")
        if not a or "cpu_us_per_event" not in a:
            continue
        v: dict[str, Any] = {"per_core_ge_50k": (a.get("per_core_events_s") or 0) >= 50000}
        if n and "cpu_us_per_event" in n:
            v["cpu_le_3x_nginx"] = a["cpu_us_per_event"] <= 3 * n["cpu_us_per_event"]
            if lv.startswith("256 ") and "paced" in lv and "unpaced" not in lv:
                ad, nd = a.get("added_delay_p99_ms"), n.get("added_delay_p99_ms")
                if ad is not None and nd is not None:
                    v["delay_p99_within_1ms_of_nginx"] = ad - nd <= 1.0
        out[lv] = v
    return out


# --------------------------------------------------------------------------- main

async def _client_main(args: argparse.Namespace, targets: dict[str, int], pids: dict[str, int],
                       key: dict[str, str]) -> dict[str, Any]:
    levels: dict[str, dict[str, dict[str, Any]]] = {}
    raw: dict[str, Any] = {}
    deadline = time.monotonic() + args.max_duration
    dead: set[str] = set()
    for mode in args.modes:
        for n in args.streams:
            title = f"{n} streams, {mode}"
            phases: dict[str, list] = {t: [] for t in targets}
            order = [t for t in targets if t not in dead]
            for r in range(args.rounds):
                for t in (order[:] if r % 2 == 0 else order[::-1]):
                    if t in dead:
                        continue
                    if time.monotonic() > deadline:
                        break
                    spy = None
                    if args.py_spy and t.startswith("attach"):
                        Path(args.py_spy).mkdir(parents=True, exist_ok=True)
                        spy = (pids[t], str(Path(args.py_spy) / f"{t}-{n}-{mode}-r{r}.txt"))
                    try:
                        phases[t].append(await run_phase(targets[t], pids, n, mode, args, spy))
                    except OSError as e:  # a target that died: the others go on; its log is printed at the end
                        print(f"  {t}: {type(e).__name__}: {e} ({title}); left out from here", file=sys.stderr)
                        dead.add(t)
            phases = {t: ph for t, ph in phases.items() if ph}
            if not phases:
                continue
            levels[title] = summarize(phases, key)
            raw[title] = {t: [{"events": p.events, "cpu_s": c, "wall_s": w} for p, c, w in ph] for t, ph in phases.items()}
            print_level(title, levels[title])
    return {"levels": levels, "phases": raw}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="64,256,1024", help="concurrent streams per level (comma-separated)")
    ap.add_argument("--modes", default="paced,unpaced", help="paced, unpaced or both")
    ap.add_argument("--events", type=int, default=100, help="events per response")
    ap.add_argument("--gap-ms", default="5,20", help="paced: an event every LO-HI ms per stream")
    ap.add_argument("--warmup-s", type=float, default=1.0)
    ap.add_argument("--measure-s", type=float, default=4.0)
    ap.add_argument("--settle-s", type=float, default=7.0, help="seconds between the targets' start and the first phase")
    ap.add_argument("--rounds", type=int, default=2, help="turns per target at each level (order reversed each round)")
    ap.add_argument("--workers", default="1", help="attach targets by relay processes, e.g. 1,2 (attach, attach-w2)")
    ap.add_argument("--targets", default="direct,attach,nginx", help="of direct, attach, nginx")
    ap.add_argument("--attach-args", default="", help="more `kvdoctor attach` options, one string")
    ap.add_argument("--baseline-tree", metavar="DIR", help="also run the kvdoctor attach of this source tree (e.g. "
                    "`git archive main | tar -x -C DIR`) as target attach-before: a before/after in the same run")
    ap.add_argument("--max-duration", type=float, default=900.0, help="seconds, whole run")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--py-spy", metavar="DIR", help="sample each attach phase with py-spy (pip install py-spy) into "
                    "DIR (collapsed stacks; summarise with benchmarks/spy_summary.py)")
    ap.add_argument("--_upstream", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    _raise_fd_limit()
    if args._upstream:
        _uvloop_run(_upstream_main(args._upstream))
        return 0
    args.streams = [int(x) for x in args.streams.split(",")]
    args.modes = [m for m in args.modes.split(",") if m]
    args.gap_ms = [float(x) for x in args.gap_ms.split(",")]
    wanted = args.targets.split(",")
    workers = [int(x) for x in args.workers.split(",")]

    load0 = os.getloadavg()
    print(f"load average at the start: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} ({os.cpu_count()} cores)")
    tmp = Path(tempfile.mkdtemp(prefix="kvd-bench-scale-"))
    procs: list[Proc] = []
    result: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
                              "load_start": load0, "cores": os.cpu_count()}
    try:
        uport = free_port()
        up = Proc("upstream", [sys.executable, str(Path(__file__).resolve()), "--_upstream", str(uport)], uport)
        procs.append(up)
        up.wait_listening()
        upstream = f"http://127.0.0.1:{uport}"
        targets: dict[str, int] = {}
        pids: dict[str, int] = {"upstream": up.p.pid, "client": os.getpid()}
        key: dict[str, str] = {}
        if "direct" in wanted:
            targets["direct"] = uport
        if "attach" in wanted:
            for w in workers:
                name = "attach" if w == 1 else f"attach-w{w}"
                p = start_attach(upstream, tmp, name, w, args.attach_args.split())
                procs.append(p)
                targets[name] = p.port
        if args.baseline_tree:
            p = start_attach(upstream, tmp, "attach-before", 1, args.attach_args.split(), args.baseline_tree)
            procs.append(p)
            targets["attach-before"] = p.port
        if "nginx" in wanted:
            nport = free_port()
            cmd = write_conf(tmp, NGINX_SERVER.format(up_port=uport, port=nport))
            if cmd:
                procs.append(Proc("nginx", cmd, nport))
                targets["nginx"] = nport
            else:
                print("nginx not installed (apt-get install nginx-light): left out", file=sys.stderr)
        for p in procs:
            p.wait_listening()
            if p.name != "upstream":
                pids[p.name] = p.p.pid
                key[p.name] = p.name
        # the sidecars' first scrape and samples, and the live worker (spawned at the first live
        # step, 5 s in): its start is not what a relayed event costs
        time.sleep(args.settle_s)
        result.update(_uvloop_run(_client_main(args, targets, pids, key)))
    finally:
        for p in reversed(procs):
            p.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    load1 = os.getloadavg()
    result["load_end"] = load1
    result["verdict"] = {name: verdict(result.get("levels", {}), name) for name in targets if name.startswith("attach")}
    print(f"\nload average at the end: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    print("verdict:", json.dumps(result["verdict"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
