"""The before/after page of `kvdoctor compare --html`: one self-contained HTML file (plotly.js
inline) with the verdict, the rule statuses, the signal verdicts, the workload guard, and
before/after charts: latency percentiles side by side, latency distributions overlaid,
prompt-length distributions overlaid, and each side's latency over time (the report's own
chart, :func:`kvdoctor.report.figures.latency_chart`).

Escaping follows :mod:`kvdoctor.report.html`: every string from a capture (paths, side specs,
model names) or a rule file passes through ``esc`` before it enters the page, figure JSON is
embedded with ``<``, ``>``, ``&`` escaped, and text inside figures is HTML-escaped.
"""
from __future__ import annotations

import datetime as dt
import math
from typing import TYPE_CHECKING, Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .. import __version__
from ..diagnosis import Diagnosis
from ..units import fmt
from . import figures as F
from .html import chart_box, esc, page

if TYPE_CHECKING:
    from ..compare import Comparison

BEFORE_COLOR, AFTER_COLOR = "#6b7280", "#2563eb"
LEGEND = {"orientation": "h", "yanchor": "bottom", "y": 1.1, "xanchor": "right", "x": 1}
VERDICT_CLASS = {"better": "good", "worse": "bad", "resolved": "good", "improved": "good", "new": "bad"}

EXTRA_CSS = """
.verdict{font-size:17px;font-weight:650;margin:0 0 6px}
.wl-warn{background:#fffbeb;border:1px solid #fcd34d;border-radius:8px;padding:8px 12px;margin:0 0 10px;font-weight:600}
td.good,span.good{color:#047857;font-weight:650}td.bad,span.bad{color:#b91c1c;font-weight:650}
td.muted{color:#6b7280}
.sides{display:grid;grid-template-columns:1fr 1fr;gap:14px}
.side{border:1px solid #e5e7eb;border-radius:8px;padding:8px 12px;background:#fafafa;overflow-wrap:anywhere}
.side h3{margin:0 0 4px}
@media (max-width:1000px){.sides{grid-template-columns:1fr}}
"""


def _lat_pair(c: "Comparison") -> list[tuple[str, str, np.ndarray, np.ndarray]]:
    out = []
    for label, col in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("E2E", "e2e_s")):
        b, a = c.before_prep.col[col], c.after_prep.col[col]
        b, a = b[np.isfinite(b)], a[np.isfinite(a)]
        if len(b) >= 5 and len(a) >= 5:
            out.append((label, col, b, a))
    return out


def percentile_chart(c: "Comparison") -> F.Chart:
    """P50/P90/P99 of TTFT, TPOT, ITL and E2E, before and after, as grouped bars."""
    title = "Latency percentiles: before vs after"
    fams = []
    for fam in ("TTFT", "TPOT", "ITL", "E2E"):
        ds = [d for d in c.signals if d.family == fam and math.isfinite(d.before) and math.isfinite(d.after)]
        if ds:
            fams.append((fam, ds))
    if not fams:
        return F.Chart("cmp-percentiles", title, None, notes=["no request latencies on both sides"])
    fig = make_subplots(rows=1, cols=len(fams), subplot_titles=[f for f, _ in fams], horizontal_spacing=0.07)
    for i, (fam, ds) in enumerate(fams, 1):
        scale, unit = F.lat_unit(np.array([d.before for d in ds] + [d.after for d in ds]))
        x = [d.label.split(" ")[1] for d in ds]
        for side, color, vals in (("before", BEFORE_COLOR, [d.before for d in ds]), ("after", AFTER_COLOR, [d.after for d in ds])):
            fig.add_trace(go.Bar(x=x, y=np.array(vals) * scale, name=side, legendgroup=side, showlegend=i == 1,
                                 marker={"color": color},
                                 customdata=[[F.esc(d.verdict), F.esc(_change(d))] for d in ds],
                                 hovertemplate=(f"{fam} %{{x}} {side}: %{{y:.3~g}} {unit}<br>"
                                                "%{customdata[1]} · %{customdata[0]}<extra></extra>")),
                          row=1, col=i)
        fig.update_yaxes(title_text=unit, rangemode="tozero", row=1, col=i)
    F.base_layout(fig, 360, barmode="group", bargap=0.25, hovermode="closest", legend=LEGEND, margin={"t": 56})
    cap = "; ".join(f"{d.label} {_change(d)} ({d.verdict})" for _, ds in fams for d in ds if d.label.endswith("P50"))
    return F.Chart("cmp-percentiles", title, fig, f"Hover a bar for the change and its 95% interval. {cap}.")


