"""`kvdoctor report` without a browser: the figures, the page's escaping, self-containment and
the command. tests/test_report_browser.py renders the pages in headless Chromium."""
from __future__ import annotations

import dataclasses
import json
import re
import time
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import orjson
import plotly.graph_objects as go
import pyarrow as pa

import kvdoctor
from kvdoctor.capture import Capture, Columns, EngineSeries
from kvdoctor.diagnosis import Options, diagnose, load_rules
from kvdoctor.objectives import parse_slo
from kvdoctor.diagnosis.incident import CauseFinding, Incident
from kvdoctor.diagnosis.rules import chart_ids, schema
from kvdoctor.model import CaptureMeta
from kvdoctor.report import figures as F
from kvdoctor.report.html import render_html, render_report, script_json

from conftest import CASES

HOSTILE = '<script>window.__pwned=1</script><img src=x onerror="window.__pwned=2">'


def make_hostile_capture(folder: Path) -> Path:
    """A capture whose model, server, session ids, error messages and event text are markup
    that would run if a page pasted it in unescaped; errors enough for error incidents."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "meta.json").write_bytes(orjson.dumps({
        "format_version": 1, "clock": "unix", "engine": "vllm", "model": HOSTILE, "server": HOSTILE,
        "gpu": HOSTILE, "origin": "test", "attribution": HOSTILE, "config": {"context_len_tokens": 4096}}))
    rng = np.random.default_rng(7)
    t0, lines = 1_767_000_000.0, []
    for i in range(300):
        fail = i % 5 == 0
        rec = {"request_id": f"r{i}", "arrival_s": t0 + i * 0.5, "ttft_s": 0.05 + rng.random() * 0.1,
               "e2e_s": 1.0 + rng.random(), "prompt_tokens": int(rng.integers(100, 3000)), "output_tokens": 100,
               "session_id": HOSTILE, "turn": int(i % 4) + 1, "model": HOSTILE, "server": HOSTILE,
               "status": "error" if fail else "ok"}
        if fail:
            rec["error"] = HOSTILE
        lines.append(orjson.dumps(rec))
    (folder / "requests-000001.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (folder / "engine-000001.jsonl").write_bytes(b"\n".join(
        orjson.dumps({"time_s": t0 + k * 5, "engine": "vllm", "values": {"kv_usage_frac": 0.5 + 0.004 * k}})
        for k in range(30)) + b"\n")
    (folder / "events-000001.jsonl").write_bytes(orjson.dumps(
        {"time_s": t0 + 60, "kind": "oom", "server": HOSTILE, "detail": {"message": HOSTILE}}) + b"\n")
    return folder


HOSTILE_RULE = f"""
id: hostile-rule
title: {json.dumps("Rule title " + HOSTILE)}
description: {json.dumps(HOSTILE)}
severity: critical
symptom:
  name: errors
  impact: error_rate
  min_requests: 10
  when: error_rate > 0.05
causes:
  - title: {json.dumps("cause " + HOSTILE)}
    confidence: 0.99
evidence: [errors, error_rate]
fixes:
  - title: {json.dumps("fix " + HOSTILE)}
    why: {json.dumps(HOSTILE)}
    knobs:
      any: {json.dumps(HOSTILE)}
references:
  - {json.dumps("javascript:alert(1)")}
tests:
  fire: []
  no_fire: []
