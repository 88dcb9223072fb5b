"""One Prometheus text scrape → an :class:`EngineSample` with neutral names, plus config.

Parsing is ``prometheus_client.parser``'s. Engines are recognised by metric name prefix (several
may share one scrape, e.g. vLLM plus DCGM behind one federation endpoint). Per neutral name the
first wire name of the engine's table that is present wins (current names are listed before old
ones, so a vLLM 0.10 scrape exposing both ``kv_cache_usage_perc`` and ``gpu_cache_usage_perc``
is not double-counted); the label sets of that wire name then combine by the neutral name's
``agg``: counts and counters sum (several ``model_name`` or ``engine`` series of one server
become one server total), fractions average. Values of different engines combine the same way.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Iterable

from ..errors import InputError
from ..model import EngineSample
from . import TABLES
from .neutral import NEUTRAL, EngineTable, Wire, derive

#: other spellings of a prefix (router/Ray/OTel re-exports write ``_`` for ``:``; Dynamo the reverse)
FOLD = (("vllm_", "vllm:"), ("sglang_", "sglang:"), ("llamacpp_", "llamacpp:"), ("trtllm:", "trtllm_"))
_HIST = ("_bucket", "_sum", "_count")


def canonical(name: str) -> str:
    for alt, canon in FOLD:
        if name.startswith(alt):
            return canon + name[len(alt):]
    return name


def _key(name: str) -> str:
    name = canonical(name)
    return name[:-6] if name.endswith("_total") else name


def text_string_to_metric_families(text: str):
    # imported on first use: diagnosing a capture never parses exposition text, and the
    # parser module pulls in prometheus_client's HTTP exposition (~30 ms at every start)
    from prometheus_client.parser import text_string_to_metric_families as parse

    return parse(text)


def parse_families(text: str, source: str = "<text>") -> list:
    """Metric families of one scrape; malformed text → InputError naming the line."""
    try:
        return list(text_string_to_metric_families(text))
    except Exception as e:  # the parser raises ValueError, IndexError, ... without a line number
        n, line = _bad_line(text)
        raise InputError(f"{source}: line {n}: cannot parse {line.strip()[:80]!r} ({e}); expected Prometheus "
                         "text exposition: NAME{label=\"value\",...} VALUE [TIMESTAMP]") from None


def _bad_line(text: str) -> tuple[int, str]:
    lines = text.splitlines()

    def ok(chunk: list[str]) -> bool:
        try:
            list(text_string_to_metric_families("\n".join(chunk) + "\n"))
            return True
        except Exception:
            return False

    for i, line in enumerate(lines):  # a line that fails on its own
        if line.strip() and not ok([line]):
            return i + 1, line
    lo, hi = 1, len(lines)  # else the shortest failing prefix (errors that need context)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if ok(lines[:mid]) else (lo, mid)
    return lo, lines[lo - 1] if lines else ""


def detect_engines(names: Iterable[str]) -> dict[str, int]:
    """Engine name → how many metric families carry its prefix."""
    found: dict[str, int] = defaultdict(int)
    for name in names:
        name = canonical(name)
        for t in TABLES:
            if name.startswith(t.prefixes):
                found[t.name] += 1
    return dict(found)


def _typed(v: str) -> Any:
    if v in ("True", "true"):
        return True
    if v in ("False", "false"):
        return False
    if v in ("None", ""):
        return None
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def _num(x: float) -> Any:
    return int(x) if float(x).is_integer() else x


def _entries(t: EngineTable, keys: set[str]) -> dict[str, list[tuple[int, Wire]]]:
    """Wire key → [(priority, entry)], legacy entries first when the scrape is an old version."""
    legacy = any(_key(m) in keys for m in t.legacy_markers)
    rows = (list(t.legacy) if legacy else []) + list(t.metrics)
    out: dict[str, list[tuple[int, Wire]]] = defaultdict(list)
    for i, w in enumerate(rows):
        out[_key(w.wire)].append((i, w))
    return out


def parse_scrape(text: str, time_s: float, server: str | None = None,
                 source: str = "<text>") -> tuple[EngineSample, dict[str, Any], str | None]:
    """Map one scrape to (sample, config, engine). ``engine`` is the LLM engine with the most
    metric families (else ``dcgm``), or None when no known engine's metrics are present."""
    fams = parse_families(text, source)
    by_key: dict[str, list] = defaultdict(list)  # untyped series, or a TYPE line without _total, split families
    for f in fams:
        by_key[_key(f.name)].append(f)
        if f.type == "unknown" and f.name.endswith(_HIST):  # buckets without a TYPE line
            by_key[_key(f.name.rsplit("_", 1)[0])].append(f)
    counts = detect_engines(f.name for f in fams)
    config: dict[str, Any] = {}
    # neutral → engine → (priority, wire, samples)
    chosen: dict[str, dict[str, tuple[int, Wire, list]]] = defaultdict(dict)
    for t in TABLES:
        if t.name not in counts:
            continue
        for key, rows in _entries(t, set(by_key)).items():
            for s in (s for f in by_key.get(key, ()) for s in f.samples):
                if s.name.endswith("_created") or math.isnan(s.value):
                    continue
                hit = next(((i, w) for i, w in rows if all(s.labels.get(k) == v for k, v in w.labels)), None)
                if hit is None:
                    continue
                prio, w = hit
                cur = chosen[w.neutral].get(t.name)
                if cur is None or prio < cur[0]:
                    chosen[w.neutral][t.name] = cur = (prio, w, [])
                if cur[0] == prio:
                    cur[2].append(s)
                if "model" not in config:
                    model = next((s.labels[m] for m in t.model_labels if s.labels.get(m)), None)
                    if model:
                        config["model"] = model
        for info in t.info:
            series = [s for f in by_key.get(_key(info.wire), ()) for s in f.samples]
            if series:
                labels = series[0].labels
                config.setdefault("raw", {})[info.wire] = dict(labels)
                for label, ckey in info.labels:
                    if label in labels:
                        config[ckey] = _typed(labels[label])
    if "dcgm" in counts:
        gpu = next((s.labels["modelName"] for f in fams if f.name.startswith("DCGM_FI_")
                    for s in f.samples if s.labels.get("modelName")), None)
        if gpu:
            config["gpu_name"] = gpu
    values: dict[str, float] = {}
    hists: dict[str, dict[str, Any]] = {}
    for neutral, per_engine in chosen.items():
        picked = [(w, smp) for _, w, smp in per_engine.values()]
        if neutral.startswith("config:"):
            vals = [s.value * w.scale for w, smp in picked for s in smp]
            if vals:
                config[neutral[7:]] = _num(max(vals))
            continue
        spec = NEUTRAL[neutral]
        if spec.kind == "histogram":
            h = _histogram(picked)
            if h is not None:
                hists[neutral] = h
            continue
        vals = [s.value * w.scale for w, smp in picked for s in smp
                if _key(s.name) == _key(w.wire) and not (spec.unit == "fraction" and s.value < 0)]
        if vals:
            values[neutral] = sum(vals) / len(vals) if spec.agg == "mean" else sum(vals)
    derive(values, config)
    llm = {k: v for k, v in counts.items() if k != "dcgm"}
    engine = max(llm, key=llm.get) if llm else ("dcgm" if counts else None)
    return EngineSample(time_s=time_s, engine=engine, server=server, values=values, histograms=hists), config, engine


