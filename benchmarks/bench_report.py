"""Benchmark: `kvdoctor report` on a 1,000,000-request capture, and how fast the page renders.

    python benchmarks/bench_report.py [--requests 1000000] [--keep DIR] [--repeat 3]

Builds the capture of benchmarks/bench_diagnose.py (same `build()`), then:

* times `kvdoctor report CAPTURE -o report.html` in a fresh process (wall, peak RSS) and
  prints the file size, with the embedded plotly.js and the figure data apart;
* opens the page in headless Chromium (Debian's /usr/bin/chromium via Playwright; see
  scripts/install-browser) and reads the time from navigation start to every chart drawn:
  the page sets ``window.__kvdoctorRendered`` (and ``__kvdoctorRenderMs``, a
  ``performance.now()`` reading) once all ``Plotly.newPlot`` promises resolve. The same is
  measured for a page holding plotly.js alone: the part no report can go below.

Targets: file <= ~10 MB; render < ~2 s. Headless Chromium here draws WebGL in software
(SwiftShader), so a desktop browser with a GPU draws the scatters faster than measured.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_diagnose import build, timed  # noqa: E402

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def render_times(pages: list[Path], repeat: int, chromium: str) -> dict[Path, list[tuple[float, float, float]]]:
    """Per page, ``repeat`` loads in a fresh tab: (ms to all charts drawn, ms when the page's own
    script started, i.e. after plotly.js was parsed and run, wall ms seen from here)."""
    from playwright.sync_api import sync_playwright

    out: dict[Path, list[tuple[float, float, float]]] = {p: [] for p in pages}
    profile = tempfile.mkdtemp(prefix="kvd-bench-chromium-")
    with sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(profile, executable_path=chromium, headless=True, args=FLAGS,
                                                    viewport={"width": 1360, "height": 1000})
        try:
            for _ in range(repeat):
                for path in pages:
                    page = ctx.new_page()
                    errors: list[str] = []
                    page.on("pageerror", lambda e: errors.append(str(e)))
                    t = time.perf_counter()
                    page.goto(path.resolve().as_uri())
                    page.wait_for_function("window.__kvdoctorRendered === true || !!window.__kvdoctorRenderError",
                                           timeout=120_000)
                    wall = (time.perf_counter() - t) * 1000
                    err = page.evaluate("window.__kvdoctorRenderError || null")
                    if err or errors:
                        raise SystemExit(f"{path}: render failed: {err or errors}")
                    out[path].append((page.evaluate("window.__kvdoctorRenderMs"),
                                      page.evaluate("window.__kvdoctorScriptMs || 0"), wall))
                    page.close()
        finally:
            ctx.close()
    return out


def plotly_only_page(folder: Path) -> Path:
    from plotly.offline import get_plotlyjs

    path = folder / "plotly-only.html"
    path.write_text("<!DOCTYPE html><html><head><meta charset='utf-8'><script>" + get_plotlyjs() + "</script></head><body>"
                    "<script>window.__kvdoctorScriptMs = performance.now(); window.__kvdoctorRenderMs = performance.now();"
                    "window.__kvdoctorRendered = true;</script></body></html>")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--keep", type=Path, help="build the capture here and keep it (reused when present)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each measurement; best and median are reported")
    ap.add_argument("--chromium", default=os.environ.get("KVDOCTOR_CHROMIUM", "/usr/bin/chromium"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvd-bench-report-"))
    folder = args.keep or work / "cap"
    if not (folder / "meta.json").exists():
        t = time.perf_counter()
        build(folder, args.requests)
        print(f"built {args.requests:,} requests in {time.perf_counter() - t:.1f} s "
              f"({sum(p.stat().st_size for p in folder.glob('*.jsonl')) / 2**20:.0f} MiB)")
    kvd = str(Path(sys.executable).parent / "kvdoctor")
    out = work / "report.html"
    runs = [timed([kvd, "report", str(folder), "-o", str(out)]) for _ in range(args.repeat)]
    wall, rss = min(r[0] for r in runs), max(r[1] for r in runs)
    diag = [timed([kvd, "diagnose", str(folder), "--format", "json"])[0] for _ in range(min(args.repeat, 2))]
    print(f"kvdoctor report            wall {wall:6.2f} s   peak RSS {rss:5.0f} MiB   "
          f"(diagnose alone {min(diag):.2f} s: the report adds {wall - min(diag):.2f} s)")
    page = out.read_text(encoding="utf-8")
    m = re.search(r'<script type="application/json" id="kvd-figures">(.*?)</script>', page, re.S)
    figures = len(m.group(1).encode()) if m else 0
    from plotly.offline import get_plotlyjs

    js = len(get_plotlyjs().encode())
    size = out.stat().st_size
    print(f"report.html                {size / 1e6:6.2f} MB = plotly.js {js / 1e6:.2f} MB + figure data {figures / 1e6:.2f} MB "
          f"+ page {(size - js - figures) / 1e6:.2f} MB   (target <= ~10 MB)")
    if not Path(args.chromium).exists():
        print(f"render: skipped, no Chromium at {args.chromium} (scripts/install-browser)")
        return
    base = plotly_only_page(work)
    times = render_times([out, base], args.repeat, args.chromium)
    rep, floor = times[out], times[base]
    best = min(r[0] for r in rep)
    med = statistics.median(r[0] for r in rep)
    print(f"render (navigation → all charts drawn)  best {best / 1000:.2f} s   median {med / 1000:.2f} s   (target < ~2 s)")
    print(f"  of which plotly.js parse+run          best {min(r[1] for r in rep) / 1000:.2f} s; charts drawn in "
          f"{min(r[0] - r[1] for r in rep) / 1000:.2f} s")
    print(f"  a page with plotly.js alone           best {min(r[0] for r in floor) / 1000:.2f} s   median "
          f"{statistics.median(r[0] for r in floor) / 1000:.2f} s")
    print(f"  wall from Playwright (incl. tab open) best {min(r[2] for r in rep) / 1000:.2f} s")
    version = subprocess.run([args.chromium, "--version"], capture_output=True, text=True).stdout.strip()
    print(f"machine: {os.cpu_count()} cores, {version}, headless, --disable-gpu (WebGL in software)")


if __name__ == "__main__":
    main()