def cdf_chart(c: "Comparison") -> F.Chart:
    """Empirical distributions (CDFs) of TTFT, TPOT and E2E, before and after, overlaid."""
    title = "Latency distributions: before vs after"
    pairs = _lat_pair(c)
    if not pairs:
        return F.Chart("cmp-cdf", title, None, notes=["no request latencies on both sides"])
    fig = make_subplots(rows=1, cols=len(pairs), subplot_titles=[p[0] for p in pairs], horizontal_spacing=0.07)
    qs = np.linspace(0, 100, 201)
    for i, (label, _, b, a) in enumerate(pairs, 1):
        scale, unit = F.lat_unit(b, a)
        for side, color, v in (("before", BEFORE_COLOR, b), ("after", AFTER_COLOR, a)):
            fig.add_trace(go.Scatter(x=np.percentile(v, qs) * scale, y=qs / 100, mode="lines", name=side, legendgroup=side,
                                     showlegend=i == 1, line={"color": color, "width": 2},
                                     hovertemplate=f"{label} {side}: P%{{customdata:.0f}} = %{{x:.3~g}} {unit}<extra></extra>",
                                     customdata=qs), row=1, col=i)
        fig.update_xaxes(title_text=unit, type="log", row=1, col=i)
    fig.update_yaxes(title_text="share of requests", range=[0, 1.01], row=1, col=1)
    F.base_layout(fig, 340, hovermode="closest", legend=LEGEND, margin={"t": 56})
    return F.Chart("cmp-cdf", title, fig, "Each curve: the share of requests at or below a latency (log scale); "
                                          "a curve further left is faster.")


def prompt_chart(c: "Comparison") -> F.Chart:
    """Prompt-length histograms of both sides on the same bins; matched buckets shaded."""
    title = "Prompt-length distributions: before vs after"
    b, a = c.before_prep.col["prompt_tokens"], c.after_prep.col["prompt_tokens"]
    b, a = b[np.isfinite(b)], a[np.isfinite(a)]
    if len(b) < 5 or len(a) < 5:
        return F.Chart("cmp-prompts", title, None, notes=["no prompt lengths on both sides"])
    both = np.concatenate([b, a])
    bins = min(60, max(10, int(np.sqrt(len(both)))))
    lo, hi = float(both.min()), float(both.max())
    log_x = lo > 0 and hi / lo > 20  # a long tail: log-spaced bins on a log axis, or the short prompts vanish
    edges = np.geomspace(lo, hi * 1.0001, bins + 1) if log_x else np.histogram_bin_edges(both, bins=bins)
    fig = go.Figure()
    for side, color, v in (("before", BEFORE_COLOR, b), ("after", AFTER_COLOR, a)):
        n, _ = np.histogram(v, edges)
        share = n / max(len(v), 1)
        fig.add_trace(go.Bar(x=(edges[:-1] + edges[1:]) / 2, y=share, width=np.diff(edges), name=side, opacity=0.55,
                             marker={"color": color}, customdata=np.stack([edges[:-1], edges[1:], n], axis=1),
                             hovertemplate=f"{side}: %{{customdata[0]:,.0f}}–%{{customdata[1]:,.0f}} tokens: "
                                           "%{customdata[2]:,} requests (%{y:.1%})<extra></extra>"))
    m = c.workload.matching
    if m is not None:
        for bk in m.buckets:
            if bk["matched"]:
                fig.add_vrect(x0=max(bk["lo"], lo), x1=bk["hi"], fillcolor="rgba(5,150,105,0.07)", line_width=0, layer="below")
    fig.update_xaxes(title_text="prompt tokens" + (" (log scale)" if log_x else ""), type="log" if log_x else "linear")
    fig.update_yaxes(title_text="share of requests", tickformat=".0%")
    F.base_layout(fig, 340, barmode="overlay", bargap=0.02, hovermode="closest")
    chk = c.workload.check("prompt_tokens")
    cap = (f"P50 {chk.before['p50']:,.0f} → {chk.after['p50']:,.0f}, P95 {chk.before['p95']:,.0f} → {chk.after['p95']:,.0f} tokens"
           + (f"; KS D {chk.statistic:.2f} (p {chk.p_value:.2g})" if chk and chk.statistic is not None else "")
           + ("; shaded: prompt-length buckets latency is compared within" if m is not None else "") + ".")
    return F.Chart("cmp-prompts", title, fig, cap)


