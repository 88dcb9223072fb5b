"""Fleet mode: every inference server behind one Prometheus, diagnosed one by one, then compared.

``fetch`` runs the query plan (query.py) and maps the answers with the engine tables to one
list of :class:`EngineSample` per instance (grouped by ``group_by`` labels, default
``instance``); DCGM exporter and kvdoctor sidecar series whose group matches no engine join the
engine on the same host (``host:port`` → ``host``) when that is unambiguous. ``diagnose_fleet``
builds one in-memory Capture per instance and runs the rules on it. With no request records,
each rule's ``min_requests`` gate is lifted (``engine_rules``): signals that need requests are
NaN there, so only rules the aggregated metrics can support fire. Fleet findings then say, per
rule, whether it fired on one replica (imbalance when that replica also takes clearly more load
than the others, else a sick host) or on all (capacity).
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections import defaultdict
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from ..engines.neutral import NEUTRAL, derive
from ..engines.rates import counter_increase
from ..model import CaptureMeta, EngineSample, Event, SourceStatus
from .client import PromClient, PromError
from . import overview
from .outliers import OUTLIERS, outlier_findings, replica_list
from .query import Planned, Selectors, discovery_selectors, plan

#: counters that say how much work a replica took, first present wins, with the unit of their rate
LOAD_SIGNALS = {"generation_tokens_total": "generated tokens/s", "prompt_tokens_total": "prompt tokens/s",
                "request_success_total": "requests/s", "requests_total": "requests/s"}
IMBALANCE_RATIO = 1.5


@dataclass
class FleetData:
    start_s: float
    end_s: float
    step_s: float
    source: str
    samples: dict[str, list[EngineSample]] = field(default_factory=dict)
    engines: dict[str, str | None] = field(default_factory=dict)
    events: dict[str, list[Event]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    #: instance -> exporters joined to it ("dcgm", "sidecar")
    joined: dict[str, set[str]] = field(default_factory=dict)
    queries: int = 0
    bytes: int = 0
    fetch_s: float = 0.0
    #: the step was chosen from the range and the scrape interval (no --step given)
    step_auto: bool = False
    scrape_interval_s: float | None = None


def _group(labels: dict[str, str], group_by: tuple[str, ...], exported: bool = False) -> str:
    """The instance a series belongs to. ``exported``: for exporter series (DCGM, sidecars),
    ``exported_pod`` etc. win over ``pod``: Prometheus renames an exporter's own ``pod`` label
    (the workload using the GPU) to that when the scrape target's ``pod`` label (the exporter's
    pod) takes its place."""
    if exported:
        labels = {**labels, **{k: labels[f"exported_{k}"] for k in group_by if labels.get(f"exported_{k}")}}
    vals = [labels[k] for k in group_by if labels.get(k)]
    if not vals:
        return "unknown"
    return vals[0] if len(group_by) == 1 else ",".join(f"{k}={labels[k]}" for k in group_by if labels.get(k))


def _host(name: str) -> str:
    return name.rsplit(":", 1)[0] if ":" in name and "=" not in name else name


def fetch(client: PromClient, start: float, end: float, step_s: float, selector: str | Selectors | None = None,
          group_by: tuple[str, ...] = ("instance",), workers: int = 4) -> FleetData:
    """Every instance's engine samples over [start, end]: one discovery call, then one
    query_range per metric name present (``selector``: a PromQL selector string for every kind
    of series, or :class:`Selectors` per kind)."""
    t_begin = time.perf_counter()
    sel = selector if isinstance(selector, Selectors) else Selectors.parse(selector)
    data = FleetData(start, end, step_s, client.url)
    try:
        names = client.label_values("__name__", discovery_selectors(sel), start, end)
    except PromError as e:
        data.warnings.append(f"warning: {e}; nothing fetched")
        data.queries, data.bytes = client.queries, client.bytes
        return data
    planned = plan(names, sel)
    if not planned:
        data.warnings.append(f"no metrics of a known engine under selector {sel} in the range")

    def run(p: Planned):
        try:
            return p, client.query_range(p.query, start, end, step_s), None
        except PromError as e:
            return p, [], e

    n = int(round((end - start) / step_s)) + 1
    grid = start + step_s * np.arange(n)
    # group -> neutral -> engine -> (priority, [arrays]) ; histograms: group -> neutral -> engine -> (prio, {labelkey: {le: arr}})
    vals: dict[str, dict[str, dict[str, list]]] = defaultdict(lambda: defaultdict(dict))
    hists: dict[str, dict[str, dict[str, list]]] = defaultdict(lambda: defaultdict(dict))
    sidecar: dict[str, dict[str, Any]] = defaultdict(dict)
    hostnames: dict[str, set[str]] = defaultdict(set)  # exporter group -> its Hostname labels
    models: dict[str, str] = {}
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for p, result, err in pool.map(run, planned):
            if err is not None:
                hint = (" (use a coarser --step or a shorter range, or raise Prometheus' --query.max-samples)"
                        if "too many samples" in str(err) else "")
                data.warnings.append(f"warning: {err}; continuing without {p.name}{hint}")
                continue
            for series in result:
                labels = series.get("metric") or {}
                exporter = p.table is None or p.table.name == "dcgm"
                g = _group(labels, group_by, exported=exporter)
                if exporter and labels.get("Hostname"):
                    hostnames[g].add(labels["Hostname"])
                arr = np.full(n, np.nan)
                for t, v in series.get("values") or ():
                    k = int(round((float(t) - start) / step_s))
                    if 0 <= k < n:
                        arr[k] = float(v)
                if p.table is None:
                    _sidecar(sidecar[g], p.name, labels, arr)
                    continue
                hit = next(((i, w) for i, w in p.entries if all(labels.get(k) == v for k, v in w.labels)), None)
                if hit is None:
                    continue
                prio, w = hit
                if g not in models:
                    m = next((labels[x] for x in p.table.model_labels if labels.get(x)), None)
                    if m:
                        models[g] = m
                target = hists if p.histogram else vals
                cur = target[g][w.neutral].get(p.table.name)
                if cur is None or prio < cur[0]:
                    cur = target[g][w.neutral][p.table.name] = [prio, [] if not p.histogram else {}]
                if cur[0] != prio:
                    continue
                if p.histogram:
                    le = labels.get("le", "+Inf")
                    le_f = math.inf if le in ("+Inf", "Inf") else float(le) * w.scale
                    key = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
                    cur[1].setdefault(key, {})[le_f] = arr
                else:
                    if NEUTRAL[w.neutral].unit == "fraction":
                        arr = np.where(arr < 0, np.nan, arr)
                    cur[1].append(arr * w.scale)
    data.queries, data.bytes = client.queries, client.bytes
    _assemble(data, grid, vals, hists, sidecar, models, hostnames)
    data.fetch_s = time.perf_counter() - t_begin
    return data


def thin_warnings(data: FleetData, lookback_s: float | None = None) -> list[str]:
    """Where the range holds too few samples to judge (a 10-minute range at a 60 s step is ten
    points, and a 2-minute overload one or two of them): say so rather than call it healthy."""
    from .query import MIN_POINTS, MIN_WINDOW_POINTS

    out = []
    if lookback_s is not None and lookback_s / data.step_s < MIN_WINDOW_POINTS:
        out.append(f"warning: too thin to judge: each {lookback_s:g}s evaluation window holds under "
                   f"{MIN_WINDOW_POINTS} samples at step {data.step_s:g}s; use a finer --step or a longer --lookback")
    thin = sorted(n for n, rows in data.samples.items() if len(rows) < MIN_POINTS)
    if thin:
        out.append(f"warning: too thin to judge {', '.join(thin[:5])}{' and more' if len(thin) > 5 else ''}: "
                   f"fewer than {MIN_POINTS} samples at step {data.step_s:g}s over {data.end_s - data.start_s:g}s; "
                   "use a finer --step (down to the scrape interval) or a longer range")
    return out


#: sidecar GPU metrics -> neutral names, used for an instance without DCGM series
SIDECAR_GPU = {"kvdoctor_gpu_memory_used_bytes": "gpu_mem_used_bytes",
               "kvdoctor_gpu_memory_total_bytes": "gpu_mem_total_bytes",
               "kvdoctor_gpu_memory_bandwidth_ratio": "gpu_dram_active_frac"}


def _sidecar(store: dict[str, Any], name: str, labels: dict[str, str], arr: np.ndarray) -> None:
    if name == "kvdoctor_info":
        host = urlsplit(labels.get("server", "")).netloc
        if host:
            store["server"] = host
    elif name == "kvdoctor_incident_active":
        if np.nanmax(arr, initial=0) > 0:
            store.setdefault("incidents", set()).add(labels.get("rule", "?"))
    elif name == "kvdoctor_kv_usage_ratio":
        store["kv_usage_frac"] = arr
    elif name in SIDECAR_GPU:
        store.setdefault("gpu", defaultdict(list))[SIDECAR_GPU[name]].append(arr)


def _combine(arrs: list[np.ndarray], agg: str) -> np.ndarray:
    a = np.vstack(arrs)
    n = np.isfinite(a).sum(axis=0)
    total = np.nansum(a, axis=0)
    with np.errstate(all="ignore"):
        out = total / n if agg == "mean" else total
    return np.where(n > 0, out, np.nan)


def _assemble(data: FleetData, grid, vals, hists, sidecar, models, hostnames) -> None:
    groups = set(vals) | set(hists)
    engine_of: dict[str, str | None] = {}
    for g in groups:
        every = [e for per in list(vals[g].values()) + list(hists[g].values()) for e in per]
        engs = [e for e in every if e != "dcgm"]
        engine_of[g] = max(set(engs), key=engs.count) if engs else ("dcgm" if every else None)
    llm = {g for g in groups if engine_of[g] not in (None, "dcgm")}
    by_host: dict[str, list[str]] = defaultdict(list)
    for g in sorted(llm):
        by_host[_host(g)].append(g)

    def home(g: str, server: str | None = None) -> str | None:
        """The engine instance an exporter's series belong to: the sidecar's watched server,
        the same group label, else the one engine on the same host (by address or DCGM's
        ``Hostname``) when there is exactly one."""
        for key in (server, g):
            if key and key in llm:
                return key
        for key in ([_host(server)] if server else []) + [_host(g)] + sorted(hostnames.get(g, ())):
            if len(by_host.get(key, ())) == 1:
                return by_host[key][0]
        return None

    merged_v: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    merged_h: dict[str, dict[str, dict]] = defaultdict(dict)
    unmatched: list[str] = []
    for g in sorted(groups):
        h = home(g)
        if h is None:
            if engine_of[g] == "dcgm":
                unmatched.append(g)
            continue
        if any("dcgm" in per for per in vals[g].values()):
            data.joined.setdefault(h, set()).add("dcgm")
        for neutral, per in vals[g].items():
            for eng, (_, arrs) in per.items():
                if arrs:
                    merged_v[h][neutral].append(_combine(arrs, NEUTRAL[neutral].agg))
        for neutral, per in hists[g].items():
            best = min(per.values(), key=lambda x: x[0])  # one engine's histogram per neutral name
            merged_h[h].setdefault(neutral, {}).update(best[1])
    if unmatched:
        data.warnings.append(
            f"DCGM series of {len(unmatched)} exporter target(s) ({', '.join(unmatched[:3])}"
            f"{', …' if len(unmatched) > 3 else ''}) match no engine instance by label, address or Hostname; "
            "left out (join them with --group-by pod and dcgm-exporter's pod mapping, or narrow --gpu-selector)")
    for g, sc in sorted(sidecar.items()):
        h = home(g, sc.get("server"))
        if h is None:
            if sc.get("incidents") or sc.get("server"):
                data.warnings.append(f"kvdoctor sidecar {g} (watching {sc.get('server', '?')}) matches no engine instance; left out")
            continue
        data.joined.setdefault(h, set()).add("sidecar")
        if "kv_usage_frac" in sc and "kv_usage_frac" not in merged_v[h]:
            merged_v[h]["kv_usage_frac"].append(sc["kv_usage_frac"])
        for neutral, arrs in sc.get("gpu", {}).items():
            if neutral not in merged_v[h]:  # DCGM, when present, is the GPU source
                merged_v[h][neutral].append(_combine(arrs, NEUTRAL[neutral].agg))
        for rule in sorted(sc.get("incidents", ())):
            data.events.setdefault(h, []).append(Event(time_s=data.end_s, kind="note", server=h,
                                                       detail={"sidecar_incident": rule}))
    for g in sorted(llm):
        cols = {k: _combine(v, NEUTRAL[k].agg) for k, v in merged_v[g].items()}
        hcols = {k: _hist_cols(v) for k, v in merged_h[g].items()}
        out: list[EngineSample] = []
        config: dict[str, Any] = {"model": models[g]} if g in models else {}
        for i, t in enumerate(grid):
            values = {k: float(a[i]) for k, a in cols.items() if math.isfinite(a[i])}
            hs = {}
            for k, (les, cum, count) in hcols.items():
                if math.isfinite(count[i]):
                    hs[k] = {"le": les, "cum": [float(c) if math.isfinite(c) else 0.0 for c in cum[:, i]],
                             "sum": None, "count": float(count[i])}
            if not values and not hs:
                continue
            derive(values, dict(config))
            out.append(EngineSample(time_s=float(t), engine=engine_of[g], server=g, values=values, histograms=hs))
        if out:
            data.samples[g] = out
            data.engines[g] = engine_of[g]


def _hist_cols(series: dict[tuple, dict[float, np.ndarray]]):
    """Label sets of one histogram summed per bucket, for the most-observed bucket scheme."""
    schemes: dict[tuple, list[dict[float, np.ndarray]]] = defaultdict(list)
    for b in series.values():
        schemes[tuple(sorted(le for le in b if le != math.inf))].append(b)

    def weight(group):
        return sum(np.nanmax(b.get(math.inf, np.zeros(1)), initial=0) for b in group)

    les, group = max(schemes.items(), key=lambda kv: weight(kv[1]))
    n = len(next(iter(group[0].values())))
    cum = np.vstack([_combine([b[le] for b in group], "sum") for le in les]) if les else np.zeros((0, n))
    infs = [b[math.inf] for b in group if math.inf in b]
    count = _combine(infs, "sum") if infs else np.full(n, np.nan)
    return list(les), cum, count


# -- diagnosis ---------------------------------------------------------------------------------

def engine_rules(rules: list) -> list:
    """Rules with their request-count gate lifted: engine-only captures have no request records."""
    return [dataclasses.replace(r, min_requests=0) for r in rules]


def capture_for(data: FleetData, server: str):
    from ..capture.memory import from_records

    meta = CaptureMeta(created_unix_s=time.time(), clock="unix", engine=data.engines.get(server), server=server,
                       origin="prometheus", sources={"prometheus": SourceStatus(True, data.source)})
    return from_records(meta, engine=data.samples[server], events=data.events.get(server, ()),
                        path=f"{data.source}#{server}")


def load_rate(samples: list[EngineSample], span_s: float) -> tuple[str | None, float]:
    """(signal, per-second increase) of the first load counter present: how much work a replica took."""
    for name in LOAD_SIGNALS:
        v = [s.values[name] for s in samples if name in s.values]
        if len(v) >= 2:
            return name, counter_increase(v) / max(span_s, 1e-9)
    return None, math.nan


#: signals every replica is summarised by: the outlier comparisons and the replica table
SUMMARY_SIGNALS = tuple(dict.fromkeys([o.signal for o in OUTLIERS] + [c[0] for c in overview.COLUMNS]))
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
    from ..diagnosis import diagnose

    diag = diagnose(capture_for(data, name), rules, options)
    w = diag.prepared.window(data.start_s, data.end_s)
    return InstanceResult(diag.incidents, diag.to_json(), {s: w.value(s) for s in SUMMARY_SIGNALS})


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
                      "load_per_s": {k: _num(v) for k, v in self.load.items()}, "load_unit": self.load_unit},
            "findings": self.findings,
            "replicas": overview.to_json(overview.replicas(self)),
            "instances": {k: v.to_json() for k, v in self.per_instance.items()},
        }


def _num(v: float) -> float | None:
    return None if v is None or not math.isfinite(v) else round(float(v), 4)


def diagnose_fleet(data: FleetData, rules: list, options, workers: int | None = None) -> FleetDiagnosis:
    per = diagnose_all(data, engine_rules(rules), options, workers)
    span = data.end_s - data.start_s
    rates = {name: load_rate(data.samples[name], span) for name in per}
    load = {name: r for name, (_, r) in rates.items()}
    unit = {name: LOAD_SIGNALS[sig] for name, (sig, _) in rates.items() if sig}
    values = {name: r.values for name, r in per.items()}
    findings = fleet_findings(per, load)
    named = {n for f in findings for n in f["instances"]}
    return FleetDiagnosis(data, per, findings + outlier_findings(values, skip=named), load, unit)


def fleet_findings(per: dict[str, Any], load: dict[str, float]) -> list[dict[str, Any]]:
    """Per rule that fired anywhere: on which replicas, and whether it is one replica's problem
    (imbalance or sick host) or the fleet's (capacity)."""
    names = sorted(per)
    fired: dict[str, dict[str, Any]] = defaultdict(dict)
    for name, diag in per.items():
        for inc in diag.incidents:
            for c in inc.causes:
                cur = fired[c.rule.id].get(name)
                if cur is None or c.confidence > cur[0].confidence:
                    fired[c.rule.id][name] = (c, inc)
    out = []
    for rid, hits in fired.items():
        affected = sorted(hits)
        healthy = [n for n in names if n not in hits]
        c0, inc0 = next(iter(hits.values()))
        if not healthy and len(names) > 1:
            scope, kind = "fleet", "capacity"
            why = f"{rid} on all {len(names)} replicas: the fleet as a whole lacks capacity (add replicas or shed load)"
        elif len(names) == 1:
            scope, kind, why = "single", "single-instance", f"{rid} on the only instance"
        else:
            scope = "replica" if len(affected) <= len(healthy) else "partial"
            la = np.nanmedian([load.get(n, np.nan) for n in affected]) if affected else np.nan
            lh = np.nanmedian([load.get(n, np.nan) for n in healthy]) if healthy else np.nan
            ratio = la / lh if math.isfinite(la) and math.isfinite(lh) and lh > 0 else math.nan
            if math.isfinite(ratio) and ratio >= IMBALANCE_RATIO:
                kind = "imbalance"
                why = (f"{rid} only on {replica_list(affected)}, which take {ratio:.1f}x the load of the healthy "
                       f"replicas ({replica_list(healthy)}): the router/load balancer sends them too much")
            elif math.isfinite(la) and math.isfinite(lh) and lh == 0 and la > 0:
                kind = "imbalance"
                why = f"{rid} only on {replica_list(affected)}; the healthy replicas ({replica_list(healthy)}) take no load at all"
            else:
                kind = "sick-host"
                why = (f"{rid} only on {replica_list(affected)} at about the same load as the healthy replicas "
                       f"({replica_list(healthy)}): look at that host (GPU, neighbours, config drift)")
        out.append({
            "rule": rid, "title": c0.rule.title, "severity": c0.rule.severity, "scope": scope, "kind": kind,
            "instances": affected, "healthy": healthy, "summary": why,
            "evidence": {n: {k: _num(v) for k, v in hits[n][0].evidence.items()} for n in affected},
        })
    rank = {"critical": 0, "warning": 1, "info": 2}
    out.sort(key=lambda f: (rank.get(f["severity"], 3), f["rule"]))
    return out


