"""Fleet diagnosis: every replica diagnosed on its own by the rules, then compared.

``diagnose_fleet`` builds one in-memory Capture per instance (kvdoctor.prometheus.capture_for) and runs the rules
on it. With no request records, each rule's ``min_requests`` gate is lifted (``engine_rules``):
signals that need requests are NaN there, so only rules the aggregated metrics can support
fire. findings.py then says, per rule, whether it fired on one replica or on all, and
outliers.py which replicas are far from their peers.
"""
from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..diagnosis import diagnose
from ..engines import counter_increase
from ..model import EngineSample
from ..prometheus import FleetData, capture_for
from . import overview
from .findings import fleet_findings, num
from .outliers import outlier_findings, outlier_signals

#: counters that say how much work a replica took, first present wins, with the unit of their rate
LOAD_SIGNALS = {"generation_tokens_total": "generated tokens/s", "prompt_tokens_total": "prompt tokens/s",
                "request_success_total": "requests/s", "requests_total": "requests/s"}


def engine_rules(rules: list) -> list:
    """Rules with their request-count gate lifted: engine-only captures have no request records."""
    return [dataclasses.replace(r, min_requests=0) for r in rules]


def load_rate(samples: list[EngineSample], span_s: float) -> tuple[str | None, float]:
    """(signal, per-second increase) of the first load counter present: how much work a replica took."""
    for name in LOAD_SIGNALS:
        v = [s.values[name] for s in samples if name in s.values]
        if len(v) >= 2:
            return name, counter_increase(v) / max(span_s, 1e-9)
    return None, math.nan


def summary_signals(rules: list) -> tuple[str, ...]:
    """Signals every replica is summarised by: the rules' fleet outliers and the replica table."""
    return tuple(dict.fromkeys([*outlier_signals(rules), *(c[0] for c in overview.COLUMNS)]))


#: below this many replicas, worker processes cost more than they save
PARALLEL_MIN = 32


@dataclass
class InstanceResult:
    """One replica's diagnosis, reduced to what the fleet view uses: its incidents, its normal
    diagnose JSON and its summary signals over the whole range. Picklable, so that replicas can
    be diagnosed in worker processes."""
    incidents: list
    json: dict[str, Any]
    values: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        return self.json


def diagnose_instance(data: FleetData, name: str, rules: list, options) -> InstanceResult:
    diag = diagnose(capture_for(data, name), rules, options)
    w = diag.prepared.window(data.start_s, data.end_s)
    return InstanceResult(diag.incidents, diag.to_json(), {s: w.value(s) for s in summary_signals(rules)})


_FORKED: tuple | None = None  # (data, rules, options) that forked workers inherit


def _diagnose_chunk(names: list[str]) -> list[tuple[str, InstanceResult]]:
    data, rules, options = _FORKED
    return [(n, diagnose_instance(data, n, rules, options)) for n in names]


def diagnose_all(data: FleetData, rules: list, options, workers: int | None = None) -> dict[str, InstanceResult]:
    """Every replica diagnosed on its own; in ``workers`` forked processes (default: one per
    core, at most 8) when there are many replicas. The replicas' data reaches the workers by
    fork, not by pickling; only the small results come back."""
    global _FORKED
    names = sorted(data.samples)
    workers = min(os.cpu_count() or 1, 8) if workers is None else workers
    if workers <= 1 or len(names) < PARALLEL_MIN or "fork" not in multiprocessing.get_all_start_methods():
        return {n: diagnose_instance(data, n, rules, options) for n in names}
    size = max(1, math.ceil(len(names) / (workers * 4)))
    chunks = [names[i:i + size] for i in range(0, len(names), size)]
    _FORKED = (data, rules, options)
    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            done = dict(pair for part in pool.map(_diagnose_chunk, chunks) for pair in part)
    finally:
        _FORKED = None
    return {n: done[n] for n in names}


@dataclass
class FleetDiagnosis:
    data: FleetData
    per_instance: dict[str, InstanceResult]
    findings: list[dict[str, Any]]
    load: dict[str, float]
    load_unit: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = self.data
        return {
            "schema_version": 1,
            "fleet": {"source": d.source, "start_s": d.start_s, "end_s": d.end_s, "step_s": d.step_s,
                      "step_auto": d.step_auto, "scrape_interval_s": d.scrape_interval_s,
                      "instances": sorted(d.samples), "queries": d.queries, "bytes": d.bytes,
                      "fetch_s": round(d.fetch_s, 3), "warnings": d.warnings,
                      "joined": {k: sorted(d.joined.get(k, ())) for k in sorted(d.samples)},
                      "load_per_s": {k: num(v) for k, v in self.load.items()}, "load_unit": self.load_unit},
            "findings": self.findings,
            "replicas": overview.to_json(overview.replicas(self)),
            "instances": {k: v.to_json() for k, v in self.per_instance.items()},
        }


def diagnose_fleet(data: FleetData, rules: list, options, workers: int | None = None) -> FleetDiagnosis:
    per = diagnose_all(data, engine_rules(rules), options, workers)
    span = data.end_s - data.start_s
    rates = {name: load_rate(data.samples[name], span) for name in per}
    load = {name: r for name, (_, r) in rates.items()}
    unit = {name: LOAD_SIGNALS[sig] for name, (sig, _) in rates.items() if sig}
    values = {name: r.values for name, r in per.items()}
    findings = fleet_findings(per, load)
    named = {n for f in findings for n in f["instances"]}
    return FleetDiagnosis(data, per, findings + outlier_findings(values, rules, skip=named), load, unit)
