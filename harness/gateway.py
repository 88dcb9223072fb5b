"""A real rate-limiting gateway in front of a real llama-server, kvdoctor attached in front of
the gateway: the 429 case of the error classes (kvdoctor/error_classes.py).

    python -m harness.gateway samples/gateway-rate-limit

nginx (``limit_req``, 2 requests/s, burst 2, status 429) guards ``/v1/``; ``/metrics`` and
``/health`` pass through so the sidecar still scrapes the engine. The load is 30 short prompts
arriving at 6/s (Poisson, however slow the served ones are): three times the gateway's rate, so about two in
three are refused before they reach the engine and the rest are served. Sent all at once, the
refusals came back so fast that the whole load passed within the burst: 2 served, flaky.
"""
from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import time
from pathlib import Path

from . import loadgen, nginx
from .llama_server import LlamaServer

GATE = """
    limit_req_zone $binary_remote_addr zone=kvd_rl:1m rate=2r/s;
    server {{
        listen 127.0.0.1:{port};
        location /v1/ {{
            limit_req zone=kvd_rl burst=2 nodelay;
            limit_req_status 429;
            proxy_pass http://127.0.0.1:{upstream};
            proxy_buffering off;
        }}
        location / {{ proxy_pass http://127.0.0.1:{upstream}; }}
    }}"""


def record(out: Path, n: int = 30, concurrency: int = 30, rate_per_s: float = 6.0) -> list[loadgen.ClientTiming] | None:
    """Run the load through kvdoctor -> nginx -> llama-server; the capture lands in ``out`` with
    client-timings.jsonl beside it. None when nginx is not installed."""
    from .scenarios import AttachedAgent

    if out.exists():
        shutil.rmtree(out)
    with LlamaServer(n_ctx=2048, parallel=2) as srv:
        with nginx.running(lambda port: GATE.format(port=port, upstream=srv.port)) as gate_port:
            if gate_port is None:
                return None
            with AttachedAgent(f"http://127.0.0.1:{gate_port}", out, srv.pid) as att:
                timings = asyncio.run(loadgen.run_load(att.proxy_url, loadgen.short_prompts(n, max_tokens=8),
                                                       concurrency=concurrency, arrival_rate_per_s=rate_per_s,
                                                       timeout_s=120))
                time.sleep(1.5)  # one more scrape after the last request
    loadgen.write_timings(out / "client-timings.jsonl", timings)
    return timings


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    got = record(args.out)
    if got is None:
        print("nginx is not installed (scripts/install-services installs nginx-light)", file=sys.stderr)
        return 1
    print(f"{sum(t.http_status == 429 for t in got)} of {len(got)} refused with 429; capture in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