def render_text(fd: FleetDiagnosis) -> str:
    d = fd.data
    lines = [f"kvdoctor fleet diagnosis: {len(d.samples)} instance(s) from {d.source}",
             f"  range {_iso(d.start_s)} → {_iso(d.end_s)}, step {d.step_s:g}s"
             f"{' (auto: scrape interval ' + format(d.scrape_interval_s or 0, 'g') + 's)' if d.step_auto else ''}; {d.queries} queries, "
             f"{d.bytes / 1e6:.2f} MB fetched in {d.fetch_s:.1f}s"]
    lines += [f"  {w}" for w in d.warnings]
    lines.append("")
    if not fd.findings:
        lines.append("Fleet: no rule fired on any instance.")
    for f in fd.findings:
        lines.append(f"{f['severity'].upper()} {f['rule']} [{f['scope']}/{f['kind']}] on {replica_list(f['instances'], 10)}")
        lines.append(f"  {f['summary']}")
        for n, ev in f["evidence"].items():
            shown = ", ".join(f"{k}={v:g}" for k, v in ev.items() if v is not None)
            if shown:
                lines.append(f"  {n}: {shown}")
    lines.append("")
    lines.append("Instances:")
    for name, diag in fd.per_instance.items():
        rules = sorted({c.rule.id for i in diag.incidents for c in i.causes[:1]})
        side = sorted(e.detail["sidecar_incident"] for e in d.events.get(name, ()) if "sidecar_incident" in e.detail)
        extra = f"; sidecar reported: {', '.join(side)}" if side else ""
        lr = fd.load.get(name, math.nan)
        what = " + ".join([str(d.engines.get(name))] + sorted(d.joined.get(name, ())))
        load = f" (load {lr:,.1f} {fd.load_unit.get(name, '/s')})" if math.isfinite(lr) else ""
        lines.append(f"  {name} ({what}): {', '.join(rules) if rules else 'healthy'}{load}{extra}")
    return "\n".join(lines) + "\n"


