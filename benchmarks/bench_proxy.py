#!/usr/bin/env python3
"""Overhead of the kvdoctor streaming proxy, next to nginx, on loopback.

    .venv/bin/python benchmarks/bench_proxy.py [--n 60] [--n-fake 10000] [--parts ABC] [--json out.json]

Targets, each its own process: the upstream directly, the kvdoctor proxy
(``kvdoctor.collect.proxy``), nginx (``proxy_buffering off; proxy_http_version 1.1``,
keepalive to upstream). Three parts:

A. real llama-server (SmolLM2-135M, ``-np 4``), short prompts, ``max_tokens`` 32: the same
   requests sent direct / proxy / nginx, interleaved in random order, one at a time.
   Reports client TTFT and ITL percentiles per target, their difference to direct, and the
   median of per-request paired differences. The client opens a new connection per request
   for every target (llama.cpp closes the connection after each streamed response anyway).
   On a small shared CPU this includes the model's own noise.
B. a fake SSE upstream that stamps each event with its send time (``time.time()``),
   ``--fake-events`` (2) events 2 ms apart, ``--n-fake`` (10,000) requests: the added
   latency per chunk (receive - send) and added TTFT, without model noise. This is the precise overhead figure: "added TTFT" here is the
   difference in (request in transit + first chunk in transit), both stamped exactly.
   Keep-alive client connections.
C. 32 concurrent streams against llama-server through each target: every response must
   be HTTP 200, every SSE event complete JSON, content chunks == usage.completion_tokens,
   ending with ``[DONE]``; counts corrupted / dropped responses (must be 0).

Target ``attach`` (parts A and B; ``--no-attach`` leaves it out) is the real sidecar path:
``kvdoctor attach --server UPSTREAM --proxy ...`` with its capture writer, /metrics scrape (every
second; in part B the fake upstream serves a recorded vLLM 0.32 page), live evaluation (every
second) on, and ``/report`` requested every second throughout, from a process of its own (where a
dashboard would be: not a thread of the client whose timestamps are the measure).
The verdict prints its added TTFT P99 and its ratio to nginx's, from the one run.

Targets: added TTFT P99 <= 2 ms and <= 1.5x nginx's. nginx must be installed
(``apt-get install nginx-light``); without it (or with --skip-nginx) nginx is left out.
Everything listens on 127.0.0.1 and every loop is bounded in count and time.

Env: ``KVD_BENCH_PROFILE=path`` cProfiles the proxy processes (to ``path.PORT``); ``KVD_BENCH_RECORDS=path``
writes their RequestRecords (with text) as JSON lines at exit.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import threading
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import orjson  # noqa: E402

#: what the fake upstream serves at /metrics: a real vLLM 0.32 page (54 KB, 648 lines), so the
#: sidecar's scrape parses what it would beside a real engine every second, not a 404
METRICS_PAGE = ROOT / "tests" / "data" / "metrics" / "vllm-0.32-cpu-under-load.prom"

TOPICS = ["rivers", "bread", "clocks", "bicycles", "owls", "trains", "tea", "bridges",
          "honey", "comets", "maps", "violins", "glaciers", "lanterns", "libraries", "volcanoes"]


from harness.llama_server import free_port  # noqa: E402
from harness.nginx import write_conf  # noqa: E402
from kvdoctor.numeric import percentile_sorted  # noqa: E402


def pct(xs, q: float) -> float | None:
    return percentile_sorted(sorted(xs), q)


def ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000.0, 3)


# --------------------------------------------------------------------------- child: proxy


class _CountingSink:
    def __init__(self) -> None:
        self.n = 0
        self.by_status: dict[str, int] = {}
        self.source: list[tuple[str, bool, str]] = []
        #: KVD_BENCH_RECORDS=path: keep the records, written there as JSON lines at exit
        self.keep: list[Any] | None = [] if os.environ.get("KVD_BENCH_RECORDS") else None

    def emit(self, r: Any) -> None:
        self.n += 1
        self.by_status[r.status] = self.by_status.get(r.status, 0) + 1
        if self.keep is not None:
            self.keep.append(r)

    def source_status(self, name: str, ok: bool, detail: str = "") -> None:
        self.source.append((name, ok, detail))


async def _proxy_child(upstream: str, port: int) -> None:
    from kvdoctor.collect.proxy import start_proxy

    sink = _CountingSink()
    server = await start_proxy(upstream, sink, port=port, store_text=sink.keep is not None)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    await asyncio.wait_for(stop.wait(), 3600)
    await server.close()
    if sink.keep is not None:
        from kvdoctor.model import to_dict

        with open(os.environ["KVD_BENCH_RECORDS"], "w") as f:
            for r in sink.keep:
                f.write(json.dumps(to_dict(r)) + "\n")
    print(json.dumps({"records": sink.n, "by_status": sink.by_status}), flush=True)


def proxy_child_main(upstream: str, port: int) -> None:
    prof_path = os.environ.get("KVD_BENCH_PROFILE")
    if prof_path:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
        try:
            asyncio.run(_proxy_child(upstream, port))
        finally:
            prof.disable()
            prof.dump_stats(f"{prof_path}.{port}")
    else:
        asyncio.run(_proxy_child(upstream, port))


# --------------------------------------------------------------------------- child: fake upstream


async def _fake_child(port: int) -> None:
    from aiohttp import web

    async def chat(request: web.Request) -> web.StreamResponse:
        recv_t = time.time()
        body = await request.json()
        n = int(body.get("max_tokens", 32))
        gap = float(body.get("gap_s", 0.002))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(gap)
        for i in range(n):
            ev = {"id": "x", "object": "chat.completion.chunk", "model": "fake", "t": time.time(),
                  "choices": [{"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}]}
            if i == 0:
                ev["recv_t"] = recv_t
            await resp.write(b"data: " + orjson.dumps(ev) + b"\n\n")
            if i < n - 1:
                await asyncio.sleep(gap)
        last = {"id": "x", "object": "chat.completion.chunk", "model": "fake", "t": time.time(),
                "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n}}
        await resp.write(b"data: " + orjson.dumps(last) + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    page = METRICS_PAGE.read_bytes()

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=page, content_type="text/plain", charset="utf-8")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await asyncio.wait_for(stop.wait(), 3600)
    await runner.cleanup()


# --------------------------------------------------------------------------- processes


class Proc:
    def __init__(self, name: str, cmd: list[str], health_url: str, cwd: str | None = None) -> None:
        self.name, self.cmd, self.health_url = name, cmd, health_url
        self.p = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  stdin=subprocess.DEVNULL, text=True)

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.p.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(self.health_url, timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} not healthy after {timeout_s}s")

    def stop(self) -> str:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                out, err = self.p.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                out, err = self.p.communicate()
            return out
        return self.p.stdout.read() if self.p.stdout else ""


NGINX_SERVER = """
    upstream up_{i} {{ server 127.0.0.1:{up_port}; keepalive 64; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://up_{i};
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 300s;
        }}
    }}
