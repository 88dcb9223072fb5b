#!/usr/bin/env python3
"""Where a process's CPU went, from py-spy's collapsed stacks (``py-spy record --format raw``).

    python benchmarks/spy_summary.py FILE [FILE ...] [--top 25] [--threads]

Prints the share of samples per function as the innermost frame (self) and anywhere on the stack
(total), per process and thread when ``--threads`` (py-spy ``--subprocesses`` names them in the
first frame). Used with ``bench_relay_scale.py --py-spy DIR``.
"""
from __future__ import annotations

import argparse
import collections
import re
import sys

_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def _name(frame: str) -> str:
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    f = m["file"]
    for cut in ("site-packages/", "kvdoctor/", "lib/python3"):
        i = f.find(cut)
        if i >= 0:
            f = f[i:]
            break
    return f"{m['fn']} ({f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--threads", action="store_true", help="also the share per process/thread")
    args = ap.parse_args()
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    n = 0
    for path in args.files:
        for line in open(path, encoding="utf-8", errors="replace"):
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            c = int(count)
            frames = stack.split(";")
            n += c
            threads[frames[0]] += c
            names = [_name(f) for f in frames[1:]] or [frames[0]]
            own[names[-1]] += c
            for name in set(names):
                total[name] += c
    if not n:
        print("no samples", file=sys.stderr)
        return 1
    print(f"{n} samples")
    if args.threads:
        print("\nby process/thread:")
        for t, c in threads.most_common(12):
            print(f"  {100 * c / n:5.1f}%  {t[:110]}")
    print("\nself (innermost frame):")
    for name, c in own.most_common(args.top):
        print(f"  {100 * c / n:5.1f}%  {name[:120]}")
    print("\ntotal (anywhere on the stack):")
    for name, c in total.most_common(args.top):
        print(f"  {100 * c / n:5.1f}%  {name[:120]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
