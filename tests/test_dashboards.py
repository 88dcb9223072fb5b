"""The Grafana dashboards in dashboards/: valid dashboard JSON, and every PromQL query names
only metrics that kvdoctor (kvdoctor.sidecar.exported) or an engine (kvdoctor.engines tables) exports."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvdoctor.engines import NEUTRAL, TABLES
from kvdoctor.sidecar.exported import METRICS, NAMES
from kvdoctor.report.figures import DEFAULT_SLO

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = sorted((ROOT / "dashboards").glob("*.json"))
DS_UID = "${DS_PROMETHEUS}"

#: PromQL words that are not metric names: functions and aggregations are also caught by
#: "followed by (", but keywords and modifiers are not
KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or", "unless",
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile", "count_values", "group",
    "rate", "irate", "increase", "delta", "idelta", "deriv", "histogram_quantile", "vector", "scalar", "abs",
    "le", "inf", "nan", "atan2", "label_values", "label_replace", "changes", "resets", "clamp_min", "clamp_max",
}
HIST_SUFFIXES = ("_bucket", "_sum", "_count")


def _wire_kinds() -> dict[str, str]:
    """Every wire name an engine table knows → the kind of its neutral name."""
    out = {}
    for table in TABLES:
        for w in (*table.metrics, *table.legacy):
            kind = NEUTRAL[w.neutral].kind if w.neutral in NEUTRAL else "gauge"  # config:* gauges
            out[w.wire] = kind
        for info in table.info:
            out[info.wire] = "gauge"
    return out


WIRES = _wire_kinds()
KVD_KINDS = {m.name: m.kind for m in METRICS}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression reads: identifiers left after removing string
    literals, label matchers, range/offset durations, by/without/on label lists, numbers,
    function calls (a name followed by "(") and keywords."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)
    e = re.sub(r"label_values\((.*),\s*\w+\s*\)", r"\1", e)  # Grafana: label_values(selector, label)
    e = re.sub(r"\{[^{}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"\$\{?\w+\}?", " ", e)  # Grafana variables outside matchers
    names = set()
    for m in re.finditer(r"(?<![\w:.])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?", e):
        name, call = m.group(1), m.group(2)
        if call or name.lower() in KEYWORDS:
            continue
        if re.fullmatch(r"\d+[smhdwy]", name):
            continue
        names.add(name)
    return names


def known(name: str) -> str | None:
    """Why a metric name is allowed, or None when nobody exports it."""
    if name in NAMES:
        return "kvdoctor"
    if name in WIRES:
        return "engine"
    for suffix in HIST_SUFFIXES:
        if name.endswith(suffix) and WIRES.get(name[: -len(suffix)]) == "histogram":
            return "engine histogram"
    if name.endswith("_total"):
        base = name[:-6]
        if WIRES.get(base) == "counter" or KVD_KINDS.get(base) == "counter":
            return "counter"
    return None


def _panels(dash: dict) -> list[dict]:
    out = []
    for p in dash.get("panels", []):
        out.append(p)
        out += p.get("panels", [])  # collapsed rows hold their panels
    return out


def _exprs(dash: dict) -> list[tuple[str, str]]:
    """(where, expr) for every query: panel targets, annotations, query variables."""
    out = []
    for p in _panels(dash):
        for t in p.get("targets", []):
            out.append((f"panel {p.get('id')} {p.get('title')!r} target {t.get('refId')}", t.get("expr", "")))
    for a in dash.get("annotations", {}).get("list", []):
        if a.get("expr"):
            out.append((f"annotation {a.get('name')!r}", a["expr"]))
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v.get("query")
            out.append((f"variable {v['name']}", q.get("query", "") if isinstance(q, dict) else q or ""))
    return out


def test_there_are_dashboards():
    assert DASHBOARDS, "dashboards/*.json: none found"


def test_metric_name_extraction():
    expr = ('histogram_quantile(0.99, sum by (le, instance) (rate(vllm:time_to_first_token_seconds_bucket'
            '{instance=~"$instance", model_name!="x"}[$__rate_interval]))) or vector(0) '
            '/ on (instance) group_left sum without (gpu) (kvdoctor_gpu_memory_total_bytes offset 5m) > bool 1e3')
    assert metric_names(expr) == {"vllm:time_to_first_token_seconds_bucket", "kvdoctor_gpu_memory_total_bytes"}
    assert metric_names('label_values({__name__=~"vllm:.+"}, instance)') == set()
    assert known("vllm:time_to_first_token_seconds_bucket") == "engine histogram"
    assert known("vllm:num_requests_running_bucket") is None  # a gauge has no buckets
    assert known("kvdoctor_requests_total") == "kvdoctor"
    assert known("vllm:kv_cache_usage_percent") is None


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_structure(path):
    dash = json.loads(path.read_text())
    assert isinstance(dash.get("title"), str) and dash["title"]
    assert isinstance(dash.get("uid"), str) and re.fullmatch(r"[A-Za-z0-9_-]{1,40}", dash["uid"])
    assert isinstance(dash.get("schemaVersion"), int) and dash["schemaVersion"] >= 38
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    ds = variables.get("DS_PROMETHEUS")
    assert ds and ds["type"] == "datasource" and ds["query"] == "prometheus", "a Prometheus datasource variable DS_PROMETHEUS"
    inst = variables.get("instance")
    assert inst and inst["type"] == "query" and inst["datasource"]["uid"] == DS_UID, "an instance variable"
    panels = _panels(dash)
    assert panels
    ids = [p.get("id") for p in panels]
    assert all(isinstance(i, int) for i in ids), "every panel has an integer id"
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(i for i in ids if ids.count(i) > 1)}"
    cells = set()
    for p in panels:
        where = f"panel {p['id']} {p.get('title')!r}"
        gp = p.get("gridPos")
        assert isinstance(gp, dict) and all(isinstance(gp.get(k), int) for k in "hwxy"), f"{where}: gridPos h/w/x/y"
        assert gp["w"] >= 1 and gp["h"] >= 1 and gp["x"] >= 0 and gp["x"] + gp["w"] <= 24, f"{where}: gridPos inside 24 columns"
        for x in range(gp["x"], gp["x"] + gp["w"]):  # panels must not overlap
            for y in range(gp["y"], gp["y"] + gp["h"]):
                assert (x, y) not in cells, f"{where}: overlaps another panel at {(x, y)}"
                cells.add((x, y))
        assert isinstance(p.get("type"), str) and p["type"]
        if p["type"] == "row":
            continue
        assert p.get("datasource", {}).get("uid") == DS_UID, f"{where}: datasource uid must be {DS_UID}"
        targets = p.get("targets")
        assert targets, f"{where}: no targets"
        refs = [t.get("refId") for t in targets]
        assert len(refs) == len(set(refs)) and all(refs), f"{where}: refIds unique and set"
        for t in targets:
            assert isinstance(t.get("expr"), str) and t["expr"].strip(), f"{where}: target without expr"
            assert t.get("datasource", {}).get("uid") == DS_UID, f"{where}: target datasource uid"
            assert "$instance" in t["expr"], f"{where}: query not filtered by $instance: {t['expr']}"
            assert t["expr"].count("(") == t["expr"].count(")") and t["expr"].count("{") == t["expr"].count("}")


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_queries_name_only_exported_metrics(path):
    dash = json.loads(path.read_text())
    seen: set[str] = set()
    for where, expr in _exprs(dash):
        for name in metric_names(expr):
            assert known(name), (f"{path.name}: {where}: {name!r} is neither a kvdoctor metric (kvdoctor/sidecar/exported.py) "
                                 f"nor an engine wire name (kvdoctor/engines/*.py): {expr}")
            seen.add(name)
    # side by side: each of the three engines and kvdoctor itself
    assert any(n.startswith("vllm:") for n in seen)
    assert any(n.startswith("sglang:") for n in seen)
    assert any(n.startswith("llamacpp:") for n in seen)
    assert "kvdoctor_incident_active" in seen
    assert {n for n in seen if n.startswith("kvdoctor_")} >= {"kvdoctor_ttft_seconds", "kvdoctor_tpot_seconds", "kvdoctor_kv_usage_ratio"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_slo_thresholds_match_report_defaults(path):
    """Panels that declare an SLO in their description ("SLO: ttft_p99_s") draw it as a
    dashed threshold at the report's default value; every default SLO has such a panel."""
    dash = json.loads(path.read_text())
    declared = set()
    for p in _panels(dash):
        m = re.search(r"SLO: (\w+)", p.get("description", ""))
        if not m:
            continue
        key = m.group(1)
        assert key in DEFAULT_SLO, f"panel {p['title']!r}: unknown SLO {key}"
        defaults = p["fieldConfig"]["defaults"]
        values = [s["value"] for s in defaults["thresholds"]["steps"] if s.get("value") is not None]
        assert values == [DEFAULT_SLO[key]], f"panel {p['title']!r}: threshold {values} != report default {DEFAULT_SLO[key]}"
        assert defaults["custom"]["thresholdsStyle"]["mode"] in ("line", "dashed", "line+area", "dashed+area")
        declared.add(key)
    assert declared == set(DEFAULT_SLO), f"SLOs without a panel: {set(DEFAULT_SLO) - declared}"