def _iso(t: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- captures ----------------------------------------------------------------------------------

def records(data: FleetData):
    for name in sorted(data.samples):
        yield from data.samples[name]
        yield from data.events.get(name, ())


def meta_for(data: FleetData) -> CaptureMeta:
    engines = {e for e in data.engines.values() if e}
    return CaptureMeta(created_unix_s=time.time(), clock="unix", engine=next(iter(engines)) if len(engines) == 1 else None,
                       origin="import:prometheus-range",
                       sources={"prometheus": SourceStatus(True, f"{data.source} {data.queries} queries, {data.bytes} bytes")},
                       config={"fleet": {"start_s": data.start_s, "end_s": data.end_s, "step_s": data.step_s,
                                         "instances": sorted(data.samples), "warnings": data.warnings}})


def from_capture(folder: str | Path) -> FleetData:
    """A capture saved by ``import prometheus-range`` (or any multi-server engine capture) split
    back into instances for offline replay."""
    from ..capture.reader import _read_dicts, load_meta

    folder = Path(folder)
    meta = load_meta(folder)
    warnings: list[str] = []
    eng = _read_dicts(folder, "engine", warnings)
    evs = _read_dicts(folder, "events", warnings)
    fl = (meta.config or {}).get("fleet", {})
    times = [r["time_s"] for r in eng if "time_s" in r]
    data = FleetData(fl.get("start_s", min(times, default=0.0)), fl.get("end_s", max(times, default=0.0)),
                     fl.get("step_s", 60.0), str(folder), warnings=list(fl.get("warnings", [])) + warnings)
    for r in eng:
        s = r.get("server") or "unknown"
        data.samples.setdefault(s, []).append(EngineSample(time_s=r["time_s"], engine=r.get("engine"), server=s,
                                                           values=r.get("values") or {}, histograms=r.get("histograms") or {}))
        data.engines.setdefault(s, r.get("engine"))
    for e in evs:
        s = e.get("server") or "unknown"
        data.events.setdefault(s, []).append(Event(time_s=e["time_s"], kind=e.get("kind", "note"), server=s,
                                                   detail=e.get("detail") or {}))
    return data