"""


def make_hostile_rules(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hostile-rule.yaml").write_text(HOSTILE_RULE)
    return folder


def _diag(case: str, **slo):
    opts = Options(slo=parse_slo([f"{k}={v}" for k, v in slo.items()])) if slo else None
    return diagnose(kvdoctor.load(CASES / case), options=opts)


def _charts(case: str):
    d = _diag(case)
    return d, F.build_charts(d)


# -- numerics -------------------------------------------------------------------------------


def test_bucket_percentiles_match_numpy():
    rng = np.random.default_rng(0)
    t = rng.uniform(0, 100, 5000)
    v = rng.lognormal(0, 1, 5000)
    v[::97] = np.nan
    counts, p = F.bucket_percentiles(t, v, 0.0, 10.0, 11, qs=(50, 90, 99), min_n=5)
    for b in range(10):
        m = ((t // 10) == b) & np.isfinite(v)
        assert counts[b] == m.sum()
        np.testing.assert_allclose(p[:, b], np.percentile(v[m], [50, 90, 99]), rtol=1e-9)
    assert counts[10] == 0 and np.isnan(p[:, 10]).all()
    # too few values: NaN, not a number from two requests
    _, p2 = F.bucket_percentiles(np.array([1.0, 2.0]), np.array([3.0, 4.0]), 0.0, 10.0, 1)
    assert np.isnan(p2).all()


def test_stratified_sample_is_bounded_and_keeps_the_tails():
    rng = np.random.default_rng(1)
    x = rng.lognormal(7, 1, 300_000)
    y = x * 1e-4 + rng.lognormal(0, 0.5, 300_000)
    y[[5, 6]] = np.nan
    idx = F.stratified_sample(x, y, max_points=20_000)
    assert len(idx) <= 20_000 and len(idx) > 18_000
    assert np.isfinite(y[idx]).all()
    assert np.argmax(np.nan_to_num(y, nan=-1)) in idx  # slowest request is drawn
    assert (x[idx] >= np.quantile(x, 0.99)).sum() >= 300  # the long-prompt tail keeps its share
    small = F.stratified_sample(x[:100], y[:100])
    assert len(small) == np.isfinite(y[:100]).sum()


def test_bucket_width_is_round_and_bounded():
    assert F.bucket_width(86_400, 1_000_000) == 600
    assert F.bucket_width(200, 400) == 10
    for span, n in ((3600, 10), (86_400 * 7, 10**7), (1, 5)):
        w = F.bucket_width(span, n)
        assert span / w <= F.MAX_BUCKETS + 1


# -- figures --------------------------------------------------------------------------------


def test_latency_chart_percentiles_slo_lines_and_incident_bands():
    d = _diag("long-prompts", ttft_p99="1s")
    ch = F.latency_chart(d, F.Prepared(d.capture, d.options.slo))
    assert ch.present
    names = {tr.name for tr in ch.figure.data}
    assert {"P50", "P90", "P99"} <= names
    hovers = " ".join(tr.hovertemplate or "" for tr in ch.figure.data)
    assert "TTFT P99" in hovers and "TPOT P50" in hovers
    rects = [s for s in ch.figure.layout.shapes if s.type == "rect"]
    assert len(rects) == len(d.incidents) >= 1
    lines = [s for s in ch.figure.layout.shapes if s.type == "line"]
    texts = " ".join(a.text for a in ch.figure.layout.annotations)
    assert "SLO P99 1.00 s" in texts  # the user's SLO, as given
    assert "SLO (default) P99 100 ms" in texts or "SLO (default) P99 100 ms (above the chart)" in texts
    assert lines
    assert "no inter-token latencies in this capture" in ch.notes


def test_ttft_scatter_is_webgl_with_fit_line():
    d, charts = _charts("long-prompts")
    fig = charts["ttft-prompt"].figure
    assert isinstance(fig.data[0], go.Scattergl)
    fit = [tr for tr in fig.data if (tr.name or "").startswith("fit:")]
    assert fit and "ms per 1k tokens" in fit[0].name
    assert fit[0].y[1] > fit[0].y[0]  # TTFT rises with prompt length here
    assert "rank correlation" in charts["ttft-prompt"].caption


def test_absent_data_gives_a_one_line_note():
    _, charts = _charts("preemption")  # engine samples, no GPU
    assert not charts["bandwidth"].present
    assert charts["bandwidth"].notes == ["no GPU samples in this capture"]
    assert charts["memory"].present and "no GPU samples in this capture" in charts["memory"].notes
    assert not charts["turns"].present and charts["turns"].notes == ["no conversation turns in this capture"]
    assert not charts["errors"].present and charts["errors"].notes == ["no failed requests in this capture"]


def test_memory_chart_capacity_events_and_preemptions():
    _, charts = _charts("preemption")
    fig = charts["memory"].figure
    assert any(tr.name == "preemptions" for tr in fig.data)
    assert any("capacity" in (a.text or "") for a in fig.layout.annotations)
    _, charts = _charts("leak")  # GPU samples: used per GPU against the total
    fig = charts["memory"].figure
    assert any((tr.name or "").startswith("GPU 0") for tr in fig.data)
    assert any("capacity" in (a.text or "") and "GiB" in (a.text or "") for a in fig.layout.annotations)


def test_every_chart_kind_draws_on_some_case():
    drawn = set()
    for case in ("concurrency", "context-overflow", "multi-turn", "prefix-cache-off", "preemption", "leak"):
        _, charts = _charts(case)
        drawn |= {k for k, c in charts.items() if c.present}
    assert drawn == set(F.BUILDERS)


def test_prompt_histogram_has_percentiles_and_context_limit():
    _, charts = _charts("context-overflow")
    ch = charts["prompt-lengths"]
    texts = [a.text for a in ch.figure.layout.annotations]
    assert any(t.startswith("P50 ") for t in texts) and any(t.startswith("P95 ") for t in texts)
    assert any(t.startswith("P99 ") for t in texts) and "context limit 2,048" in texts
    assert {tr.name for tr in ch.figure.data} == {"ok", "failed"}
    assert "context limit 2,048 tokens" in ch.caption


def test_prefix_turns_concurrency_bandwidth_errors():
    _, charts = _charts("prefix-cache-off")
    ch = charts["prefix-cache"]
    assert {tr.name for tr in ch.figure.data if tr.name} >= {"achieved", "achievable"}
    assert "could serve 89%" in ch.caption
    _, charts = _charts("multi-turn")
    assert charts["turns"].present and "per turn" in charts["turns"].caption
    _, charts = _charts("concurrency")
    assert charts["bandwidth"].present and charts["concurrency"].present
    assert isinstance(charts["concurrency"].figure.data[0], go.Scattergl)
    _, charts = _charts("context-overflow")
    header, rows = charts["errors"].table
    assert header[0] == "error message" and rows[0][1] == 65


def test_rules_may_name_exactly_the_charts_the_report_draws():
    """A rule's ``charts:`` may name every chart and no other; every symptom has charts to fall back on."""
    assert set(F.BUILDERS) == set(chart_ids())
    assert set(F.SYMPTOM_CHARTS) == set(schema()["properties"]["symptom"]["properties"]["name"]["enum"])
    assert all(set(keys) <= set(F.BUILDERS) for keys in F.SYMPTOM_CHARTS.values())


