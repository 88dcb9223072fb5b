"""Benchmark: `kvdoctor diagnose` on a 1,000,000-request capture.

    python benchmarks/bench_diagnose.py [--requests 1M] [--since 2h] [--report] [--keep DIR] [--repeat 3]

Builds a capture with a realistic mix (prompt lengths resampled from the Azure LLM inference
code trace shipped in tests/data/traces, multi-turn sessions, Poisson arrivals over 24 h,
latencies from a prefill + bandwidth-shared decode model), then times, each in a fresh
process: `kvdoctor diagnose --format json` (wall time, peak RSS) and the fastest plain load
of the same files (pyarrow's JSON reader; orjson line by line for reference) as the floor.
Targets (issue 33, an idle 2-core machine, 1M requests): diagnose <= 2.5x the floor measured in
the same run, peak RSS <= 700 MiB. scripts/test runs it at 100,000 requests after the tests and
prints the figures (a smoke: timings on a shared CI machine are not asserted).

`--requests 3M` / `10M` measure how time and memory grow (the orjson reference is left out
above 3M: ten million dicts do not fit); `--since 2h` adds `diagnose --since 2h`, the last
2 of the 24 hours, which reads only the segments that range meets (the segment index).
`--report` adds `kvdoctor report` (one HTML file; its size is printed: issue 33 asks <= 10 MB at
10M requests) and `kvdoctor compare` of the day's first half against its second (the
`CAPTURE@T1..T2` ranges: two loads of the capture, each cut to its half).
"""
from __future__ import annotations

import argparse
import csv
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from kvdoctor.capture.writer import append_index  # noqa: E402
AZURE = ROOT / "tests" / "data" / "traces" / "azure2023_AzureLLMInferenceTrace_code_head2000.csv"


def prompt_lengths(rng, n: int) -> np.ndarray:
    if AZURE.exists():
        with open(AZURE) as f:
            ctx = np.array([float(r["ContextTokens"]) for r in csv.DictReader(f)])
        return rng.choice(ctx, n)
    return rng.lognormal(7, 1.0, n).astype(int)


def build(folder: Path, n: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    t0 = 1_767_000_000.0
    arrival = t0 + np.sort(rng.uniform(0, 86_400, n))
    prompt = prompt_lengths(rng, n)
    output = rng.integers(20, 600, n)
    turns = rng.integers(1, 9, n)
    session = rng.integers(0, n // 5, n)
    conc = 1 + rng.poisson(8, n)
    ttft = 0.02 + prompt * 0.00012 * rng.lognormal(0, 0.2, n)
    tpot = 0.008 * (1 + 0.05 * conc) * (1 + 0.02 * (prompt / 1000)) * rng.lognormal(0, 0.1, n)
    e2e = ttft + tpot * (output - 1)
    err = rng.random(n) < 0.002
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "meta.json").write_bytes(orjson.dumps({"format_version": 1, "clock": "unix", "engine": "vllm",
                                                      "model": "synthetic-7b", "origin": "benchmark"}))
    per_segment = 250_000
    for s in range(0, n, per_segment):
        lines = []
        for i in range(s, min(n, s + per_segment)):
            rec = {"request_id": f"r{i}", "arrival_s": arrival[i], "ttft_s": ttft[i], "e2e_s": e2e[i],
                   "prompt_tokens": int(prompt[i]), "output_tokens": int(output[i]), "session_id": f"s{session[i]}",
                   "turn": int(turns[i]), "status": "error" if err[i] else "ok"}
            if err[i]:
                rec["error"] = "upstream timeout"
            lines.append(orjson.dumps(rec, option=orjson.OPT_SERIALIZE_NUMPY))
        name = f"requests-{s // per_segment + 1:06d}.jsonl"
        (folder / name).write_bytes(b"\n".join(lines) + b"\n")
        # indexed as CaptureWriter indexes a closed segment, so --since reads only what it needs
        part = slice(s, min(n, s + per_segment))
        append_index(folder, name, (folder / name).stat().st_size, part.stop - part.start,
                     float(arrival[part].min()), float((arrival[part] + e2e[part]).max()))


#: runs a command and reports its own peak RSS: RUSAGE_CHILDREN of a fresh wrapper process
#: covers exactly that one child (ours would keep the maximum over every earlier run)
_WRAP = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
         "r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL); w = time.perf_counter() - t; "
         "print(w, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, r.returncode)")


