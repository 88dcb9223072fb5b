"""One row per replica for the fleet page: what it is, what fired on it, and the few numbers
that tell replicas apart. Analysis only; kvdoctor/report/fleet_html.py draws it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..numeric import json_number

#: columns of the replica table: (signal, header, unit for formatting)
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("ttft_p99_s", "TTFT P99", "s"),
    ("requests_waiting_p50", "waiting P50", "requests"),
    ("kv_usage_p50_frac", "KV usage P50", "fraction"),
    ("preemptions_per_min", "preemptions", "1/min"),
    ("error_rate", "error rate", "fraction"),
    ("mem_bw_util_p90", "DRAM busy P90", "fraction"),
)


@dataclass
class Replica:
    name: str
    engine: str | None
    joined: list[str]
    status: str  # "rule" | "outlier" | "healthy"
    findings: list[str]
    load_per_s: float
    load_unit: str
    values: dict[str, float] = field(default_factory=dict)


def replicas(fd) -> list[Replica]:
    """Replicas with a finding first (rules before outliers), then by load, busiest first."""
    d = fd.data
    by: dict[str, list[tuple[str, str]]] = {}
    for f in fd.findings:
        for n in f["instances"]:
            by.setdefault(n, []).append((f["kind"], f["rule"]))
    out = []
    for name, res in fd.per_instance.items():
        kinds = {k for k, _ in by.get(name, [])}
        status = "healthy" if not kinds else ("outlier" if kinds == {"outlier"} else "rule")
        out.append(Replica(name, d.engines.get(name), sorted(d.joined.get(name, ())), status,
                           [r for _, r in by.get(name, [])], fd.load.get(name, math.nan),
                           fd.load_unit.get(name, "/s"), {s: res.values.get(s, math.nan) for s, _, _ in COLUMNS}))
    rank = {"rule": 0, "outlier": 1, "healthy": 2}
    out.sort(key=lambda r: (rank[r.status], -(r.load_per_s if math.isfinite(r.load_per_s) else -1), r.name))
    return out


def series(fd, name: str, neutral: str) -> tuple[np.ndarray, np.ndarray]:
    """(times, values) of one engine value of one replica over the range (NaN where absent)."""
    samples = fd.data.samples.get(name, [])
    t = np.array([s.time_s for s in samples], dtype=float)
    v = np.array([s.values.get(neutral, math.nan) for s in samples], dtype=float)
    return t, v


def to_json(rows: list[Replica]) -> list[dict[str, Any]]:
    return [{"instance": r.name, "engine": r.engine, "joined": r.joined, "status": r.status, "findings": r.findings,
             "load_per_s": json_number(r.load_per_s), "load_unit": r.load_unit,
             "values": {k: json_number(v) for k, v in r.values.items()}} for r in rows]
