"""The interactive HTML report: one self-contained file (plotly.js inline, no network) that
opens on the incidents in order of severity, each linked to its own section where the charts
that support it sit beside the cause, the evidence numbers and the fixes.

Page assembly only; the figures come from :mod:`kvdoctor.report.figures`.

Escaping: every string that comes from a capture (model and server names, error messages,
session ids, paths) or from a rule file (titles, causes, fixes; users load their own rules) is
passed through :func:`html.escape` before it enters the page. Figure JSON is embedded in a
``<script type="application/json">`` block with ``<``, ``>`` and ``&`` written as ``\\u003c``,
``\\u003e``, ``\\u0026``, so no string in it can close the script element.
"""
from __future__ import annotations

import datetime as dt
import html
import math
from pathlib import Path
from typing import Any

import plotly.io as pio

from .. import __version__
from ..diagnosis import Diagnosis, Incident
from ..signals import REGISTRY, Prepared
from . import figures as F
from ..diagnosis.numbers import LATENCIES, QUANTILES
from ..engines.labels import ENGINE_LABEL
from ..units import duration_text, fmt, target_text
from .labels import label
from .summary import impact_text
from .verdict import applicable, engine_key, first_step, headline

PLOT_CONFIG = {"displaylogo": False, "responsive": True, "modeBarButtonsToRemove": ["lasso2d", "select2d"]}


def esc(value: Any) -> str:
    """Text for HTML element content or a quoted attribute."""
    return html.escape("" if value is None else str(value), quote=True)


