"""The fleet page of `kvdoctor report --prometheus`: which replicas are sick, and why, at a glance.

One self-contained HTML file (the report's shell, kvdoctor.report.html.page): the findings, a
scatter of every replica's load against its TTFT tail (or its queue) coloured by status, a
heatmap of requests waiting per replica over time, and the replica table. Instance names and
label values come from Prometheus and can hold anything: every one is escaped, in the page
(``esc``) and inside figures (``F.esc``: plotly renders a subset of HTML in SVG text).
"""
from __future__ import annotations

import datetime as dt
import math

import numpy as np
import plotly.graph_objects as go

from .. import __version__
from ..fleet.overview import COLUMNS, Replica, replicas, series
from ..units import fmt
from . import figures as F
from .html import chart_box, esc, page

STATUS_COLOR = {"rule": F.SEVERITY_COLOR["critical"], "outlier": F.SEVERITY_COLOR["warning"], "healthy": "#9ca3af"}
STATUS_LABEL = {"rule": "a rule fired", "outlier": "far from its peers", "healthy": "healthy"}
#: heatmap rows at most (busiest and flagged replicas first); the table lists every replica
MAX_HEATMAP_ROWS = 60
EXTRA_CSS = """
td.st-rule{color:#b91c1c;font-weight:650}td.st-outlier{color:#b45309;font-weight:650}td.st-healthy{color:#6b7280}
td.name{white-space:nowrap}
.finding{margin:0 0 12px}.finding .sum{margin:2px 0 0}
.sev-tag{display:inline-block;font-size:11px;font-weight:700;text-transform:uppercase;color:#fff;border-radius:4px;padding:1px 6px;margin-right:6px}
"""


def load_chart(rows: list[Replica]) -> F.Chart:
    """Every replica as a point: load it took (x) against its TTFT P99, else its median queue (y)."""
    title = "Replicas: load against latency"
    y_sig, y_label, scale, unit = "ttft_p99_s", "TTFT P99", 1.0, "s"
    if sum(math.isfinite(r.values.get(y_sig, math.nan)) for r in rows) < 2:
        y_sig, y_label, unit = "requests_waiting_p50", "requests waiting (median)", ""
    pts = [(r, r.load_per_s, r.values.get(y_sig, math.nan)) for r in rows]
    pts = [(r, x, y) for r, x, y in pts if math.isfinite(x) and math.isfinite(y)]
    if len(pts) < 2:
        return F.Chart("load", title, None, notes=["fewer than two replicas with both a load counter and a latency or queue figure"])
    fig = go.Figure()
    for status in ("healthy", "outlier", "rule"):
        sel = [(r, x, y) for r, x, y in pts if r.status == status]
        if not sel:
            continue
        text = [F.esc(f"{r.name}: {', '.join(r.findings) or 'healthy'}") for r, _, _ in sel]
        fig.add_trace(go.Scatter(
            x=[x for _, x, _ in sel], y=[y * scale for _, _, y in sel], mode="markers", name=STATUS_LABEL[status],
            marker={"color": STATUS_COLOR[status], "size": 9 if status != "healthy" else 7, "line": {"width": 0.5, "color": "#fff"}},
            text=text, hovertemplate="%{text}<br>load %{x:,.1f}<br>" + F.esc(y_label) + " %{y:.3g}" + unit + "<extra></extra>"))
    units = sorted({r.load_unit for r, _, _ in pts})
    F.base_layout(fig, 420, xaxis_title=F.esc(f"load ({' / '.join(units)})"), yaxis_title=F.esc(f"{y_label}" + (f" ({unit})" if unit else "")))
    n_bad = sum(r.status != "healthy" for r, _, _ in pts)
    cap = (f"{len(pts)} replicas; {n_bad} flagged. A flagged point far right took more load than its peers "
           "(imbalance); one at the same load but higher up is a sick host or config drift.")
    return F.Chart("load", title, fig, cap)


def queue_heatmap(fd, rows: list[Replica]) -> F.Chart:
    """Requests waiting (else KV usage) per replica over time, flagged and busiest replicas on top."""
    title = "Queue per replica over time"
    neutral, what = "requests_waiting", "requests waiting"
    data = {r.name: series(fd, r.name, neutral) for r in rows}
    if not any(np.isfinite(v).any() for _, v in data.values()):
        neutral, what, title = "kv_usage_frac", "KV cache usage", "KV cache usage per replica over time"
        data = {r.name: series(fd, r.name, neutral) for r in rows}
    shown = [r for r in rows if np.isfinite(data[r.name][1]).any()][:MAX_HEATMAP_ROWS]
    if not shown:
        return F.Chart("heatmap", title, None, notes=["no replica reports requests waiting or KV usage"])
    d = fd.data
    grid = d.start_s + d.step_s * np.arange(int(round((d.end_s - d.start_s) / d.step_s)) + 1)
    z = np.full((len(shown), len(grid)), np.nan)
    for i, r in enumerate(shown):
        t, v = data[r.name]
        k = np.clip(np.round((t - d.start_s) / d.step_s).astype(int), 0, len(grid) - 1)
        z[i, k] = v
    labels = [F.esc(f"{'● ' if r.status != 'healthy' else ''}{r.name}") for r in shown]
    fig = go.Figure(go.Heatmap(z=z[::-1], x=grid * 1000.0, y=labels[::-1], colorscale="YlOrRd", hoverongaps=False,
                               colorbar={"title": {"text": F.esc(what)}},
                               hovertemplate="%{y}<br>%{x}<br>" + F.esc(what) + " %{z:.3g}<extra></extra>"))
    F.base_layout(fig, max(260, 40 + 16 * len(shown)), xaxis={"type": "date"}, yaxis={"automargin": True})
    more = len(rows) - len(shown)
    cap = (f"{what} at each step ({d.step_s:g} s), one row per replica; ● marks a replica with a finding."
           + (f" {more} more replicas are in the table below." if more > 0 else ""))
    return F.Chart("heatmap", title, fig, cap)





