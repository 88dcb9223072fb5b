"""Fetch: every inference server behind one Prometheus, as engine samples per instance.

``fetch`` runs the query plan (query.py) and maps the answers with the engine tables to one
list of :class:`EngineSample` per instance (grouped by ``group_by`` labels, default
``instance``); DCGM exporter and kvdoctor sidecar series whose group matches no engine join the
engine on the same host (``host:port`` → ``host``) when that is unambiguous.
"""
from __future__ import annotations

import math
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from ..engines.neutral import NEUTRAL, derive
from ..model import EngineSample, Event
from .client import PromClient, PromError
from .query import MIN_POINTS, MIN_WINDOW_POINTS, Planned, Selectors, discovery_selectors, plan


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