def _change(d) -> str:
    from ..compare.verdict import change_text

    return change_text(d) if d.iv is not None else "n/a"


class _Page:
    def __init__(self, before: Diagnosis, after: Diagnosis, c: "Comparison", title: str | None):
        self.before, self.after, self.c = before, after, c
        self.title = title or "kvdoctor compare · before vs after"
        self.figures: dict[str, Any] = {}

    def chart(self, ch: F.Chart, key: str) -> str:
        return chart_box(ch, key, self.figures)

    def side(self, role: str, diag: Diagnosis) -> str:
        side = self.c.before if role == "before" else self.c.after
        meta = diag.capture.meta
        span = max(diag.end_s - diag.start_s, 0)
        facts = [f"{len(diag.capture.requests):,} requests",
                 f"{esc(diag.time_label(diag.start_s))} → {esc(diag.time_label(diag.end_s))} ({span:.0f} s)"]
        facts += [f"{label} <b>{esc(v)}</b>" for label, v in (("engine", meta.engine), ("model", meta.model), ("GPU", meta.gpu)) if v]
        incs = "".join(f"<li>{esc(i.severity)} {esc(i.symptom)}: <code>{esc(i.causes[0].rule.id)}</code> "
                       f"{esc(i.causes[0].rule.title)}</li>" for i in diag.incidents) or "<li>no incident</li>"
        return (f'<div class="side"><h3>{role}: <code>{esc(side.label)}</code></h3>'
                f'<p class="line">{" · ".join(facts)}</p><ul>{incs}</ul></div>')

    def summary(self) -> str:
        c = self.c
        first = c.workload.first_line()
        warn = f'<p class="wl-warn">{esc(first)}</p>' if first else ""
        return (f'<section id="summary" class="card"><h2>Verdict</h2>{warn}<p class="verdict">{esc(c.overall.headline)}</p>'
                f'<div class="sides">{self.side("before", self.before)}{self.side("after", self.after)}</div></section>')

    def rules(self) -> str:
        c = self.c
        if not c.rules:
            return '<section id="rules" class="card"><h2>Rules</h2><p class="line">No rule fired on either side.</p></section>'
        rows = []
        for r in c.rules:
            d = r.impact
            impact = (f"<code>{esc(d.name)}</code> {esc(fmt(d.before, d.unit))} → {esc(fmt(d.after, d.unit))}" if d else "")
            rows.append(
                f'<tr><td class="{VERDICT_CLASS.get(r.status, "")}">{esc(r.status)}</td><td><code class="rule">{esc(r.rule.id)}</code>'
                f'<div class="doc">{esc(r.rule.title)}</div></td>'
                f'<td class="n">{f"{r.confidence_before:.0%}" if r.fired_before else "—"}</td>'
                f'<td class="n">{f"{r.confidence_after:.0%}" if r.fired_after else "—"}</td>'
                f'<td>{impact}</td><td class="n">{esc(_change(d)) if d else ""}</td></tr>')
        return ('<section id="rules" class="card"><h2>Rules that fired on either side</h2><table>'
                '<tr><th>status</th><th>rule</th><th>before</th><th>after</th><th>impact</th><th>change [95% CI]</th></tr>'
                + "".join(rows) + "</table></section>")

    def signals(self) -> str:
        rows = []
        for d in self.c.signals:
            cls = VERDICT_CLASS.get(d.verdict, "muted" if d.verdict == "n/a" else "")
            note = "" if d.comparable else f' <span class="note">(not comparable: {esc(d.note)})</span>'
            rows.append(f'<tr><td>{esc(d.label)}</td><td class="n">{esc(fmt(d.before, d.unit))}</td>'
                        f'<td class="n">{esc(fmt(d.after, d.unit))}</td><td class="n">{esc(_change(d)) if d.iv else ""}</td>'
                        f'<td class="{cls}">{esc(d.verdict)}{note}</td></tr>')
        c = self.c
        foot = (f"95% intervals from {c.resamples:,} bootstrap resamples (seed {c.seed}); better or worse only when the "
                "change is significant after Holm's correction over every signal tested (family-wise error 5%), its "
                "interval excludes 0 and it is at least 5%.")
        return ('<section id="signals" class="card"><h2>Signals</h2><table>'
                '<tr><th>signal</th><th>before</th><th>after</th><th>change [95% CI]</th><th>verdict</th></tr>'
                + "".join(rows) + f'</table><p class="note">{esc(foot)}</p></section>')

    def workload(self) -> str:
        from ..compare.render import check_cells, matching_line

        rows = "".join("<tr>" + "".join(f"<td>{esc(x)}</td>" for x in (ch.label, *check_cells(ch))) + "</tr>"
                       for ch in self.c.workload.checks)
        m = matching_line(self.c)
        return ('<section id="workload" class="card"><h2>Workload</h2><table>'
                '<tr><th>dimension</th><th>before</th><th>after</th><th>test</th><th>differs</th></tr>' + rows + "</table>"
                + (f'<p class="note">{esc(m)}</p>' if m else "") + "</section>")

    def charts(self) -> str:
        c = self.c
        parts = [self.chart(percentile_chart(c), "percentiles"), self.chart(cdf_chart(c), "cdf"),
                 self.chart(prompt_chart(c), "prompts")]
        for role, diag, prep in (("before", self.before, c.before_prep), ("after", self.after, c.after_prep)):
            ch = F.latency_chart(diag, prep)
            ch.title = f"{role}: {ch.title}"
            parts.append(self.chart(ch, f"latency-{role}"))
        return f'<section id="charts" class="card"><h2>Charts</h2><div class="views">{"".join(parts)}</div></section>'

    def render(self) -> str:
        body = [self.summary(), self.rules(), self.signals(), self.workload(), self.charts()]
        now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        nav = "".join(f'<a href="#{k}">{v}</a>' for k, v in (("summary", "Verdict"), ("rules", "Rules"), ("signals", "Signals"),
                                                              ("workload", "Workload"), ("charts", "Charts")))
        c = self.c
        top = (f'<header class="top"><div class="wrap"><h1>{esc(self.title)}</h1>'
               f'<p class="meta"><span>before <b>{esc(c.before.label)}</b></span><span>after <b>{esc(c.after.label)}</b></span></p>'
               f'</div></header><nav class="nav"><div class="wrap">{nav}</div></nav>')
        footer = (f"<footer>Generated by kvdoctor {esc(__version__)} on {esc(now)}. "
                  "Self-contained (plotly.js embedded); works offline.</footer>")
        return page(self.title, top, body, footer, self.figures, EXTRA_CSS)





def render_compare_html(before_diag: Diagnosis, after_diag: Diagnosis, comparison: "Comparison",
                        title: str | None = None) -> str:
    """The before/after page as one HTML string."""
    return _Page(before_diag, after_diag, comparison, title).render()


__all__ = ["cdf_chart", "percentile_chart", "prompt_chart", "render_compare_html"]
