#!/usr/bin/env python3
"""The fault benchmark: inject known faults into real servers (llama.cpp and vLLM on CPU) with
kvdoctor attached, and score its verdicts against the injected fault.

    python benchmarks/faults/run.py --quick                 # one setting per class, both engines
    python benchmarks/faults/run.py --write-docs            # every setting; results.json + docs/accuracy.md
    python benchmarks/faults/run.py --class crash --engine vllm
    python benchmarks/faults/run.py --rescore benchmarks/faults/results.json --write-docs

Each run's label is the fault it injects (benchmarks/faults/zoo.py), never kvdoctor's output.
The results file is rewritten after every run, so an interrupted benchmark keeps what it measured.
Needs the test harness's servers (scripts/test installs them: llama-server, vLLM CPU, nginx).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.faults import score as scoring  # noqa: E402
from benchmarks.faults import zoo  # noqa: E402

RESULTS = ROOT / "benchmarks" / "faults" / "results.json"
NOTES = ROOT / "benchmarks" / "faults" / "NOTES.md"
DOC = ROOT / "docs" / "accuracy.md"


def render_doc(results: dict) -> str:
    notes = NOTES.read_text() if NOTES.exists() else ""
    return scoring.render({**results, "notes": notes})


def _meta(argv: list[str], wall_s: float) -> dict:
    import kvdoctor

    try:
        from harness.vllm_server import ensure_vllm
        import subprocess

        vllm = subprocess.run([str(ensure_vllm(install=False)), "-c", "import vllm; print(vllm.__version__)"],
                              capture_output=True, text=True, timeout=120).stdout.strip()
    except Exception:  # noqa: BLE001 - only a label in the doc
        vllm = ""
    cpu = platform.machine()
    with contextlib.suppress(OSError):
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), cpu)
    from harness.vllm_server import cpu_dtype

    return {"command": "python benchmarks/faults/run.py " + shlex.join(argv), "date": datetime.date.today().isoformat(),
            "machine": f"{os.cpu_count()} cores ({cpu}; vLLM in {cpu_dtype()}), Python {platform.python_version()}",
            "kvdoctor": kvdoctor.__version__, "vllm_version": vllm, "wall_s": round(wall_s)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one setting per class (its shortest, marked quick in --list), both engines, "
                    f"{zoo.QUICK_SHARE * 100:.0f}%% of each load's requests: proves the benchmark runs and scores (~12 min); "
                    "its scores are not the benchmark's figures")
    ap.add_argument("--engine", choices=["llamacpp", "vllm", "both"], default="both")
    ap.add_argument("--class", dest="classes", action="append", default=[], metavar="CLASS",
                    help="run only this fault class, or one setting as CLASS/SETTING (repeatable); --list shows them")
    ap.add_argument("--list", action="store_true", help="list the fault classes and settings, run nothing")
    ap.add_argument("--results", type=Path, help=f"results JSON (default: {RESULTS.relative_to(ROOT)}; "
                    "with --quick, results-quick.json in the captures folder)")
    ap.add_argument("--captures", type=Path, help="where the runs' captures go (default: a temporary folder)")
    ap.add_argument("--write-docs", action="store_true", help=f"write {DOC.relative_to(ROOT)} from the results")
    ap.add_argument("--resume", type=Path, metavar="RESULTS",
                    help="keep the runs of this results file that ran (e.g. a --quick run's) and run only the rest")
    ap.add_argument("--rescore", type=Path, metavar="RESULTS", help="score an existing results file, run nothing")
    args = ap.parse_args(argv)

    if args.list:
        for f in zoo.FAULTS:
            label = ", ".join(map(str, f.expect)) or "nothing pages"
            print(f"{f.id:45} {'/'.join(f.engines):16} {'quick ' if f.quick else '      '}{label}")
        return 0
    if args.rescore:
        try:
            results = json.loads(args.rescore.read_text())
        except (OSError, ValueError) as e:
            print(f"kvdoctor faults: {args.rescore}: cannot read a results file ({e})", file=sys.stderr)
            return 2
        results["score"] = scoring.score(results["runs"])
        args.rescore.write_text(json.dumps(results, indent=1) + "\n")
        _print_summary(results["score"])
        if args.write_docs:
            DOC.write_text(render_doc(results))
            print(f"wrote {DOC}", file=sys.stderr)
        return 0

    engines = zoo.BOTH if args.engine == "both" else (args.engine,)
    unknown = set(args.classes) - {f.cls for f in zoo.FAULTS} - {f.id for f in zoo.FAULTS}
    if unknown:
        print(f"kvdoctor faults: --class: no class {sorted(unknown)}; --list shows them", file=sys.stderr)
        return 2
    runs = zoo.select(quick=args.quick, engines=engines, classes=tuple(args.classes))
    captures = args.captures or Path(tempfile.mkdtemp(prefix="kvd-faults-"))
    results_path = args.results or (captures / "results-quick.json" if args.quick else RESULTS)
    from benchmarks.faults.runner import ServerPool, run_one

    t0 = time.time()
    results: dict = {"runs": []}
    if args.resume:
        try:
            kept = [r for r in json.loads(args.resume.read_text())["runs"] if "error" not in r]
        except (OSError, ValueError, KeyError) as e:
            print(f"kvdoctor faults: {args.resume}: cannot read a results file ({e})", file=sys.stderr)
            return 2
        wanted = {(f.cls, f.setting, e) for f, e in runs}
        results["runs"] = [r for r in kept if (r["class"], r["setting"], r["engine"]) in wanted]
        done = {(r["class"], r["setting"], r["engine"]) for r in results["runs"]}
        runs = [(f, e) for f, e in runs if (f.cls, f.setting, e) not in done]
        print(f"resuming: {len(done)} runs kept from {args.resume}, {len(runs)} to run", file=sys.stderr)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    with ServerPool(log) as pool:
        for n, (fault, engine) in enumerate(runs, 1):
            out = captures / f"{engine}-{fault.cls}-{fault.setting}"
            log(f"[{n}/{len(runs)}] {fault.id} on {engine}: {fault.what}")
            try:
                rec = run_one(fault, engine, out, pool, log=log, share=zoo.QUICK_SHARE if args.quick else 1.0)
            except Exception as e:  # noqa: BLE001 - one broken run must not lose the others
                rec = {"class": fault.cls, "setting": fault.setting, "engine": engine, "what": fault.what,
                       "expect": [[c.rule, c.says] for c in fault.expect], "error": f"{type(e).__name__}: {e}"[:500]}
            if fault.kind == "crash" and engine == zoo.VLLM:
                pool.discard()  # the crash took the shared server down
            results["runs"].append(rec)
            j = scoring.judge(rec) if "error" not in rec else None
            log(f"    -> {'ERROR ' + rec['error'] if j is None else scoring.verdict_name(rec)}"
                f"{'' if j is None else (' right' if j['top1'] else ' WRONG')}"
                f"{'' if rec.get('injected', True) else ' (fault did not take effect: left out)'}"
                f" in {rec.get('wall_s', 0):.0f} s")
            results["score"] = scoring.score(results["runs"])
            results["meta"] = {**_meta(argv, time.time() - t0), "vllm_starts": pool.starts}
            results_path.parent.mkdir(parents=True, exist_ok=True)
            results_path.write_text(json.dumps(results, indent=1) + "\n")
    _print_summary(results.get("score") or scoring.score([]))
    log(f"results: {results_path}; captures: {captures}; {time.time() - t0:.0f} s")
    if args.write_docs:
        DOC.write_text(render_doc(results))
        log(f"wrote {DOC}")
    return 0


def _print_summary(s: dict) -> None:
    p = scoring._pct
    print(f"top-1 {p(s['top1'])} of {s['fault_runs']} fault runs, top-3 {p(s['top3'])}, "
          f"false incidents {p(s['false_incident_rate'])} of {s['control_runs']} controls, "
          f"live=offline {p(s['live_offline_agreement'])}, onset offline median {scoring._s(s['onset_offline']['median_s'])}")
    for cls, c in s["per_class"].items():
        print(f"  {cls:20} recall {p(c['recall']):>5}  top-3 {p(c['top3']):>5}  precision {p(c['precision']):>5}  ({c['runs']} runs)")


if __name__ == "__main__":
    sys.exit(main())