"""


def start_attach(upstream: str, tmp: Path, name: str) -> tuple[Proc, str, str]:
    """The real `kvdoctor attach --proxy` sidecar in front of ``upstream``: (proc, proxy URL, endpoints URL)."""
    pport, lport = free_port(), free_port()
    cmd = [sys.executable, "-m", "kvdoctor", "attach", "--server", upstream, "--proxy", f"127.0.0.1:{pport}",
           "--listen", f"127.0.0.1:{lport}", "--gpu", "none", "--step", "1s", "--scrape-interval", "1",
           "--capture", str(tmp / f"cap-{name}"), "-q"]
    return Proc(f"attach-{name}", cmd, f"http://127.0.0.1:{lport}/healthz"), \
        f"http://127.0.0.1:{pport}", f"http://127.0.0.1:{lport}"


def poll_reports(endpoints: list[str], stop: "threading.Event", counts: dict[str, int],
                 fetches: list) -> None:
    """GET /report on every sidecar once a second until ``stop`` (the load the issue names). Runs
    in a process of its own (``--_poll``), like the browser or dashboard it stands for: in a thread
    of the load generator it read each ~5 MB page holding the GIL the client's timestamps wait on,
    and every target's latencies, nginx's included, carried it."""
    import urllib.request

    while not stop.wait(1.0):
        for base in endpoints:
            try:
                t0 = time.time()
                with urllib.request.urlopen(f"{base}/report", timeout=30) as r:
                    n = len(r.read())
                    counts[base] = counts.get(base, 0) + 1
                fetches.append((base, t0, time.time(), n))  # when each page was asked for and read (--raw)
            except OSError:
                counts[f"{base} failed"] = counts.get(f"{base} failed", 0) + 1


def poll_child_main(endpoints: list[str]) -> None:
    """The --_poll child: poll_reports until SIGTERM, then its counts as one JSON line."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    counts: dict[str, int] = {}
    fetches: list = []
    poll_reports(endpoints, stop, counts, fetches)
    print(json.dumps(counts | {"fetches": fetches}), flush=True)


