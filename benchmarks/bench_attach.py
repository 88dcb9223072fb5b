"""Benchmark: the sidecar's own cost.

    python benchmarks/bench_attach.py [--seconds 60] [--nvml-replay tests/data/nvml/h100-sxm-serving.json]

Starts a real llama-server, attaches `kvdoctor attach` (scrape at 1 Hz, host sampling at 1 Hz,
GPU sampling at 10 Hz through a replayed NVML recording when given, else the host-only set),
keeps a light stream of requests going through its proxy, and reports the sidecar's CPU (% of
one core, from its own process CPU time) and peak RSS over the run.
Targets: <= 2% of one core, <= 100 MiB RSS (without proxy traffic: proxying costs CPU per chunk
and is measured separately by benchmarks/bench_proxy.py).
"""
from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness import loadgen  # noqa: E402
from harness.llama_server import LlamaServer, free_port  # noqa: E402
from harness.server_base import wait_listening  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--nvml-replay", help="NVML recording to replay at 10 Hz (the GPU sampling path)")
    ap.add_argument("--traffic", action="store_true", help="also send a request every 2 s through the proxy")
    args = ap.parse_args()
    with LlamaServer(n_ctx=2048, parallel=2) as srv:
        listen, pport = free_port(), free_port()
        cmd = [sys.executable, "-m", "kvdoctor", "attach", "--server", srv.url, "--listen", f"127.0.0.1:{listen}",
               "--proxy", f"127.0.0.1:{pport}", "--capture", f"/tmp/kvd-bench-attach-{listen}", "-q"]
        cmd += ["--nvml-replay", args.nvml_replay, "--gpu", "auto"] if args.nvml_replay else ["--gpu", "none"]
        proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
        wait_listening(listen)
        wait_listening(pport)
        ps = psutil.Process(proc.pid)
        time.sleep(3)  # start-up (imports) is not the steady state
        c0, t0, peak, workers_peak = ps.cpu_times(), time.monotonic(), 0, 0
        workers: dict[int, psutil.Process] = {}
        workers_rss: dict[int, int] = {}
        end = t0 + args.seconds
        while time.monotonic() < end:
            if args.traffic:
                asyncio.run(loadgen.run_load(f"http://127.0.0.1:{pport}", loadgen.short_prompts(1, max_tokens=8), 1))
            peak = max(peak, ps.memory_info().rss)
            for w in ps.children(recursive=True):  # the worker processes (live step, /metrics parse)
                workers.setdefault(w.pid, w)
            for pid, w in workers.items():
                workers_rss[pid] = max(workers_rss.get(pid, 0), _rss(w))
            workers_peak = max(workers_peak, sum(_rss(w) for w in workers.values()))
            time.sleep(2)
        c1, t1 = ps.cpu_times(), time.monotonic()
        # their CPU while alive: a worker's times are not in the agent's until it is reaped
        workers_cpu_s = sum(_cpu_s(w) for w in workers.values())
        proc.terminate()
        proc.wait(30)
    cpu = (c1.user + c1.system - c0.user - c0.system) / (t1 - t0) * 100
    mode = "GPU replay 10 Hz + host 1 Hz + scrape 1 Hz" if args.nvml_replay else "host 1 Hz + scrape 1 Hz (no GPU)"
    print(f"sidecar over {t1 - t0:.0f} s, {mode}{', traffic 0.5 req/s' if args.traffic else ''}:")
    print(f"  CPU {cpu:.2f}% of one core (target <= 2%)   peak RSS {peak / 2**20:.0f} MiB (target <= 100 MiB)")
    print(f"  worker processes: {len(workers)}, CPU {workers_cpu_s / (t1 - t0) * 100:.2f}% of one core (since their start), "
          f"peak RSS together {workers_peak / 2**20:.0f} MiB, each "
          f"{', '.join(f'{v / 2**20:.0f}' for v in sorted(workers_rss.values(), reverse=True))} MiB")


def _rss(p: psutil.Process) -> int:
    try:
        return p.memory_info().rss
    except psutil.Error:
        return 0


def _cpu_s(p: psutil.Process) -> float:
    try:
        t = p.cpu_times()
        return t.user + t.system
    except psutil.Error:
        return 0.0


if __name__ == "__main__":
    main()
