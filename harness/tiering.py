"""Request tiering on real servers: the same mixed-length load across two llama-servers, once
spread round-robin and once routed by length, kvdoctor attached in front of the router.

    python -m harness.tiering samples/tiering-round-robin samples/tiering-by-length

A real nginx is the router, as a gateway in production would be: ``upstream`` round-robin over
both servers, or a ``map`` on the request's Content-Length that sends long prompts (bodies of
2,000 bytes and more: ~400+ prompt tokens here) to one server and the rest to the other. The
two servers, the load and the arrival times are the same in both runs; only the routing
differs. kvdoctor's proxy sits in front of nginx, so each capture holds every request as the
client saw it; it does not scrape (/metrics through the router would mix two servers).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import time
from pathlib import Path

from . import loadgen
from . import nginx
from .llama_server import LlamaServer

#: two replicas behind one nginx upstream; ``policy`` is its balancing directive ("" = round robin)
ROUTER = """
    upstream pools {{ {policy} server 127.0.0.1:{a}; server 127.0.0.1:{b}; keepalive 16; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://pools;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}"""

BY_LENGTH = """
    upstream short_pool {{ server 127.0.0.1:{a}; keepalive 16; }}
    upstream long_pool {{ server 127.0.0.1:{b}; keepalive 16; }}
    map $content_length $pool {{              # bodies of 2,000 bytes and more: the long pool
        default short_pool;
        "~^[2-9][0-9]{{3}}$" long_pool;
        "~^[0-9]{{5,}}$" long_pool;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://$pool;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}"""

ROUTES = {"round-robin": ROUTER, "by-length": BY_LENGTH}


def workload(n_long: int = 12) -> list[loadgen.ChatRequest]:
    """4 short prompts for each of ``n_long`` of ~1,000 tokens (one in five; the shipped samples:
    48 and 12), every request decoding exactly 16 tokens. Sized so that one single-thread server
    can take every long prompt (~6 s of prefill each, one every ~10 s: the long pool about 60%
    busy) and the load is stable either way."""
    from .scenarios import _fixed, _mix

    return _fixed(_mix(loadgen.short_prompts(4 * n_long, max_tokens=16),
                       loadgen.long_prompts(n_long, tokens=1000, max_tokens=16), every=4))


#: open-loop arrivals: the same Poisson times (seeded) in both runs
ARRIVAL_RATE_PER_S = 0.5
CONCURRENCY = 16


def record(out: Path, route: str, threads: int = 1, pin: bool = True,
           n_long: int = 12) -> list[loadgen.ClientTiming] | None:
    """Run the load (``workload(n_long)``, 2 min at 12) through kvdoctor -> nginx (``route``) ->
    two llama-servers; the capture lands in ``out`` with client-timings.jsonl beside it. None when
    nginx is not installed."""
    from .scenarios import AttachedAgent

    if out.exists():
        shutil.rmtree(out)
    with LlamaServer(n_ctx=8192, parallel=2, threads=threads) as a, \
            LlamaServer(n_ctx=8192, parallel=2, threads=threads) as b:
        cores = sorted(os.sched_getaffinity(0))
        if pin and len(cores) >= 2:  # a core each, as two pools would have hardware of their own
            os.sched_setaffinity(a.pid, {cores[0]})
            os.sched_setaffinity(b.pid, {cores[1]})
        with nginx.running(lambda port: ROUTES[route].format(port=port, a=a.port, b=b.port, policy="")) as port:
            if port is None:
                return None
            with AttachedAgent(f"http://127.0.0.1:{port}", out, None, scrape=False) as att:
                timings = asyncio.run(loadgen.run_load(att.proxy_url, workload(n_long), concurrency=CONCURRENCY,
                                                       arrival_rate_per_s=ARRIVAL_RATE_PER_S, timeout_s=300, seed=11))
                time.sleep(1.0)
    loadgen.write_timings(out / "client-timings.jsonl", timings)
    return timings


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("round_robin_out", type=Path)
    ap.add_argument("by_length_out", type=Path)
    args = ap.parse_args(argv)
    for route, out in (("round-robin", args.round_robin_out), ("by-length", args.by_length_out)):
        got = record(out, route)
        if got is None:
            print("nginx is not installed (scripts/install-services installs nginx-light)", file=sys.stderr)
            return 1
        ok = [t for t in got if t.http_status == 200]
        print(f"{route}: {len(ok)} of {len(got)} answered; capture in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