def start_nginx(pairs: list[tuple[int, int]], tmp: Path) -> Proc | None:
    servers = "".join(NGINX_SERVER.format(i=i, up_port=u, port=p) for i, (u, p) in enumerate(pairs))
    cmd = write_conf(tmp, servers)
    if not cmd:
        return None
    return Proc("nginx", cmd, f"http://127.0.0.1:{pairs[0][1]}/health")


# --------------------------------------------------------------------------- client


async def stream_once(s: aiohttp.ClientSession, base: str, body: dict, timeout_s: float = 60.0
                      ) -> dict[str, Any]:
    """One streaming chat request; times of each content event (wall clock) and checks."""
    t0 = time.time()
    chunks: list[float] = []
    stamps: list[float] = []  # fake upstream: its send time per content event
    buf = b""
    raw_len = 0
    n_events = 0
    bad_events = 0
    done = False
    usage = None
    status = None
    err = None
    recv_t = None
    try:
        async with s.post(base + "/v1/chat/completions", json=body,
                          timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            status = r.status
            async for chunk in r.content.iter_any():
                now = time.time()
                raw_len += len(chunk)
                buf += chunk
                while True:
                    i = buf.find(b"\n\n")
                    if i < 0:
                        break
                    ev, buf = buf[:i], buf[i + 2:]
                    n_events += 1
                    if not ev.startswith(b"data: "):
                        bad_events += 1
                        continue
                    p = ev[6:]
                    if p == b"[DONE]":
                        done = True
                        continue
                    try:
                        o = orjson.loads(p)
                    except orjson.JSONDecodeError:
                        bad_events += 1
                        continue
                    if o.get("usage"):
                        usage = o["usage"]
                    if "recv_t" in o:
                        recv_t = o["recv_t"]
                    for c in o.get("choices") or ():
                        if (c.get("delta") or {}).get("content"):
                            chunks.append(now)
                            if "t" in o:
                                stamps.append(o["t"])
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        err = f"{type(e).__name__}: {e}"
    t1 = time.time()
    # intact: HTTP 200, every event complete JSON, [DONE] last, and as many content events as
    # generated tokens (llama.cpp counts the end-of-stream token, which has no text: -1)
    ct = usage.get("completion_tokens") if usage else None
    ok = (status == 200 and err is None and done and bad_events == 0 and not buf.strip()
          and isinstance(ct, int) and 0 <= ct - len(chunks) <= 1 and len(chunks) > 0)
    return {"send": t0, "end": t1, "status": status, "err": err, "chunks": chunks, "stamps": stamps,
            "ttft": (chunks[0] - t0) if chunks else None, "ok": ok, "done": done,
            # fake upstream: time in transit of the request, and of the first chunk
            "req_leg": (recv_t - t0) if recv_t is not None else None,
            "first_leg": (chunks[0] - stamps[0]) if stamps else None,
            "bad_events": bad_events, "n_events": n_events, "bytes": raw_len}


def chat_body(i: int, max_tokens: int, k: int = 0) -> dict:
    """Request ``i`` for target ``k``: a distinct prompt of the same length for every target,
    so no target gets another's prompt-cache hits."""
    return {"model": "m", "messages": [
        {"role": "user", "content": f"In one sentence, tell me about {TOPICS[i % len(TOPICS)]} ({k}-{i:04d})."}],
        "max_tokens": max_tokens, "temperature": 0, "seed": 1, "stream": True,
        "stream_options": {"include_usage": True}}


def summarize_seq(results: dict[str, list[dict]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    direct = results["direct"]
    d_ttft = [r["ttft"] for r in direct if r["ttft"] is not None]
    d_itl = [b - a for r in direct for a, b in zip(r["chunks"], r["chunks"][1:])]
    for name, rs in results.items():
        ttft = [r["ttft"] for r in rs if r["ttft"] is not None]
        itl = [b - a for r in rs for a, b in zip(r["chunks"], r["chunks"][1:])]
        row = {"n": len(rs), "ok": sum(r["ok"] for r in rs),
               "ttft_p50_ms": ms(pct(ttft, 50)), "ttft_p99_ms": ms(pct(ttft, 99)),
               "itl_p50_ms": ms(pct(itl, 50)), "itl_p99_ms": ms(pct(itl, 99))}
        bad = [r for r in rs if not r["ok"]]
        if bad:
            row["not_ok_samples"] = sorted({f"{r['status']} {r['err'] or ''} done={r['done']} "
                                            f"bad_events={r['bad_events']}" for r in bad})[:3]
        if name != "direct":
            row["added_ttft_p50_ms"] = ms(pct(ttft, 50) - pct(d_ttft, 50))
            row["added_ttft_p99_ms"] = ms(pct(ttft, 99) - pct(d_ttft, 99))
            # paired: request i through this target minus request i direct (same moment)
            pair = [a["ttft"] - b["ttft"] for a, b in zip(rs, direct)
                    if a["ttft"] is not None and b["ttft"] is not None]
            row["paired_added_ttft_p50_ms"] = ms(pct(pair, 50))
            row["added_itl_p50_ms"] = ms(pct(itl, 50) - pct(d_itl, 50))
            row["added_itl_p99_ms"] = ms(pct(itl, 99) - pct(d_itl, 99))
        # fake upstream: exact per-chunk delivery latency (receive - send stamp)
        lat = [c - t for r in rs for c, t in zip(r["chunks"], r["stamps"])]
        if lat:
            row["chunk_latency_p50_ms"] = ms(pct(lat, 50))
            row["chunk_latency_p99_ms"] = ms(pct(lat, 99))
        out[name] = row
    # fake upstream: the path a proxy lengthens, without the upstream's own time
    # (request in transit + first chunk in transit), exact per request
    def path(rs: list[dict]) -> list[float]:
        return [r["req_leg"] + r["first_leg"] for r in rs
                if r.get("req_leg") is not None and r.get("first_leg") is not None]

    if path(direct):
        d_path = path(direct)
        for name, rs in results.items():
            p = path(rs)
            out[name]["ttft_path_p50_ms"] = ms(pct(p, 50))
            out[name]["ttft_path_p99_ms"] = ms(pct(p, 99))
            out[name]["req_leg_p50_ms"] = ms(pct([r["req_leg"] for r in rs], 50))
            if name != "direct":
                out[name]["added_ttft_p50_ms"] = ms(pct(p, 50) - pct(d_path, 50))
                out[name]["added_ttft_p99_ms"] = ms(pct(p, 99) - pct(d_path, 99))
    if "chunk_latency_p50_ms" in out["direct"]:
        d_lat = [c - t for r in direct for c, t in zip(r["chunks"], r["stamps"])]
        for name, rs in results.items():
            if name == "direct":
                continue
            lat = [c - t for r in rs for c, t in zip(r["chunks"], r["stamps"])]
            out[name]["added_chunk_p50_ms"] = ms(pct(lat, 50) - pct(d_lat, 50))
            out[name]["added_chunk_p99_ms"] = ms(pct(lat, 99) - pct(d_lat, 99))
    return out


def bootstrap_added_p99(results: dict[str, list[dict]], name: str, ref: str = "nginx",
                        n_boot: int = 2000, seed: int = 0) -> dict[str, Any] | None:
    """How firm one run's "added TTFT P99" comparison is: requests of every target resampled with
    replacement, ``n_boot`` times. A P99 of ~1,000 requests rests on its ~10 slowest, so on a small
    shared host one run's ratio moves a lot; this says by how much (5th-95th percentile of the
    resampled ratio) and in what share of resamples ``name`` stays within 1.5x ``ref``."""
    import numpy as np

    def arr(k: str) -> "np.ndarray":
        return np.array([r["ttft"] for r in results.get(k, ()) if r["ttft"] is not None])

    a, b, d = arr(name), arr(ref), arr("direct")
    if min(len(a), len(b), len(d)) < 100:
        return None
    rng = np.random.default_rng(seed)

    def boot(x: "np.ndarray") -> "np.ndarray":
        return np.percentile(x[rng.integers(0, len(x), (n_boot, len(x)))], 99, axis=1)

    pd_ = boot(d)
    added_a, added_b = boot(a) - pd_, boot(b) - pd_
    ok = (added_a <= 1.5 * np.maximum(added_b, 0.0)) | (added_a <= 0.0)
    ratio = added_a[added_b > 0] / added_b[added_b > 0]
    return {f"{name}_added_ttft_p99_ms_5_95": [ms(float(np.percentile(added_a, 5))), ms(float(np.percentile(added_a, 95)))],
            f"{ref}_added_ttft_p99_ms_5_95": [ms(float(np.percentile(added_b, 5))), ms(float(np.percentile(added_b, 95)))],
            "ratio_5_95": [round(float(np.percentile(ratio, 5)), 2), round(float(np.percentile(ratio, 95)), 2)]
            if len(ratio) else None,
            "share_within_1.5x": round(float(ok.mean()), 3)}


async def sequential(targets: dict[str, str], n: int, make_body, deadline: float,
                     keepalive: bool) -> dict[str, list[dict]]:
    res: dict[str, list[dict]] = {k: [] for k in targets}
    rng = random.Random(0)
    names = list(targets)
    # keepalive=False: a new client connection per request, for every target alike (llama.cpp
    # closes the connection after each streamed response; a client reusing it races the FIN)
    conn = aiohttp.TCPConnector(limit=0, force_close=not keepalive)
    async with aiohttp.ClientSession(connector=conn) as s:
        for k, name in enumerate(names):  # warm-up: upstream connections, code paths
            for i in range(3):
                await stream_once(s, targets[name], make_body(10000 + i, k))
        for i in range(n):
            if time.monotonic() > deadline:
                break
            order = names[:]
            rng.shuffle(order)
            for name in order:
                res[name].append(await stream_once(s, targets[name], make_body(i, names.index(name))))
    return res


async def concurrent(base: str, n: int, max_tokens: int, timeout_s: float, k: int) -> dict[str, Any]:
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=conn) as s:
        rs = await asyncio.gather(*(stream_once(s, base, chat_body(i, max_tokens, k), timeout_s)
                                    for i in range(n)))
    dropped = sum(1 for r in rs if r["status"] != 200 or r["err"] or not r["done"])
    corrupted = sum(1 for r in rs if r["status"] == 200 and not r["err"] and r["done"] and not r["ok"])
    return {"n": n, "ok": sum(r["ok"] for r in rs), "dropped": dropped, "corrupted": corrupted,
            "errors": sorted({r["err"] or str(r["status"]) for r in rs if not r["ok"]})[:3],
            "ttft_p50_ms": ms(pct([r["ttft"] for r in rs if r["ttft"] is not None], 50)),
            "wall_s": round(max(r["end"] for r in rs) - min(r["send"] for r in rs), 2)}


def print_table(title: str, rows: dict[str, dict]) -> None:
    """One line per metric, one column per target."""
    print(f"\n== {title}")
    order = ["n", "ok", "ttft_p50_ms", "ttft_p99_ms", "added_ttft_p50_ms", "added_ttft_p99_ms",
             "paired_added_ttft_p50_ms", "ttft_path_p50_ms", "ttft_path_p99_ms", "req_leg_p50_ms",
             "itl_p50_ms", "itl_p99_ms", "added_itl_p50_ms", "added_itl_p99_ms",
             "chunk_latency_p50_ms", "chunk_latency_p99_ms", "added_chunk_p50_ms",
             "added_chunk_p99_ms", "dropped", "corrupted", "wall_s"]
    present = {k for r in rows.values() for k in r}
    names = list(rows)
    print(f"{'':<26}" + "".join(f"{n:>12}" for n in names))
    for c in order:
        if c in present:
            print(f"{c:<26}" + "".join(f"{'' if rows[n].get(c) is None else rows[n].get(c):>12}"
                                       for n in names))
    for name, r in rows.items():
        for e in r.get("not_ok_samples") or r.get("errors") or ():
            print(f"  {name} not ok: {e}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=60, help="part A requests per target (real server)")
    ap.add_argument("--n-fake", type=int, default=10000,
                    help="part B requests per target (fake upstream). The verdict is a P99: of 10,000 requests it "
                         "rests on the 100 slowest; of 1,000 on 10, and moves ~1 ms from run to run on a small host")
    ap.add_argument("--fake-events", type=int, default=2,
                    help="part B content events per response (more: more chunks to time, fewer requests a minute)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--parallel", type=int, default=4, help="llama-server slots (-np)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrent", type=int, default=32, help="part C concurrent streams")
    ap.add_argument("--skip-nginx", action="store_true")
    ap.add_argument("--no-attach", action="store_true", help="leave out the full `kvdoctor attach --proxy` target")
    ap.add_argument("--parts", default="ABC")
    ap.add_argument("--max-duration", type=float, default=1200.0, help="seconds, whole run")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--raw", help="part B: write every request's timings here (JSON: target -> rows of "
                                  "send, end, req_leg, first_leg seconds; and each /report fetch to RAW.report.json), "
                                  "to study where the tail comes from")
    ap.add_argument("--_proxy", nargs=2, metavar=("UPSTREAM", "PORT"), help=argparse.SUPPRESS)
    ap.add_argument("--_fake", type=int, metavar="PORT", help=argparse.SUPPRESS)
    ap.add_argument("--_poll", nargs="+", metavar="URL", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._poll:
        poll_child_main(args._poll)
        return 0
    if args._proxy:
        proxy_child_main(args._proxy[0], int(args._proxy[1]))
        return 0
    if args._fake:
        asyncio.run(_fake_child(args._fake))
        return 0

    deadline = time.monotonic() + args.max_duration
    py = sys.executable
    me = str(Path(__file__).resolve())
    procs: list[Proc] = []
    results: dict[str, Any] = {"args": vars(args)}
    tmp = Path(tempfile.mkdtemp(prefix="kvd-bench-proxy-"))
    llama = None
    report_apis: list[str] = []
    report_counts: dict[str, int] = {}
    poller: subprocess.Popen | None = None
    try:
        targets_real: dict[str, str] = {}
        targets_fake: dict[str, str] = {}
        pairs: list[tuple[int, int]] = []
        if set(args.parts) & set("AC"):
            from harness.llama_server import LlamaServer

            llama = LlamaServer(n_ctx=512 * args.parallel, parallel=args.parallel, threads=args.threads)
            llama.start()
            targets_real["direct"] = llama.url
            pk = free_port()
            procs.append(Proc("proxy-llama", [py, me, "--_proxy", llama.url, str(pk)],
                              f"http://127.0.0.1:{pk}/health"))
            targets_real["kvdoctor"] = f"http://127.0.0.1:{pk}"
            if not args.no_attach:
                proc, url, api = start_attach(llama.url, tmp, "llama")
                procs.append(proc)
                targets_real["attach"] = url
                report_apis.append(api)
            pn = free_port()
            pairs.append((llama.port, pn))
            targets_real["nginx"] = f"http://127.0.0.1:{pn}"
        if "B" in args.parts:
            fport = free_port()
            procs.append(Proc("fake", [py, me, "--_fake", str(fport)], f"http://127.0.0.1:{fport}/health"))
            procs[-1].wait_healthy()
            targets_fake["direct"] = f"http://127.0.0.1:{fport}"
            pk = free_port()
            procs.append(Proc("proxy-fake", [py, me, "--_proxy", targets_fake["direct"], str(pk)],
                              f"http://127.0.0.1:{pk}/health"))
            targets_fake["kvdoctor"] = f"http://127.0.0.1:{pk}"
            if not args.no_attach:
                proc, url, api = start_attach(targets_fake["direct"], tmp, "fake")
                procs.append(proc)
                targets_fake["attach"] = url
                report_apis.append(api)
            pn = free_port()
            pairs.append((fport, pn))
            targets_fake["nginx"] = f"http://127.0.0.1:{pn}"
        ngx = None if args.skip_nginx else start_nginx(pairs, tmp)
        if ngx is None:
            print("nginx not available: left out", file=sys.stderr)
            targets_real.pop("nginx", None)
            targets_fake.pop("nginx", None)
        else:
            procs.append(ngx)
        for p in procs:
            p.wait_healthy()
        if report_apis:
            poller = subprocess.Popen([py, me, "--_poll", *report_apis], stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)

        if "A" in args.parts:
            res = asyncio.run(sequential(targets_real, args.n, lambda i, k: chat_body(i, args.max_tokens, k),
                                         deadline, keepalive=False))
            results["A_real_sequential"] = summarize_seq(res)
            print_table(f"A. llama-server -np {args.parallel}, sequential interleaved, max_tokens {args.max_tokens}",
                        results["A_real_sequential"])
        if "B" in args.parts:
            nf = args.n_fake
            res = asyncio.run(sequential(targets_fake, nf,
                                         lambda i, k: {"messages": [{"role": "user", "content": f"q{i}"}],
                                                    "max_tokens": args.fake_events, "gap_s": 0.002,
                                                    "stream": True},
                                         deadline, keepalive=True))
            results["B_fake_sequential"] = summarize_seq(res)
            if args.raw:
                keys = ("send", "end", "req_leg", "first_leg", "ttft")
                Path(args.raw).write_text(json.dumps({k: [[r[x] for x in keys] for r in rows]
                                                      for k, rows in res.items()} | {"columns": keys}))
            if "attach" in res and "nginx" in res:
                results["B_bootstrap"] = bootstrap_added_p99(res, "attach")
            print_table(f"B. fake SSE upstream, {args.fake_events} events 2 ms apart (exact per-chunk latency)",
                        results["B_fake_sequential"])
        if "C" in args.parts:
            rows = {}
            for k, (name, base) in enumerate(targets_real.items()):
                rows[name] = asyncio.run(concurrent(base, args.concurrent, args.max_tokens, 300.0, k))
            results["C_real_concurrent"] = rows
            print_table(f"C. {args.concurrent} concurrent streams, llama-server -np {args.parallel}", rows)
    finally:
        if poller is not None:
            poller.send_signal(signal.SIGTERM)
            try:
                out, _ = poller.communicate(timeout=60)
                report_counts.update(json.loads(out.strip().splitlines()[-1]) if out.strip() else {})
                fetches = report_counts.pop("fetches", [])
                if args.raw:
                    Path(args.raw + ".report.json").write_text(json.dumps(
                        {"columns": ("endpoint", "start", "end", "bytes"), "rows": fetches}))
            except (subprocess.TimeoutExpired, ValueError):
                poller.kill()
        results["report_requests"] = report_counts
        for p in reversed(procs):
            out = p.stop()
            if p.name.startswith("proxy") and out.strip():
                results.setdefault("proxy_records", {})[p.name] = out.strip().splitlines()[-1]
        if llama is not None:
            llama.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print("\nproxy records:", json.dumps(results.get("proxy_records", {})))
    verdict = {}
    for part in ("A_real_sequential", "B_fake_sequential"):
        rows = results.get(part)
        if rows and "kvdoctor" in rows:
            k = rows["kvdoctor"]["added_ttft_p99_ms"]
            ng = rows.get("nginx", {}).get("added_ttft_p99_ms")
            verdict[part] = {"kvdoctor_added_ttft_p99_ms": k, "nginx_added_ttft_p99_ms": ng,
                             "le_2ms": k is not None and k <= 2.0,
                             "le_1.5x_nginx": None if ng is None else k <= 1.5 * max(ng, 0.0) or k <= 0.0}
        if rows and "attach" in rows:
            a = rows["attach"]["added_ttft_p99_ms"]
            ng = rows.get("nginx", {}).get("added_ttft_p99_ms")
            verdict.setdefault(part, {}).update({
                "attach_added_ttft_p99_ms": a, "attach_le_2ms": a is not None and a <= 2.0,
                "attach_ratio_to_nginx": None if ng is None or a is None or ng <= 0 else round(a / ng, 2),
                "attach_le_1.5x_nginx": None if ng is None or a is None else a <= 1.5 * max(ng, 0.0) or a <= 0.0})
            if part == "B_fake_sequential" and results.get("B_bootstrap"):
                verdict[part]["bootstrap"] = results["B_bootstrap"]
    results["verdict"] = verdict
    print("report requests served during the run:", json.dumps(report_counts))
    print("verdict:", json.dumps(verdict))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    c = results.get("C_real_concurrent", {})
    return 1 if any(r["dropped"] or r["corrupted"] for r in c.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
