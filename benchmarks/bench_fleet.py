"""Fleet-mode cost: N vLLM instances × H hours in a real Prometheus TSDB, one diagnosis over it.

The history (harness/fleetdata.py): 6 key vLLM metrics with realistic values and a few
sick instances that queue; with --dcgm, also one DCGM exporter target per instance on the same
address, port 9400, job "dcgm" (framebuffer used/free and DRAM activity of its GPU). It is
loaded with ``promtool tsdb create-blocks-from openmetrics`` into a real Prometheus, and
``kvdoctor diagnose --prometheus URL --start --end --step`` is timed: wall time, queries, bytes.
Usage: python benchmarks/bench_fleet.py [--instances 200] [--hours 24] [--scrape 60] [--step 5m] [--dcgm]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout root: the harness package

from harness.fleetdata import PrometheusOnBlocks, instance_name  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--instances", type=int, default=200)
    ap.add_argument("--hours", type=float, default=24)
    ap.add_argument("--scrape", type=int, default=60)
    ap.add_argument("--step", default="5m")
    ap.add_argument("--sick", type=int, default=3)
    ap.add_argument("--dcgm", action="store_true", help="add one DCGM exporter target per instance (job dcgm)")
    a = ap.parse_args()
    sick = set(range(0, a.instances, max(1, a.instances // a.sick)))  # every (n/sick)-th
    try:
        prom = PrometheusOnBlocks(a.instances, a.hours, sick, scrape_s=a.scrape, dcgm=a.dcgm).__enter__()
    except FileNotFoundError as e:
        print(e)
        return 1
    try:
        exe = str(Path(sys.executable).parent / "kvdoctor")
        t = time.perf_counter()
        r = subprocess.run([exe, "diagnose", "--prometheus", prom.url, "--start", str(prom.start_s),
                            "--end", str(prom.end_s), "--step", a.step, "--format", "json", "--selector", '{job="vllm"}',
                            *(["--gpu-selector", '{job="dcgm"}'] if a.dcgm else [])],
                           capture_output=True, text=True)
        wall = time.perf_counter() - t
    finally:
        prom.__exit__()
    if r.returncode != 0:
        print(r.stderr)
        return 1
    out = json.loads(r.stdout)
    fl = out["fleet"]
    named = sorted({i for f in out["findings"] for i in f["instances"]})
    print(json.dumps({"instances": a.instances, "hours": a.hours, "scrape_s": a.scrape, "step": a.step,
                      "samples_written": prom.samples, "generate_s": round(prom.generate_s, 1),
                      "promtool_s": round(prom.promtool_s, 1),
                      "diagnose_wall_s": round(wall, 2), "fetch_s": fl["fetch_s"], "queries": fl["queries"],
                      "bytes": fl["bytes"], "instances_found": len(fl["instances"]),
                      "findings": [(f["rule"], f["scope"], f["kind"], len(f["instances"])) for f in out["findings"]],
                      "sick_named_correctly": named == sorted(instance_name(i) for i in sick),
                      "instances_with_dcgm": sum("dcgm" in j for j in fl["joined"].values()) if a.dcgm else None,
                      "warnings": fl["warnings"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
