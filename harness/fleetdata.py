"""A synthetic vLLM fleet in a real Prometheus: OpenMetrics history for N instances (and their
DCGM exporters), loaded with ``promtool tsdb create-blocks-from openmetrics`` and served by a
real Prometheus on loopback. The fleet benchmark (benchmarks/bench_fleet.py) and the fleet
tests' partial-failure case run on it.

Values are synthetic but shaped like a serving fleet: a diurnal load curve, each instance's share
of it, requests running and waiting, KV usage, token and preemption counters, a TTFT histogram,
and per GPU framebuffer used/free and DRAM activity. "Sick" instances take three times the load:
they queue, preempt and have a slow TTFT tail.
"""
from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from .llama_server import free_port


def instance_name(i: int) -> str:
    return f"10.0.{i // 250}.{i % 250}:8000"


LE = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def generate(path: Path, n: int, hours: float, scrape: int, sick: set[int], t0: int, dcgm: bool = False) -> int:
    """Write the OpenMetrics file; returns the number of samples written."""
    rng = np.random.default_rng(0)
    steps = int(hours * 3600 // scrape)
    ts = t0 + scrape * np.arange(steps)
    lines = 0
    with open(path, "w") as f:
        def fam(name, typ, rows):
            nonlocal lines
            f.write(f"# TYPE {name} {typ}\n")
            for r in rows:
                f.write(r)
                lines += 1

        def per_inst(fn):
            for i in range(n):
                yield from fn(i, f'instance="10.0.{i // 250}.{i % 250}:8000",job="vllm",model_name="llama-8b"')

        diurnal = 1 + 0.5 * np.sin(2 * np.pi * (ts - t0) / 86400)
        base = {i: diurnal * rng.uniform(0.8, 1.2) * (3.0 if i in sick else 1.0) for i in range(n)}

        def running(i, lab):
            v = np.minimum(base[i] * 20, 64)
            return (f"vllm:num_requests_running{{{lab}}} {x:.0f} {t}\n" for x, t in zip(v, ts))

        def waiting(i, lab):
            v = np.where(i in sick, base[i] * 4, 0)
            v = np.broadcast_to(v, ts.shape)
            return (f"vllm:num_requests_waiting{{{lab}}} {x:.0f} {t}\n" for x, t in zip(v, ts))

        def kv(i, lab):
            v = np.minimum(0.3 * base[i] + 0.05 * rng.random(len(ts)), 0.99)
            return (f"vllm:kv_cache_usage_perc{{{lab}}} {x:.3f} {t}\n" for x, t in zip(v, ts))

        def gen(i, lab):
            v = np.cumsum(base[i] * 400 * scrape)
            return (f"vllm:generation_tokens_total{{{lab}}} {x:.0f} {t}\n" for x, t in zip(v, ts))

        def pre(i, lab):
            v = np.cumsum(np.where(i in sick, 2, 0) * np.ones(len(ts)))
            return (f"vllm:num_preemptions_total{{{lab}}} {x:.0f} {t}\n" for x, t in zip(v, ts))

        def ttft(i, lab):
            reqs = base[i] * 2 * scrape
            scale = 2.0 if i in sick else 0.2
            cdf = 1 - np.exp(-np.array(LE) / scale)
            cum = np.cumsum(reqs)
            for j, t in enumerate(ts):
                for le, c in zip(LE, cdf):
                    yield f'vllm:time_to_first_token_seconds_bucket{{{lab},le="{le}"}} {cum[j] * c:.0f} {t}\n'
                yield f'vllm:time_to_first_token_seconds_bucket{{{lab},le="+Inf"}} {cum[j]:.0f} {t}\n'
                yield f"vllm:time_to_first_token_seconds_count{{{lab}}} {cum[j]:.0f} {t}\n"

        def per_gpu(fn):
            for i in range(n):
                yield from fn(i, f'instance="10.0.{i // 250}.{i % 250}:9400",job="dcgm",gpu="0",'
                                 f'UUID="GPU-{i:08x}",modelName="NVIDIA H100 80GB HBM3",Hostname="node-{i}"')

        def fb_used(i, lab):  # MiB of 81559: weights + KV pool, a little more under load
            v = 70000 + 2000 * np.minimum(base[i], 2) + 100 * rng.random(len(ts))
            return (f"DCGM_FI_DEV_FB_USED{{{lab}}} {x:.0f} {t}\n" for x, t in zip(v, ts))

        def fb_free(i, lab):
            v = 81559 - (70000 + 2000 * np.minimum(base[i], 2))
            return (f"DCGM_FI_DEV_FB_FREE{{{lab}}} {x:.0f} {t}\n" for x, t in zip(v, ts))

        def dram(i, lab):
            v = np.minimum(0.25 * base[i] + 0.05 * rng.random(len(ts)), 0.98)
            return (f"DCGM_FI_PROF_DRAM_ACTIVE{{{lab}}} {x:.3f} {t}\n" for x, t in zip(v, ts))

        if dcgm:
            fam("DCGM_FI_DEV_FB_USED", "gauge", per_gpu(fb_used))
            fam("DCGM_FI_DEV_FB_FREE", "gauge", per_gpu(fb_free))
            fam("DCGM_FI_PROF_DRAM_ACTIVE", "gauge", per_gpu(dram))
        fam("vllm:num_requests_running", "gauge", per_inst(running))
        fam("vllm:num_requests_waiting", "gauge", per_inst(waiting))
        fam("vllm:kv_cache_usage_perc", "gauge", per_inst(kv))
        fam("vllm:generation_tokens", "counter", per_inst(gen))
        fam("vllm:num_preemptions", "counter", per_inst(pre))
        fam("vllm:time_to_first_token_seconds", "histogram", per_inst(ttft))
        f.write("# EOF\n")
    return lines



class PrometheusOnBlocks:
    """``with PrometheusOnBlocks(n, hours, sick) as p: p.url, p.start_s, p.end_s``: generated history
    ending at the last whole hour before now, in a real Prometheus (``extra_args`` go to it, e.g.
    ``--query.max-samples=...``). Timings of each phase are in ``generate_s`` and ``promtool_s``."""

    def __init__(self, n: int, hours: float, sick: set[int], *, scrape_s: int = 60, dcgm: bool = False,
                 extra_args: tuple[str, ...] = ()):
        self.n, self.hours, self.sick, self.scrape_s, self.dcgm = n, hours, sick, scrape_s, dcgm
        self.extra_args = extra_args
        self.end_s = int(time.time()) // 3600 * 3600 - 3600
        self.start_s = int(self.end_s - hours * 3600)
        self.tmp = Path(tempfile.mkdtemp(prefix="kvd-fleetdata-"))
        self.proc: subprocess.Popen | None = None
        self.samples = 0
        self.generate_s = self.promtool_s = 0.0

    def __enter__(self) -> "PrometheusOnBlocks":
        for b in ("prometheus", "promtool"):
            if not shutil.which(b):
                raise FileNotFoundError(f"{b} not found (scripts/install-services installs Debian's prometheus)")
        t = time.perf_counter()
        self.samples = generate(self.tmp / "data.om", self.n, self.hours, self.scrape_s, self.sick, self.start_s, self.dcgm)
        self.generate_s = time.perf_counter() - t
        t = time.perf_counter()
        subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", str(self.tmp / "data.om"),
                        str(self.tmp / "tsdb")], check=True, capture_output=True)
        self.promtool_s = time.perf_counter() - t
        (self.tmp / "data.om").unlink()
        self.port = free_port()
        (self.tmp / "p.yml").write_text("global: {scrape_interval: 1m}\nscrape_configs: []\n")
        self.proc = subprocess.Popen(["prometheus", f"--config.file={self.tmp / 'p.yml'}",
                                      f"--storage.tsdb.path={self.tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{self.port}",
                                      "--storage.tsdb.retention.time=30d", *self.extra_args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(240):
            try:
                urllib.request.urlopen(f"{self.url}/-/ready", timeout=2)
                return self
            except OSError:
                time.sleep(0.5)
        self.__exit__()
        raise TimeoutError("Prometheus did not become ready on the generated blocks")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.tmp, ignore_errors=True)
