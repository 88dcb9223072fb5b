"""Fleet-mode cost: N vLLM instances × H hours in a real Prometheus TSDB, one diagnosis over it.

Generates OpenMetrics text (6 key vLLM metrics, realistic values, a few sick instances that
queue; with --dcgm, also one DCGM exporter target per instance on the same address, port 9400,
job "dcgm": framebuffer used/free and DRAM activity of its GPU), loads it with ``promtool tsdb create-blocks-from openmetrics``, starts Prometheus on the
blocks and times ``kvdoctor diagnose --prometheus URL --start --end --step``: wall time, queries,
bytes. Usage: python benchmarks/bench_fleet.py [--instances 200] [--hours 24] [--scrape 60] [--step 5m]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

LE = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def generate(path: Path, n: int, hours: float, scrape: int, sick: set[int], t0: int, dcgm: bool = False) -> int:
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--instances", type=int, default=200)
    ap.add_argument("--hours", type=float, default=24)
    ap.add_argument("--scrape", type=int, default=60)
    ap.add_argument("--step", default="5m")
    ap.add_argument("--sick", type=int, default=3)
    ap.add_argument("--dcgm", action="store_true", help="add one DCGM exporter target per instance (job dcgm)")
    a = ap.parse_args()
    for b in ("prometheus", "promtool"):
        if not shutil.which(b):
            print(f"{b} not found (apt-get install -y prometheus)")
            return 1
    tmp = Path(tempfile.mkdtemp(prefix="kvd-bench-fleet-"))
    try:
        t_end = int(time.time()) // 3600 * 3600 - 3600
        t0 = int(t_end - a.hours * 3600)
        sick = set(range(0, a.instances, max(1, a.instances // a.sick)))  # every (n/sick)-th
        t = time.perf_counter()
        lines = generate(tmp / "data.om", a.instances, a.hours, a.scrape, sick, t0, a.dcgm)
        gen_s = time.perf_counter() - t
        t = time.perf_counter()
        subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", str(tmp / "data.om"), str(tmp / "tsdb")],
                       check=True, capture_output=True)
        load_s = time.perf_counter() - t
        (tmp / "data.om").unlink()
        port = 19000 + os.getpid() % 1000
        (tmp / "p.yml").write_text("global: {scrape_interval: 1m}\nscrape_configs: []\n")
        prom = subprocess.Popen(["prometheus", f"--config.file={tmp / 'p.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=30d"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(120):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2)
                    break
                except OSError:
                    time.sleep(0.5)
            exe = str(Path(sys.executable).parent / "kvdoctor")
            t = time.perf_counter()
            r = subprocess.run([exe, "diagnose", "--prometheus", f"http://127.0.0.1:{port}", "--start", str(t0),
                                "--end", str(t_end), "--step", a.step, "--format", "json", "--selector", '{job="vllm"}',
                                *(["--gpu-selector", '{job="dcgm"}'] if a.dcgm else [])],
                               capture_output=True, text=True)
            wall = time.perf_counter() - t
        finally:
            prom.terminate()
            prom.wait(timeout=30)
        if r.returncode != 0:
            print(r.stderr)
            return 1
        out = json.loads(r.stdout)
        fl = out["fleet"]
        named = sorted({i for f in out["findings"] for i in f["instances"]})
        expect = sorted(f"10.0.{i // 250}.{i % 250}:8000" for i in sick)
        print(json.dumps({"instances": a.instances, "hours": a.hours, "scrape_s": a.scrape, "step": a.step,
                          "samples_written": lines, "generate_s": round(gen_s, 1), "promtool_s": round(load_s, 1),
                          "diagnose_wall_s": round(wall, 2), "fetch_s": fl["fetch_s"], "queries": fl["queries"],
                          "bytes": fl["bytes"], "instances_found": len(fl["instances"]),
                          "findings": [(f["rule"], f["scope"], f["kind"], len(f["instances"])) for f in out["findings"]],
                          "sick_named_correctly": named == expect,
                          "instances_with_dcgm": sum("dcgm" in j for j in fl["joined"].values()) if a.dcgm else None,
                          "warnings": fl["warnings"]}, indent=1))
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