def test_an_incident_shows_its_rules_charts_then_its_symptoms():
    """The top cause's ``charts:`` first, then the symptom's; a rule naming none gets its symptom's."""
    rules = {r.id: r for r in load_rules()}
    everything = dict.fromkeys(F.BUILDERS)

    def incident(*rs):
        return Incident(rs[0].symptom, 0.0, 1.0, [CauseFinding(r, 0.9, "", {}, ()) for r in rs], {})

    assert F.charts_for(incident(rules["kv-oom"]), everything) == ["memory", "prompt-lengths", "errors"]
    assert F.charts_for(incident(rules["prefill-bound"], rules["queueing-saturation"]), everything) == [
        "ttft-prompt", "prompt-lengths", "latency", "concurrency"]
    unnamed = dataclasses.replace(rules["prefill-bound"], charts=())
    assert F.charts_for(incident(unnamed), everything) == ["latency", "ttft-prompt"]
    assert F.charts_for(incident(rules["kv-oom"]), {"errors": None}) == ["errors"]  # only charts the page has


def test_charts_are_placed_next_to_the_incidents_they_support():
    d, charts = _charts("preemption")
    shown, referenced, rest = F.placement(d, charts)
    assert d.incidents[0].causes[0].rule.id == "kv-pressure-preemption"
    assert shown[1][0] == "memory"
    placed = [k for keys in shown.values() for k in keys]
    assert len(placed) == len(set(placed))  # each chart drawn once
    assert set(placed) | set(rest) == set(charts)
    d, charts = _charts("healthy")
    shown, referenced, rest = F.placement(d, charts)
    assert not shown and rest == list(charts)