def script_json(text: str) -> str:
    """JSON text made safe inside a <script> element: nothing in it can end the element or
    open a comment, and JSON.parse still reads the same value."""
    return (text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def figure_json(fig) -> str:
    return script_json(pio.to_json(fig, validate=False, remove_uids=True))


def _plotly_js() -> str:
    from plotly.offline import get_plotlyjs

    js = get_plotlyjs()
    # the bundle is inlined as is; it must not contain the one sequence that ends a script
    if "</script" in js.lower():  # pragma: no cover - a plotly release that breaks this is a bug to see
        js = js.replace("</script", "<\\/script").replace("</SCRIPT", "<\\/SCRIPT")
    return js


def _knobs(knobs: dict[str, str], engine: str | None) -> list[tuple[str, str, bool]]:
    """(engine label, setting, is the capture's engine), the capture's engine first."""
    keys = sorted(knobs, key=lambda k: (k != engine, k != "any", k))
    return [(ENGINE_LABEL.get(k, k), knobs[k], k == engine) for k in keys]


def _evidence(evidence: dict[str, float], limit: int | None = None, skip_unknown: bool = False) -> list[tuple[str, str, str]]:
    out = []
    for name, v in evidence.items():
        known = v is not None and not (isinstance(v, float) and math.isnan(v))
        if skip_unknown and not known:
            continue
        sig = REGISTRY.get(name)
        out.append((label(name), fmt(v, sig.unit if sig else ""), f"{name}: {sig.doc}" if sig else name))
    return out[:limit] if limit else out


CSS = """
:root{--bg:#f5f6f8;--card:#fff;--ink:#111827;--muted:#6b7280;--line:#e5e7eb;--crit:#dc2626;--warn:#d97706;--info:#2563eb;--ok:#059669}
*{box-sizing:border-box}
html{scroll-behavior:smooth}
body{margin:0;background:var(--bg);color:var(--ink);font:14px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif}
a{color:#1d4ed8;text-decoration:none}a:hover{text-decoration:underline}
code{font:12.5px/1.4 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;background:#f1f5f9;border-radius:4px;padding:1px 5px;overflow-wrap:anywhere}
.top{background:#0f172a;color:#e5e7eb;padding:18px 0 14px}
.top h1{margin:0 0 4px;font-size:21px;font-weight:650;color:#fff;overflow-wrap:anywhere}
.top .meta{margin:0;color:#cbd5e1;font-size:13px;overflow-wrap:anywhere}
.top .meta span+span:before{content:" · ";color:#64748b}
.nav{position:sticky;top:0;z-index:10;background:rgba(255,255,255,.94);backdrop-filter:blur(6px);border-bottom:1px solid var(--line)}
.nav .wrap{display:flex;gap:18px;align-items:center;height:40px;overflow-x:auto;white-space:nowrap}
.nav a{color:#374151;font-weight:550;font-size:13px}
.nav .sev{display:inline-block;width:8px;height:8px;border-radius:50%;margin-right:5px;vertical-align:1px}
.wrap{max-width:1360px;margin:0 auto;padding:0 24px}
main.wrap{padding-top:18px;padding-bottom:40px}
section{scroll-margin-top:52px}
.card{background:var(--card);border:1px solid var(--line);border-radius:10px;padding:18px 20px;margin:0 0 18px;box-shadow:0 1px 2px rgba(0,0,0,.03)}
h2{font-size:18px;margin:0 0 10px}h3{font-size:14px;margin:16px 0 6px;color:#374151}
.verdict{border-left:5px solid var(--ok);background:#f9fafb;border-radius:8px;padding:8px 14px;margin:0 0 12px}
.verdict.v-critical{border-left-color:var(--crit)}.verdict.v-warning{border-left-color:var(--warn)}.verdict.v-info{border-left-color:var(--info)}
.verdict .v1{font-size:15px;font-weight:650;margin:2px 0}.verdict .v2{margin:2px 0}.verdict .v3{color:var(--muted);font-size:12.5px;margin:2px 0}
.keynumbers{margin:4px 0 16px}table.keynum{width:auto;min-width:520px}table.keynum tr.bad td{color:var(--crit);font-weight:600}
.badge{display:inline-block;font-size:11px;font-weight:700;letter-spacing:.04em;text-transform:uppercase;color:#fff;border-radius:4px;padding:1px 7px;vertical-align:2px}
.sev-critical .badge,.badge.sev-critical{background:var(--crit)}.sev-warning .badge,.badge.sev-warning{background:var(--warn)}.sev-info .badge,.badge.sev-info{background:var(--info)}
.sym{font:12px ui-monospace,Menlo,monospace;color:#374151;background:#eef2ff;border-radius:4px;padding:1px 6px;margin:0 4px}
ol.incidents{list-style:none;margin:0;padding:0}
ol.incidents li{border:1px solid var(--line);border-left:5px solid var(--info);border-radius:8px;padding:10px 14px;margin:0 0 10px;background:#fff}
ol.incidents li.sev-critical{border-left-color:var(--crit)}ol.incidents li.sev-warning{border-left-color:var(--warn)}
.inc-title{font-size:15.5px;font-weight:650}
.when{color:var(--muted);font-size:12.5px;margin-left:6px}
.line{margin:4px 0 0}
.conf{display:inline-block;min-width:38px;text-align:right;font-weight:650}
.chips{display:flex;flex-wrap:wrap;gap:6px;margin:6px 0 2px}
.chip{border:1px solid var(--line);border-radius:999px;padding:1px 10px;font-size:12.5px;background:#f9fafb}
.chip b{font-weight:650}
.healthy{border-left:5px solid var(--ok)}
.incident{border-top:4px solid var(--info)}.incident.sev-critical{border-top-color:var(--crit)}.incident.sev-warning{border-top-color:var(--warn)}
.incident h2{display:inline;font-size:19px;margin-left:6px}
.inc-body{display:grid;grid-template-columns:minmax(300px,5fr) 8fr;gap:22px;margin-top:8px}
.inc-body.no-charts{grid-template-columns:1fr}
@media (max-width:1000px){.inc-body{grid-template-columns:1fr}}
table{border-collapse:collapse;width:100%;font-size:13px}
th,td{text-align:left;padding:4px 8px;border-bottom:1px solid var(--line);vertical-align:top}
th{font-weight:600;color:#374151;background:#f9fafb}
td.n{text-align:right;white-space:nowrap;font-variant-numeric:tabular-nums}
.bar{display:inline-block;height:7px;border-radius:4px;background:#93c5fd;vertical-align:1px;margin-right:6px}
ol.fixes{padding-left:20px;margin:4px 0}ol.fixes li{margin:0 0 8px}
.why{color:#374151;margin:2px 0}
code.rule{white-space:nowrap;overflow-wrap:normal}
.evidence .doc{color:var(--muted);font-size:12px;line-height:1.35;margin-top:1px}
.knobs{margin:3px 0 0;padding:0;list-style:none}
.knobs li{font-size:12.5px;margin:2px 0}.knobs .eng{display:inline-block;min-width:92px;color:var(--muted)}
.knobs li.mine .eng{color:var(--ink);font-weight:650}
.chart{margin:0 0 18px;border:1px solid var(--line);border-radius:8px;padding:10px 12px;background:#fff}
.chart h3{margin:0 0 2px;font-size:14.5px;color:var(--ink)}
.chart .cap{margin:0 0 6px;color:#374151;font-size:12.5px}
.plot{width:100%}
.note{color:var(--muted);font-size:12.5px;font-style:italic;margin:4px 0}
.absent{border:1px dashed #d1d5db;border-radius:8px;padding:8px 12px;margin:0 0 12px;background:#fcfcfd}
.absent b{font-style:normal;color:#374151}
details{margin:8px 0}summary{cursor:pointer;color:#374151;font-weight:600}
.errors td.msg{font:12px ui-monospace,Menlo,monospace;overflow-wrap:anywhere;white-space:pre-wrap}
footer{color:var(--muted);font-size:12px;margin-top:26px}
.views{display:grid;grid-template-columns:1fr 1fr;gap:18px}
.views .chart.wide{grid-column:1/-1}
@media (max-width:1000px){.views{grid-template-columns:1fr}}
"""

JS = """
(function () {
  window.__kvdoctorScriptMs = performance.now();
  var figs = JSON.parse(document.getElementById('kvd-figures').textContent);
  var config = JSON.parse(document.getElementById('kvd-plot-config').textContent);
  window.__kvdoctorRendered = false;
  var jobs = [];
  Object.keys(figs).forEach(function (id) {
    var el = document.getElementById(id);
    if (!el) { return; }
    var f = figs[id];
    var c = Object.assign({}, config, {toImageButtonOptions: {filename: 'kvdoctor-' + id, scale: 2}});
    jobs.push(Plotly.newPlot(el, f.data, f.layout, c));
  });
  Promise.all(jobs).then(function () {
    window.__kvdoctorRenderMs = performance.now();
    window.__kvdoctorRendered = true;
    document.documentElement.setAttribute('data-rendered', 'true');
  }, function (err) {
    window.__kvdoctorRenderError = String(err);
    console.error('kvdoctor: a chart failed to render: ' + err);
  });
})();
"""


class _Page:
    def __init__(self, diag: Diagnosis, charts: dict[str, F.Chart], prep: Prepared, title: str | None):
        self.diag = diag
        self.charts = charts
        self.prep = prep
        self.engine = engine_key(diag)
        self.title = title or f"kvdoctor report · {Path(str(diag.capture.path)).name or diag.capture.path}"
        self.shown, self.referenced, self.rest = F.placement(diag, charts)
        self.where: dict[str, int] = {k: n for n, keys in self.shown.items() for k in keys}
        self.figures: dict[str, Any] = {}

    # -- pieces ---------------------------------------------------------------------------
    def header(self) -> str:
        d, meta = self.diag, self.diag.capture.meta
        items = [f"<span>{esc(d.capture.path)}</span>", f"<span>{len(d.capture.requests):,} requests</span>",
                 f"<span>{esc(d.time_label(d.start_s))} → {esc(d.time_label(d.end_s))} ({esc(duration_text(max(d.end_s - d.start_s, 0)))})</span>"]
        for what, value in (("engine", meta.engine), ("model", meta.model), ("GPU", meta.gpu), ("server", meta.server)):
            if value:
                items.append(f"<span>{what} <b>{esc(value)}</b></span>")
        extra = []
        missing = [k for k, v in meta.sources.items() if not v.ok]
        if missing:
            extra.append("not read: " + ", ".join(f"{esc(k)} ({esc(meta.sources[k].detail)})" for k in missing))
        extra += [f"warning: {esc(w)}" for w in d.warnings[:5]]
        if meta.attribution:
            extra.append(f"data: {esc(meta.attribution)}")
        sub = "".join(f'<p class="meta">{x}</p>' for x in extra)
        return (f'<header class="top"><div class="wrap"><h1>{esc(self.title)}</h1>'
                f'<p class="meta">{"".join(items)}</p>{sub}</div></header>')

    def nav(self) -> str:
        links = ['<a href="#summary">Summary</a>']
        for n, inc in enumerate(self.diag.incidents, 1):
            color = F.SEVERITY_COLOR.get(inc.severity, F.SEVERITY_COLOR["info"])
            links.append(f'<a href="#incident-{n}"><span class="sev" style="background:{color}"></span>#{n} {esc(inc.symptom)}</a>')
        links.append('<a href="#more">More views</a>')
        return f'<nav class="nav"><div class="wrap">{"".join(links)}</div></nav>'

    def verdict(self) -> str:
        """The three lines every output starts with (report/verdict.py): what and since when with
        the likely cause, the first step for this engine, and where."""
        l1, l2, l3 = headline(self.diag)
        sev = self.diag.incidents[0].severity if self.diag.incidents and not self.diag.incidents[0].observation else "ok"
        return (f'<div class="verdict v-{esc(sev)}"><p class="v1">{esc(l1)}</p><p class="v2">{esc(l2)}</p>'
                f'<p class="v3">{esc(l3)}</p></div>')

    def numbers(self) -> str:
        """The key numbers (diagnosis/numbers.py, the same as the text and JSON outputs): latency
        percentiles with the objective beside each, a broken one marked, then volume and errors."""
        k = self.diag.key_numbers
        rows = []
        for key, name, _ in LATENCIES:
            vals = k.latency_s.get(key, {})
            if not any(math.isfinite(v) for v in vals.values()):
                continue
            checks = k.check_for(key)
            broken = any(c.broken for c in checks)
            obj = "; ".join(f"P{c.objective.percentile} ≤ {target_text(c.objective.target, 's')}"
                            + (f" on {c.objective.route}" if c.objective.route else "")
                            + (f" — broken: {c.over:,} of {c.total:,} over" if c.broken else "")
                            + ("" if c.objective.stated else " (default)") for c in checks) or "—"
            cells = "".join(f'<td class="n">{esc(fmt(vals.get(q), "s"))}</td>' for q in QUANTILES)
            rows.append(f'<tr class="{"bad" if broken else ""}"><td>{esc(name)}</td>{cells}<td>{esc(obj)}</td></tr>')
        table = ('<table class="keynum"><tr><th></th><th>P50</th><th>P90</th><th>P99</th><th>objective</th></tr>'
                 + "".join(rows) + "</table>") if rows else ""
        vol = [f"{k.requests:,} requests"]
        if math.isfinite(k.duration_s):
            vol.append(f"over {duration_text(k.duration_s)}")
        if math.isfinite(k.request_rate_per_s):
            vol.append(fmt(k.request_rate_per_s, "1/s"))
        if math.isfinite(k.output_tokens_per_s) and k.output_tokens_per_s > 0:
            vol.append(f"{fmt(k.output_tokens_per_s, 'tokens/s')} out")
        if k.errors is not None:
            err = f"{k.errors:,} failed ({fmt(k.error_rate, 'fraction')})"
            if k.context_cut:
                err += f", {k.context_cut:,} cut at the context limit"
            for c in k.check_for("error_rate"):
                err += f"; objective ≤ {target_text(c.objective.target, 'fraction')}" + (" — broken" if c.broken else "")
            vol.append(err)
        return f'<div class="keynumbers">{table}<p class="line">{esc(" · ".join(vol))}</p></div>'

    def summary(self) -> str:
        d = self.diag
        out = ['<section id="summary" class="card"><h2>Summary</h2>', self.verdict(), self.numbers()]
        if d.nothing_to_diagnose:
            out.append(f'<p class="line">Nothing to diagnose: {esc(d.nothing_to_diagnose)}</p></section>')
            return "".join(out)
        pages = [(n, i) for n, i in enumerate(d.incidents, 1) if not i.observation]
        notes = [(n, i) for n, i in enumerate(d.incidents, 1) if i.observation]
        if not pages:
            out.append('<ol class="incidents"><li class="healthy"><span class="inc-title">No incident: no objective '
                       'broken and nobody waiting beyond the server\'s own work.</span>'
                       '<p class="line">Every rule that could run was evaluated; the charts below show the capture '
                       'as it is.</p></li></ol>')
        else:
            n_crit = sum(i.severity == "critical" for _, i in pages)
            out.append(f'<p class="line">{len(pages)} incident{"s" if len(pages) != 1 else ""}'
                       + (f", {n_crit} critical" if n_crit else "") + ", most severe first. Each links to its section.</p>")
            out.append('<ol class="incidents">' + "".join(self.summary_item(n, inc) for n, inc in pages) + "</ol>")
        if notes:
            out.append('<h3>Observations</h3><p class="line note">Shapes the rules saw that hurt nobody: no objective '
                       'broken, nobody waiting because of them. Nothing to fix while that holds.</p>')
            out.append('<ol class="incidents">' + "".join(self.summary_item(n, inc) for n, inc in notes) + "</ol>")
        out.append("</section>")
        return "".join(out)

    def summary_item(self, n: int, inc: Incident) -> str:
        d, top = self.diag, inc.causes[0]
        chips = "".join(f'<span class="chip" title="{esc(doc)}">{esc(name)} <b>{esc(val)}</b></span>'
                        for name, val, doc in _evidence(top.evidence, 4, skip_unknown=True))
        fix_html = f'<p class="line"><b>{esc(first_step(top, self.engine).split(":", 1)[0])}:</b> ' \
                   f'{esc(first_step(top, self.engine).split(":", 1)[1].strip())}</p>'
        if top.in_effect:
            fix_html += "".join(f'<p class="line note">Already on: {esc(f.title)}'
                                + (f" — {esc(f.if_in_effect)}" if f.if_in_effect else "") + "</p>" for f in top.in_effect)
        also = ""
        if len(inc.causes) > 1:
            also = ('<p class="line note">Also considered: '
                    + ", ".join(f"{esc(c.rule.id)} ({c.confidence:.0%}){esc(c.rule.tag)}" for c in inc.causes[1:4]) + "</p>")
        return (f'<li class="sev-{esc(inc.severity)}"><div><span class="badge">{esc(inc.severity)}</span>'
                f'<span class="sym">{esc(inc.symptom)}</span>'
                f'<a class="inc-title inc-link" href="#incident-{n}">{n}. {esc(top.rule.title)}</a>'
                f'<span class="when">{esc(d.time_label(inc.start_s))} → {esc(d.time_label(inc.end_s))} '
                f'({esc(duration_text(inc.end_s - inc.start_s))}) · {esc(impact_text(inc))}</span></div>'
                f'<p class="line"><b>Likely cause</b> <span class="conf">{top.confidence:.0%}</span> '
                f'(rule <code>{esc(top.rule.id)}</code>{esc(top.rule.tag)}): {esc(top.cause)}</p>'
                f'<div class="chips">{chips}</div>{fix_html}{also}</li>')

    def incident(self, n: int, inc: Incident) -> str:
        d, top = self.diag, inc.causes[0]
        causes = "".join(
            f'<tr><td class="n">{i}</td><td><code class="rule">{esc(c.rule.id)}</code>{esc(c.rule.tag)}</td>'
            f'<td class="n"><span class="bar" style="width:{max(4, int(c.confidence * 60))}px"></span>{c.confidence:.0%}</td>'
            f"<td>{esc(c.cause)}</td></tr>" for i, c in enumerate(inc.causes, 1))
        text = [f'<h3>Causes, most likely first</h3><table><tr><th>#</th><th>rule</th><th>confidence</th><th>cause</th></tr>{causes}</table>',
                f"<h3>Evidence</h3>{self.evidence_table(top.evidence)}",
                f"<h3>Fixes, in order</h3>{self.fixes(applicable(top.fixes, self.engine))}"]
        if top.rule.description:
            text.append(f'<details><summary>About this rule</summary><p>{esc(top.rule.description)}</p></details>')
        for c in inc.causes[1:]:
            text.append(f'<details><summary>Also considered: {esc(c.rule.title)} ({c.confidence:.0%}){esc(c.rule.tag)}</summary>'
                        f'<p class="line">{esc(c.cause)}</p>{self.evidence_table(c.evidence)}{self.fixes(c.fixes)}</details>')
        refs = [r for r in top.rule.references if str(r).startswith(("https://", "http://"))]
        if refs:
            text.append('<p class="note">References: ' + " · ".join(
                f'<a href="{esc(r)}" rel="noopener noreferrer">{esc(r)}</a>' for r in refs) + "</p>")
        charts = [self.chart(key) for key in self.shown.get(n, [])]
        for key in self.referenced.get(n, []):
            ch = self.charts[key]
            if ch.present:
                charts.append(f'<p class="note">See also <a href="#chart-{esc(key)}-box">{esc(ch.title)}</a> under incident #{self.where[key]}.</p>')
        drawn = any(self.charts[k].present for k in self.shown.get(n, []))
        body_cls = "inc-body" if drawn else "inc-body no-charts"  # only notes and links: one column
        return (f'<section id="incident-{n}" class="card incident sev-{esc(inc.severity)}">'
                f'<span class="badge">{esc(inc.severity)}</span><span class="sym">{esc(inc.symptom)}</span>'
                f"<h2>{n}. {esc(top.rule.title)}</h2>"
                f'<p class="line"><b>When:</b> {esc(d.time_label(inc.start_s))} → {esc(d.time_label(inc.end_s))} '
                f"({esc(duration_text(inc.end_s - inc.start_s))}) · <b>Impact:</b> {esc(impact_text(inc))}</p>"
                f'<p class="line"><b>Likely cause</b> ({top.confidence:.0%}, rule <code>{esc(top.rule.id)}</code>{esc(top.rule.tag)}): {esc(top.cause)}</p>'
                f'<div class="{body_cls}"><div class="inc-text">{"".join(text)}</div>'
                f'<div class="inc-charts">{"".join(charts)}</div></div></section>')

    def evidence_table(self, evidence: dict[str, float]) -> str:
        rows = "".join(f'<tr><td>{esc(name)}<div class="doc">{esc(doc)}</div></td><td class="n">{esc(val)}</td></tr>'
                       for name, val, doc in _evidence(evidence))
        return f'<table class="evidence"><tr><th>signal</th><th>value</th></tr>{rows}</table>'


    def fixes(self, fixes) -> str:
        items = []
        for f in fixes:
            knobs = "".join(f'<li class="{"mine" if mine else ""}"><span class="eng">{esc(eng)}</span><code>{esc(k)}</code></li>'
                            for eng, k, mine in _knobs(f.knobs, self.engine))
            items.append(f"<li><b>{esc(f.title)}</b>" + (f'<p class="why">{esc(f.why)}</p>' if f.why else "")
                         + f'<ul class="knobs">{knobs}</ul></li>')
        return f'<ol class="fixes">{"".join(items)}</ol>'

    def chart(self, key: str, wide: bool = False) -> str:
        return chart_box(self.charts[key], key, self.figures, wide, absent="no data in this capture")

    def more(self) -> str:
        present = [k for k in self.rest if self.charts[k].present]
        absent = [k for k in self.rest if not self.charts[k].present]
        intro = ("Charts no incident needed." if self.diag.incidents else "Every chart the capture has data for.")
        wide = {k for k in present if k in ("latency", "memory", "errors", "prefix-cache")}
        narrow = [k for k in present if k not in wide]
        if len(narrow) % 2:  # a lone half-width chart would leave a hole: the last one spans the row
            wide.add(narrow[-1])
        body = "".join(self.chart(k, wide=k in wide) for k in present)
        notes = "".join(f"<li><b>{esc(self.charts[k].title)}</b>: {esc('; '.join(self.charts[k].notes))}</li>" for k in absent)
        return (f'<section id="more" class="card"><h2>More views</h2><p class="line note">{intro}</p>'
                f'<div class="views">{body}</div>'
                + (f'<h3>Not drawn</h3><ul class="note">{notes}</ul>' if notes else "") + "</section>")

    def render(self) -> str:
        parts = [self.summary()]
        parts += [self.incident(n, inc) for n, inc in enumerate(self.diag.incidents, 1)]
        parts.append(self.more())
        now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        footer = (f"<footer>Generated by kvdoctor {esc(__version__)} on {esc(now)} from <code>{esc(self.diag.capture.path)}</code>. "
                  "This file is self-contained (charts by plotly.js, embedded) and works offline. "
                  "Drag on a chart to zoom, double-click to reset; the camera icon saves a PNG.</footer>")
        return page(self.title, self.header() + self.nav(), parts, footer, self.figures)


def chart_box(ch: F.Chart, key: str, figures: dict[str, Any], wide: bool = True, absent: str = "no data") -> str:
    """One chart's ``<figure>`` (title, caption, plot div, notes, its table), its figure added to
    ``figures`` under the div's id; for an absent chart, a line saying why."""
    if not ch.present:
        return (f'<div class="absent" id="chart-{esc(key)}-box"><b>{esc(ch.title)}</b>: '
                f'<span class="note">{esc("; ".join(ch.notes) or absent)}</span></div>')
    div_id = f"chart-{key}"
    figures[div_id] = ch.figure
    height = int(ch.figure.layout.height or 400)
    notes = "".join(f'<p class="note">{esc(n)}</p>' for n in ch.notes)
    table = ""
    if ch.table and ch.table[1]:
        head = "".join(f"<th>{esc(h)}</th>" for h in ch.table[0])
        rows = "".join("<tr>" + "".join(
            f'<td class="{"msg" if i == 0 else "n"}">{esc(v if not isinstance(v, int) else f"{v:,}")}</td>'
            for i, v in enumerate(r)) + "</tr>" for r in ch.table[1])
        table = f'<table class="errors"><tr>{head}</tr>{rows}</table>'
    return (f'<figure class="chart{" wide" if wide else ""}" id="{esc(div_id)}-box"><h3>{esc(ch.title)}</h3>'
            f'<p class="cap">{esc(ch.caption)}</p><div class="plot kvd-chart" id="{esc(div_id)}" style="height:{height}px"></div>'
            f"{notes}{table}</figure>")


def page(title: str, top: str, sections: list[str], footer: str, figures: dict[str, Any], css: str = "") -> str:
    """The shell every kvdoctor page shares (report, compare, fleet): one self-contained HTML
    document with plotly.js inline, ``top`` (header and nav, already escaped), the sections, and
    the figures drawn into their ``<div id=…>`` by one small script. ``title`` is escaped here."""
    figs = "{" + ",".join(f'"{k}":{figure_json(f)}' for k, f in figures.items()) + "}"
    return "".join([
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">",
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        '<meta name="generator" content="kvdoctor">',
        f"<title>{esc(title)}</title><style>{CSS}{css}</style>",
        f'<script type="text/javascript">{_plotly_js()}</script></head><body>',
        top, '<main class="wrap">', *sections, footer, "</main>",
        f'<script type="application/json" id="kvd-figures">{figs}</script>',
        f'<script type="application/json" id="kvd-plot-config">{script_json(_json(PLOT_CONFIG))}</script>',
        f"<script>{JS}</script></body></html>\n",
    ])


def _json(obj: Any) -> str:
    import json

    return json.dumps(obj)


def render_html(diag: Diagnosis, title: str | None = None, charts: dict[str, F.Chart] | None = None,
                prep: Prepared | None = None) -> str:
    """The report page for a diagnosis, as one HTML string."""
    prep = prep or diag.prepared or Prepared(diag.capture, diag.options.targets, diag.options.stated)
    charts = charts if charts is not None else F.build_charts(diag, prep)
    return _Page(diag, charts, prep, title).render()


def render_report(diag: Diagnosis, path: str | Path, title: str | None = None) -> Path:
    """Write the self-contained HTML report for ``diag`` to ``path``; returns the path."""
    out = Path(path)
    if out.parent and not out.parent.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(diag, title), encoding="utf-8")
    return out


__all__ = ["chart_box", "esc", "figure_json", "page", "render_html", "render_report", "script_json"]