def _histogram(picked: list[tuple[Wire, list]]) -> dict[str, Any] | None:
    """Cumulative buckets summed over label sets; series whose bucket bounds differ from the
    bounds of the most-observed scheme are left out (their counts cannot be added per bucket)."""
    series: dict[tuple, dict[str, Any]] = {}
    for w, smp in picked:
        for s in smp:
            if not s.name.endswith(_HIST):
                continue
            sk = (w.wire,) + tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
            d = series.setdefault(sk, {"b": {}, "sum": None, "count": None, "scale": w.scale})
            if s.name.endswith("_bucket"):
                try:  # a bucket without a numeric le is not a bucket
                    le = float(s.labels["le"])
                except (KeyError, ValueError):
                    continue
                d["b"][le * w.scale] = s.value
            elif s.name.endswith("_sum"):
                d["sum"] = s.value * w.scale
            elif s.name.endswith("_count"):
                d["count"] = s.value
    if not series:
        return None
    schemes: dict[tuple, list[dict]] = defaultdict(list)
    for d in series.values():
        if d["count"] is None and math.inf in d["b"]:
            d["count"] = d["b"][math.inf]
        schemes[tuple(sorted(le for le in d["b"] if le != math.inf))].append(d)
    les, group = max(schemes.items(), key=lambda kv: sum(d["count"] or 0 for d in kv[1]))
    sums, cnts = [d["sum"] for d in group], [d["count"] for d in group]
    return {"le": list(les), "cum": [sum(d["b"][le] for d in group) for le in les],
            "sum": None if None in sums else sum(sums), "count": None if None in cnts else sum(cnts)}