# -- the page -------------------------------------------------------------------------------


class _Refs(HTMLParser):
    """Tags and the attributes that load something; script bodies are not parsed as markup."""

    def __init__(self):
        super().__init__()
        self.loads: list[tuple[str, str, str]] = []
        self.tags: list[str] = []
        self.ids: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        a = dict(attrs)
        if a.get("id"):
            self.ids.append(a["id"])
        for key in ("src", "href", "data", "srcset", "poster"):
            if key in a and not (tag == "a" and key == "href"):
                self.loads.append((tag, key, a[key] or ""))
        if tag == "a" and (a.get("href") or "").strip().lower().startswith("javascript:"):
            self.loads.append((tag, "href", a["href"]))


def _figures_json(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="kvd-figures">(.*?)</script>', page, re.S)
    assert m
    return json.loads(m.group(1))


def test_page_is_self_contained(tmp_path):
    page = render_html(_diag("context-overflow"))
    p = _Refs()
    p.feed(page)
    assert p.loads == [], f"the page loads something: {p.loads}"
    assert "link" not in p.tags and "iframe" not in p.tags
    assert not re.search(r"<script[^>]*\bsrc\s*=", page, re.I)
    assert not re.search(r"<link\b", page, re.I)
    assert page.count("Plotly.newPlot") >= 1
    assert len(page) > 3_000_000  # plotly.js is inlined...
    from plotly.offline import get_plotlyjs

    assert page.count(get_plotlyjs()[:2000]) == 1  # ...exactly once


def test_page_summary_links_each_incident_to_its_section():
    d = _diag("context-overflow")
    page = render_html(d)
    p = _Refs()
    p.feed(page)
    for n in range(1, len(d.incidents) + 1):
        assert f'href="#incident-{n}"' in page
        assert f"incident-{n}" in p.ids
    summary = page[page.index('id="summary"'):page.index('id="incident-1"')]
    # most severe first, with cause, confidence, evidence numbers and the first fix
    ranks = {"critical": 3, "warning": 2, "info": 1}
    sevs = [i.severity for i in d.incidents]
    assert sevs == sorted(sevs, key=lambda s: -ranks[s]) and "critical" in summary
    assert "Likely cause" in summary and "80%" in summary and "error-burst" in summary
    assert "failed requests <b>65</b>" in summary
    # context-size refusals: the first fix is the context a request may use (error_classes)
    assert "First fix for llama.cpp:" in summary and "Keep prompt + max_tokens within the context" in summary
    figs = _figures_json(page)
    for div_id in figs:
        assert div_id in p.ids
    assert len(figs) == page.count('class="plot kvd-chart"')


def test_absent_chart_note_in_page():
    page = render_html(_diag("preemption"))
    assert "no GPU samples in this capture" in page


def test_hostile_capture_and_rules_are_escaped(tmp_path):
    cap = make_hostile_capture(tmp_path / "cap")
    rules = load_rules([make_hostile_rules(tmp_path / "rules")])
    d = diagnose(kvdoctor.load(cap), rules)
    assert any(c.rule.id == "hostile-rule" for inc in d.incidents for c in inc.causes)
    page = render_html(d, title=HOSTILE)
    body = page[page.index("</head>"):]
    head_rest = page[:page.index("<script")]
    for text in (body, head_rest):
        assert "<script>window.__pwned" not in text
        assert "<img src=x" not in text
    assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;&lt;img src=x onerror=&quot;window.__pwned=2&quot;&gt;" in page
    # every <script> the page opens is one of its own four, and each closes once
    assert len(re.findall(r"<script\b", page, re.I)) == 4
    assert len(re.findall(r"</script", page, re.I)) == 4
    assert 'href="javascript:' not in page
    figs = _figures_json(page)
    assert json.dumps(figs).count("window.__pwned") >= 1  # the OOM event's text is in a hover, escaped
    assert "<script>" not in json.dumps(figs)


def test_script_json_cannot_close_the_script():
    data = {"a": "</script><script>alert(1)</script>", "b": "<!-- & -->", "c": "\u2028"}
    text = script_json(json.dumps(data))
    assert "<" not in text and ">" not in text and "&" not in text
    assert json.loads(text) == data


def test_render_report_writes_the_file(tmp_path):
    d = _diag("multi-turn")
    out = render_report(d, tmp_path / "sub" / "r.html", title="Multi-turn & more")
    assert out == tmp_path / "sub" / "r.html" and out.exists()
    page = out.read_text()
    assert "<title>Multi-turn &amp; more</title>" in page
    assert "window.__kvdoctorRendered = true" in page


def test_cli_report(run_cli, tmp_path):
    out = tmp_path / "report.html"
    r = run_cli("report", CASES / "long-prompts", "-o", out, "--title", "Long prompts", "--slo", "ttft_p99=1s",
                "--since", "2025-12-29T09:20:00Z")
    assert r.returncode == 0, r.stderr
    assert out.exists() and "wrote" in r.stdout and "incident" in r.stdout
    assert "<title>Long prompts</title>" in out.read_text()
    bad = run_cli("report", tmp_path / "missing", "-o", tmp_path / "x.html")
    assert bad.returncode == 2 and "no such capture" in bad.stderr
    help_ = run_cli("report", "--help")
    assert all(opt in help_.stdout for opt in ("--slo", "--rules", "--since", "--until", "--title", "-o"))


def _synthetic_capture(n: int, seed: int = 0) -> Capture:
    """An in-memory capture of n requests over a day (no files), for scale checks."""
    rng = np.random.default_rng(seed)
    t0 = 1_767_000_000.0
    arrival = t0 + np.sort(rng.uniform(0, 86_400, n))
    prompt = rng.lognormal(7, 1.0, n).round()
    out = rng.integers(20, 600, n).astype(float)
    ttft = 0.02 + prompt * 1.2e-4 * rng.lognormal(0, 0.2, n)
    tpot = 0.01 * rng.lognormal(0, 0.1, n)
    e2e = ttft + tpot * (out - 1)
    status = np.where(rng.random(n) < 0.002, "error", "ok")
    table = pa.table({
        "request_id": pa.array(np.arange(n).astype(str)), "arrival_s": arrival, "first_token_s": arrival + ttft,
        "finish_s": arrival + e2e, "ttft_s": ttft, "tpot_s": tpot, "e2e_s": e2e, "prompt_tokens": prompt,
        "output_tokens": out, "turn": rng.integers(1, 9, n).astype(float), "status": pa.array(status),
        "error": pa.array(np.where(status == "error", "upstream timeout", None)),
    })
    empty = Columns(pa.table({"time_s": pa.array([], pa.float64())}))
    return Capture(Path("synthetic"), CaptureMeta(clock="unix", engine="vllm", model="synthetic"), Columns(table),
                   empty, empty, EngineSeries(np.array([]), {}, {}, [], None), [])


def test_large_capture_stays_small_and_fast():
    cap = _synthetic_capture(200_000)
    d = diagnose(cap)
    t = time.perf_counter()
    page = render_html(d)
    took = time.perf_counter() - t
    figs = _figures_json(page)
    data_bytes = len(json.dumps(figs))
    assert data_bytes < 2_000_000, data_bytes  # aggregated and sampled, not 200k points per chart
    for fig in figs.values():
        for tr in fig["data"]:
            x = tr.get("x")
            n = x["shape"] if isinstance(x, dict) and "shape" in x else (len(x) if isinstance(x, list) else None)
            if isinstance(x, dict) and "bdata" in x:
                n = len(__import__("base64").b64decode(x["bdata"])) // np.dtype(x["dtype"]).itemsize
            assert n is None or int(np.prod(n)) <= F.MAX_POINTS + 200
    assert took < 20, took