def timed(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of one run of a command."""
    out = subprocess.run([sys.executable, "-c", _WRAP, *cmd], capture_output=True, text=True)
    wall, rss_kib, rc = out.stdout.split()
    if rc != "0":
        raise SystemExit(f"{' '.join(cmd)} failed (exit {rc}): {out.stderr[-2000:]}")
    return float(wall), float(rss_kib) / 1024


FLOOR_ARROW = """
import sys, io, pyarrow.json as j, pathlib
rows = 0
for p in sorted(pathlib.Path(sys.argv[1]).glob('requests-*.jsonl')):
    rows += j.read_json(p).num_rows
print(rows)
"""
FLOOR_ORJSON = """
import sys, orjson, pathlib
rows = []
for p in sorted(pathlib.Path(sys.argv[1]).glob('requests-*.jsonl')):
    with open(p, 'rb') as f:
        rows.extend(orjson.loads(line) for line in f)
print(len(rows))
"""


def _count(text: str) -> int:
    mult = {"k": 1_000, "m": 1_000_000}.get(text[-1:].lower(), 1)
    try:
        return int(float(text[:-1] if mult > 1 else text) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count like 1000000, 3M or 100k, got {text!r}") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=_count, default=1_000_000, help="requests in the capture: 1000000, 3M, 100k")
    ap.add_argument("--since", metavar="DURATION",
                    help="also time `diagnose --since DURATION` (e.g. 2h: the capture's last 2 of 24 hours; "
                         "only the segments that range meets are read)")
    ap.add_argument("--report", action="store_true",
                    help="also time `kvdoctor report` (and print the HTML file's size) and `kvdoctor compare` "
                         "of the first 12 hours against the last 12")
    ap.add_argument("--keep", type=Path, help="build the capture here and keep it")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs of each command, in turn (floor, reference, diagnose, floor, ...); best and median reported")
    args = ap.parse_args()
    scratch = None if args.keep else Path(tempfile.mkdtemp(prefix="kvd-bench-"))
    try:
        run(args.keep or scratch / "cap", args)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def run(folder: Path, args: argparse.Namespace) -> None:
    if not (folder / "meta.json").exists():
        t = time.perf_counter()
        build(folder, args.requests)
        print(f"built {args.requests:,} requests in {time.perf_counter() - t:.1f} s "
              f"({sum(p.stat().st_size for p in folder.glob('*.jsonl')) / 2**20:.0f} MiB)")
    py = sys.executable
    kvd = [str(Path(py).parent / "kvdoctor")]
    cmds = {"floor: pyarrow.json": [py, "-c", FLOOR_ARROW, str(folder)],
            "reference: orjson to dicts": [py, "-c", FLOOR_ORJSON, str(folder)],
            "kvdoctor diagnose": kvd + ["diagnose", str(folder), "--format", "json"]}
    if args.requests > 3_000_000:  # ~1 KiB of Python objects a request: 10M dicts would not fit in memory
        del cmds["reference: orjson to dicts"]
    if args.since:
        cmds[f"diagnose --since {args.since}"] = kvd + ["diagnose", str(folder), "--format", "json", "--since", args.since]
    html = folder.parent / f"{folder.name}-report.html"
    if args.report:
        cmds["kvdoctor report"] = kvd + ["report", str(folder), "-o", str(html)]
        cmds["kvdoctor compare halves"] = kvd + ["compare", f"{folder}@..+43200", f"{folder}@+43200..",
                                                 "--format", "json"]
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in cmds}
    for _ in range(args.repeat):  # in turn, so a machine that slows down mid-run slows every command alike
        for name, cmd in cmds.items():
            runs[name].append(timed(cmd))
    for name, rs in runs.items():
        walls = [w for w, _ in rs]
        print(f"{name:<26} wall {min(walls):6.2f} s (median {statistics.median(walls):.2f})   "
              f"peak RSS {max(r for _, r in rs):7.0f} MiB")
    d_walls = [w for w, _ in runs["kvdoctor diagnose"]]
    f_walls = [w for w, _ in runs["floor: pyarrow.json"]]
    d_rss = max(r for _, r in runs["kvdoctor diagnose"])
    print(f"diagnose / floor = {min(d_walls) / min(f_walls):.2f}x best, "
          f"{statistics.median(d / f for d, f in zip(d_walls, f_walls)):.2f}x median of pairs "
          f"(target <= 2.5x at 1M requests); peak RSS {d_rss:.0f} MiB (target <= 700 MiB at 1M requests); "
          f"{args.requests:,} requests")
    if args.report:
        print(f"report: {html.stat().st_size / 1e6:.2f} MB (target <= 10 MB at 10M requests)")
        html.unlink()
    print(f"machine: {os.cpu_count()} cores, python {sys.version.split()[0]}")


if __name__ == "__main__":
    main()