class _Page:
    def __init__(self, fd, title: str | None):
        self.fd, self.rows = fd, replicas(fd)
        self.title = title or f"kvdoctor fleet · {fd.data.source}"
        self.figures: dict = {}

    def chart(self, ch: F.Chart) -> str:
        return chart_box(ch, ch.id, self.figures)

    def top(self) -> str:
        d = self.fd.data
        iso = lambda t: dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")  # noqa: E731
        items = [f"<span>{esc(d.source)}</span>", f"<span>{len(d.samples)} replicas</span>",
                 f"<span>{esc(iso(d.start_s))} → {esc(iso(d.end_s))}, step {d.step_s:g} s</span>",
                 f"<span>{d.queries} queries, {d.bytes / 1e6:.1f} MB</span>"]
        warn = "".join(f'<p class="meta">{esc(w)}</p>' for w in d.warnings[:5])
        nav = "".join(f'<a href="#{k}">{v}</a>' for k, v in (("findings", "Findings"), ("charts", "Charts"), ("replicas", "Replicas")))
        return (f'<header class="top"><div class="wrap"><h1>{esc(self.title)}</h1><p class="meta">{"".join(items)}</p>{warn}</div></header>'
                f'<nav class="nav"><div class="wrap">{nav}</div></nav>')

    def findings(self) -> str:
        if not self.fd.findings:
            body = '<p class="line">No rule fired on any replica, and none is far from its peers.</p>'
        else:
            parts = []
            for f in self.fd.findings:
                on = ", ".join(f["instances"][:10]) + (f" and {len(f['instances']) - 10} more" if len(f["instances"]) > 10 else "")
                color = F.SEVERITY_COLOR.get(f["severity"], F.SEVERITY_COLOR["info"])
                parts.append(f'<div class="finding"><span class="sev-tag" style="background:{color}">{esc(f["severity"])}</span>'
                             f'<code class="rule">{esc(f["rule"])}</code> [{esc(f["scope"])}/{esc(f["kind"])}] on <b>{esc(on)}</b>'
                             f'<p class="line sum">{esc(f["summary"])}</p></div>')
            body = "".join(parts)
        return f'<section id="findings" class="card"><h2>Findings</h2>{body}</section>'

    def table(self) -> str:
        head = "".join(f"<th>{esc(h)}</th>" for h in ("replica", "engine", "status", "load", *[c[1] for c in COLUMNS]))
        rows = []
        for r in self.rows:
            cells = [f'<td class="name"><code>{esc(r.name)}</code></td>', f"<td>{esc(' + '.join([str(r.engine)] + r.joined))}</td>",
                     f'<td class="st-{esc(r.status)}">{esc(", ".join(r.findings) or "healthy")}</td>',
                     f'<td class="n">{esc(fmt(r.load_per_s, ""))} <span class="doc">{esc(r.load_unit)}</span></td>']
            cells += [f'<td class="n">{esc(fmt(r.values.get(s, math.nan), u))}</td>' for s, _, u in COLUMNS]
            rows.append("<tr>" + "".join(cells) + "</tr>")
        return (f'<section id="replicas" class="card"><h2>Replicas</h2><table><tr>{head}</tr>{"".join(rows)}</table>'
                '<p class="note">Values over the whole range. n/a: the engine does not export it, or it needs per-request data.</p></section>')

    def render(self) -> str:
        charts = f'<section id="charts" class="card"><h2>Charts</h2><div class="views">{self.chart(load_chart(self.rows))}' \
                 f'{self.chart(queue_heatmap(self.fd, self.rows))}</div></section>'
        now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        footer = (f"<footer>Generated by kvdoctor {esc(__version__)} on {esc(now)}. Self-contained (plotly.js embedded); "
                  "works offline. Per-replica diagnoses: <code>kvdoctor diagnose --prometheus … --format json</code>.</footer>")
        return page(self.title, self.top(), [self.findings(), charts, self.table()], footer, self.figures, EXTRA_CSS)


def render_fleet_html(fd, title: str | None = None) -> str:
    """The fleet page for a :class:`kvdoctor.fleet.FleetDiagnosis`, as one HTML string."""
    return _Page(fd, title).render()
