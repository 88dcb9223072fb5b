"""Report figures: pure functions from a diagnosis (and the capture it read) to plotly figures.

No HTML and no I/O here; :mod:`kvdoctor.report.html` assembles the page. Every builder returns
a :class:`Chart`: an id, a title, a caption with the numbers the chart shows, the figure (None
when the capture lacks the data, with a one-line note saying what is missing) and the rules and
symptoms whose findings it supports (a rule's ``charts:``), so the page can place it beside them.

Scale: nothing here sends raw per-request arrays to the page. Latencies over time are
percentiles per time bucket (computed with numpy), histograms are binned here, and scatters
are stratified samples of at most ``max_points`` points drawn as WebGL (``Scattergl``), so a
1,000,000-request capture makes a page of a few MB that renders in about a second.

Any text that comes from a capture or a rule file and ends up inside a figure (hover text,
labels) is HTML-escaped here, because plotly renders a subset of HTML in SVG text.
"""
from __future__ import annotations

import html
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..diagnosis import Diagnosis
from ..signals import Prepared
from ..signals.registry import fit
from ..units import duration_text, fmt

#: SLOs drawn on the charts when the user gave none (``--slo`` overrides each); the Grafana
#: dashboards in dashboards/ use the same numbers as thresholds. Drawing only: diagnosis uses
#: the SLOs given on the command line, never these.
DEFAULT_SLO: dict[str, float] = {
    "ttft_p99_s": 2.0,
    "tpot_p99_s": 0.1,
    "itl_p99_s": 0.2,
    "error_rate": 0.01,
}

#: at most this many points in one scatter; the rest is summarised by the median line
MAX_POINTS = 20_000
#: time buckets per chart at most, and the requests a bucket should hold on average
MAX_BUCKETS = 200
MIN_PER_BUCKET = 20
#: a percentile is drawn only for buckets with at least this many values
MIN_FOR_PERCENTILE = 5
#: engine, GPU and host samples drawn per series at most (bucketed by max beyond that)
MAX_SERIES_POINTS = 2_000
NICE_WIDTHS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)

SEVERITY_COLOR = {"critical": "#dc2626", "warning": "#d97706", "info": "#2563eb"}
SEVERITY_FILL = {"critical": "rgba(220,38,38,0.08)", "warning": "rgba(217,119,6,0.08)", "info": "rgba(37,99,235,0.06)"}
PCT_COLOR = {50: "#2563eb", 90: "#7c3aed", 99: "#db2777"}
COLORS = ("#2563eb", "#db2777", "#059669", "#d97706", "#7c3aed", "#0891b2", "#4b5563")
SLO_COLOR = "#b91c1c"

#: a small template instead of plotly's default one (which adds ~8 KB to every figure)
TEMPLATE: dict[str, Any] = {
    "layout": {
        "font": {"family": "system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif", "size": 12, "color": "#1f2937"},
        "paper_bgcolor": "#ffffff",
        "plot_bgcolor": "#ffffff",
        "colorway": list(COLORS),
        "xaxis": {"gridcolor": "#eef0f3", "linecolor": "#9ca3af", "zeroline": False, "automargin": True},
        "yaxis": {"gridcolor": "#eef0f3", "linecolor": "#9ca3af", "zeroline": False, "automargin": True},
        "hoverlabel": {"namelength": -1},
        "legend": {"orientation": "h", "yanchor": "bottom", "y": 1.02, "xanchor": "left", "x": 0},
        "margin": {"l": 60, "r": 20, "t": 36, "b": 45},
    }
}

#: the charts for a symptom: for rules that name none (their ``charts:``), and after the causes' own
SYMPTOM_CHARTS: dict[str, tuple[str, ...]] = {
    "ttft": ("latency", "ttft-prompt"),
    "tpot": ("latency", "concurrency"),
    "latency": ("latency",),
    "memory": ("memory",),
    "errors": ("errors",),
    "turn-growth": ("turns",),
    "capacity": ("prompt-lengths", "concurrency"),
    "quality": ("prompt-lengths",),
}


@dataclass
class Chart:
    id: str
    title: str
    figure: go.Figure | None
    caption: str = ""
    #: why the figure is absent ("no GPU samples in this capture"), or parts of it that are
    notes: list[str] = field(default_factory=list)
    #: extra table under the chart (e.g. the most common error messages): header, rows
    table: tuple[tuple[str, ...], list[tuple[Any, ...]]] | None = None

    @property
    def present(self) -> bool:
        return self.figure is not None


# -- helpers ------------------------------------------------------------------------------


@dataclass
class Timebase:
    """Instants on the capture clock → x values: epoch ms on a date axis for wall-clock
    captures, seconds since the start otherwise."""

    start_s: float
    is_date: bool

    def x(self, t: np.ndarray | float) -> np.ndarray | float:
        if self.is_date:
            return np.asarray(t, dtype=float) * 1000.0 if isinstance(t, np.ndarray) else float(t) * 1000.0
        return t - self.start_s

    def axis(self) -> dict[str, Any]:
        if self.is_date:
            return {"type": "date", "title": {"text": "time (UTC)"}}
        return {"title": {"text": "seconds since start"}}


def timebase(diag: Diagnosis) -> Timebase:
    return Timebase(diag.start_s, diag.capture.meta.clock == "unix" and diag.start_s > 1e9)


def bucket_width(span_s: float, n: int) -> float:
    """A round bucket width: at most MAX_BUCKETS buckets, about MIN_PER_BUCKET requests each."""
    want = max(span_s / MAX_BUCKETS, span_s * MIN_PER_BUCKET / max(n, 1), 1e-9)
    for w in NICE_WIDTHS_S:
        if w >= want:
            return float(w)
    return float(math.ceil(want / 86400) * 86400)


def bucket_percentiles(t: np.ndarray, v: np.ndarray, start_s: float, width_s: float, n_buckets: int,
                       qs: tuple[float, ...] = (50, 90, 99), min_n: int = MIN_FOR_PERCENTILE) -> tuple[np.ndarray, np.ndarray]:
    """Per-bucket counts and percentiles (linear interpolation, as numpy.percentile) of ``v`` by
    the bucket of ``t``; NaN where a bucket holds fewer than ``min_n`` values. One sort for all."""
    m = np.isfinite(t) & np.isfinite(v)
    b = np.clip(((t[m] - start_s) // width_s).astype(np.int64), 0, max(n_buckets - 1, 0))
    vals = v[m]
    counts = np.bincount(b, minlength=n_buckets)[:n_buckets]
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    out = np.full((len(qs), n_buckets), np.nan)
    if not len(vals):
        return counts, out
    # sort by (bucket, value) with one float sort: bucket * stride + value, stride > value range
    # (3x faster than lexsort on 1M values; the round trip costs ~1e-12 of the value range)
    lo_v = float(vals.min())
    stride = (float(vals.max()) - lo_v) * 1.5 + 1.0
    key = np.sort(b * stride + (vals - lo_v))
    vals = key - np.repeat(np.arange(len(counts)) * stride, counts) + lo_v
    ok = counts >= max(min_n, 1)
    if not ok.any():
        return counts, out
    s, c = starts[ok], counts[ok]
    for i, q in enumerate(qs):
        pos = s + (c - 1) * (q / 100.0)
        lo = np.floor(pos).astype(np.int64)
        hi = np.minimum(lo + 1, s + c - 1)
        frac = pos - lo
        out[i, ok] = vals[lo] + (vals[hi] - vals[lo]) * frac
    return counts, out


def stratified_sample(x: np.ndarray, y: np.ndarray, max_points: int = MAX_POINTS, n_strata: int = 50,
                      keep_top: int = 200, seed: int = 0) -> np.ndarray:
    """Indices of at most ``max_points`` finite (x, y) pairs: an equal share from each of
    ``n_strata`` equal-width bins of x (sparse regions such as rare long prompts keep all their
    points, dense ones are thinned), a sparse bin's unused share passed on to the others, plus
    the ``keep_top`` largest y (the slowest requests stay visible)."""
    idx = np.flatnonzero(np.isfinite(x) & np.isfinite(y))
    if len(idx) <= max_points:
        return idx
    xs, ys = x[idx], y[idx]
    top = idx[np.argpartition(ys, len(ys) - keep_top)[-keep_top:]] if keep_top else idx[:0]
    budget = max_points - len(top)
    lo_x, hi_x = float(xs.min()), float(xs.max())
    width = (hi_x - lo_x) / n_strata or 1.0  # equal-width strata along the drawn (linear) axis
    stratum = np.clip(((xs - lo_x) // width).astype(np.int64), 0, n_strata - 1)
    counts = np.bincount(stratum, minlength=n_strata)
    # water-filling: the largest per-stratum quota q with sum(min(count, q)) <= budget
    lo, hi = 0, int(counts.max())
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if np.minimum(counts, mid).sum() <= budget:
            lo = mid
        else:
            hi = mid - 1
    quota = np.minimum(counts, lo)
    # each stratum keeps each of its points with probability quota/count (O(n), no sort); the
    # few points over budget that chance adds are dropped at random
    rng = np.random.default_rng(seed)
    keep_p = quota / np.maximum(counts, 1)
    chosen = np.flatnonzero(rng.random(len(xs)) < keep_p[stratum])
    if len(chosen) > budget:
        chosen = np.sort(rng.choice(chosen, budget, replace=False))
    return np.unique(np.concatenate([idx[chosen], top]))


def _lat_unit(*arrays: np.ndarray) -> tuple[float, str]:
    """Scale and label for latencies: ms unless the values run to seconds."""
    vals = np.concatenate([np.ravel(a) for a in arrays]) if arrays else np.array([])
    vals = vals[np.isfinite(vals)]
    if len(vals) and np.percentile(vals, 95) >= 2.0:
        return 1.0, "s"
    return 1000.0, "ms"


def _f32(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float32)


def _downsample_series(t: np.ndarray, v: np.ndarray, max_points: int = MAX_SERIES_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """At most ``max_points`` samples of a time series: the max of each time bucket beyond that
    (memory and usage problems show at their peaks)."""
    m = np.isfinite(t) & np.isfinite(v)
    t, v = t[m], v[m]
    if len(t) <= max_points:
        order = np.argsort(t, kind="stable")
        return t[order], v[order]
    lo, hi = t.min(), t.max()
    width = (hi - lo) / max_points or 1.0
    b = np.clip(((t - lo) // width).astype(np.int64), 0, max_points - 1)
    out = np.full(max_points, -np.inf)
    np.maximum.at(out, b, v)
    has = np.isfinite(out)
    centers = lo + (np.arange(max_points) + 0.5) * width
    return centers[has], out[has]


def _esc(s: Any) -> str:
    return html.escape(str(s), quote=True)


def _template() -> str:
    """TEMPLATE registered once under a name: a figure then copies the validated template
    instead of validating the dict again (~70 ms a figure)."""
    import plotly.io as pio

    if "kvdoctor" not in pio.templates:
        pio.templates["kvdoctor"] = go.layout.Template(TEMPLATE)
    return "kvdoctor"


def _base_layout(fig: go.Figure, height: int, **kw: Any) -> go.Figure:
    fig.update_layout(template=_template(), height=height, **kw)
    return fig


def _incident_bands(fig: go.Figure, diag: Diagnosis, tb: Timebase, label_row_axis: str = "y") -> None:
    """Shade each incident's span across the whole figure, labelled with its number."""
    span = max(diag.end_s - diag.start_s, 1e-9)
    starts: list[float] = []
    for n, inc in enumerate(diag.incidents, 1):
        x0, x1 = tb.x(inc.start_s), tb.x(max(inc.end_s, inc.start_s + 1e-3))
        fig.add_shape(type="rect", xref="x", yref="paper", x0=x0, x1=x1, y0=0, y1=1, layer="below",
                      line={"width": 0}, fillcolor=SEVERITY_FILL.get(inc.severity, SEVERITY_FILL["info"]))
        # labels of incidents that start close together are stacked, not drawn over each other
        k = sum(abs(s - inc.start_s) < 0.15 * span for s in starts)
        starts.append(inc.start_s)
        fig.add_annotation(x=x0, xref="x", y=1.0, yref="paper", yshift=-14 * k, text=f"#{n} {_esc(inc.symptom)}",
                           showarrow=False, xanchor="left", yanchor="top", xshift=2, bgcolor="rgba(255,255,255,0.85)",
                           font={"size": 11, "color": SEVERITY_COLOR.get(inc.severity, "#2563eb")})


def _time_axes(fig: go.Figure, tb: Timebase) -> None:
    """Every x axis of a stacked time chart gets the same type (plotly refuses to link axes of
    different types); only the bottom one carries the title."""
    axis = tb.axis()
    fig.update_xaxes(type=axis.get("type", "linear"))
    names = sorted((k for k in fig.layout.to_plotly_json() if k.startswith("xaxis")), key=lambda k: int(k[5:] or 1))
    fig.layout[names[-1]].title = axis["title"]


def _slo(diag: Diagnosis) -> tuple[dict[str, float], set[str]]:
    """The SLOs to draw, and which of them the user gave (the rest are report defaults)."""
    given = dict(diag.options.slo)
    return {**DEFAULT_SLO, **given}, set(given)


def whole(prep: Prepared, diag: Diagnosis):
    """The whole-capture window, one per Prepared, so charts share its memoised signals."""
    w = getattr(prep, "_kvd_report_whole", None)
    if w is None or (w.t0, w.t1) != (diag.start_s, diag.end_s):
        w = prep.window(diag.start_s, diag.end_s)
        prep._kvd_report_whole = w
    return w


# -- the charts ---------------------------------------------------------------------------


def latency_chart(diag: Diagnosis, prep: Prepared) -> Chart:
    """TTFT, TPOT and ITL P50/P90/P99 per time bucket, SLO lines, incidents shaded, and the
    request rate underneath."""
    title = "Latency over time: TTFT, TPOT, ITL"
    t = prep.t
    finite_t = np.isfinite(t)
    if prep.cap.meta.clock != "unix" and len(t) and not finite_t.any():
        return Chart("latency", title, None, notes=["no request times in this capture"])
    series: list[tuple[str, str, dict[int, np.ndarray]]] = []
    tb = timebase(diag)
    span = max(diag.end_s - diag.start_s, 1e-9)
    width = bucket_width(span, int(finite_t.sum()))
    nb = int(span // width) + 1
    centers_s = diag.start_s + (np.arange(nb) + 0.5) * width
    counts_all = np.bincount(np.clip(((t[finite_t] - diag.start_s) // width).astype(np.int64), 0, nb - 1), minlength=nb)[:nb]
    notes = []
    for key, label, col in (("ttft", "TTFT", "ttft_s"), ("tpot", "TPOT", "tpot_s")):
        v = prep.col[col]
        if np.isfinite(v).sum() >= MIN_FOR_PERCENTILE:
            _, p = bucket_percentiles(t, v, diag.start_s, width, nb)
            series.append((key, label, {50: p[0], 90: p[1], 99: p[2]}))
        else:
            notes.append(f"no {label} in this capture")
    itl = _itl_percentiles(prep, diag.start_s, width, nb)
    if itl:
        series.append(("itl", "ITL", itl))
    else:
        notes.append("no inter-token latencies in this capture")
    if not series:
        return Chart("latency", title, None, notes=["no request latencies in this capture"])
    scale, unit = _lat_unit(*[p for s in series for p in s[2].values()])
    rows = len(series) + 1
    fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=0.035,
                        row_heights=[1.0] * len(series) + [0.45])
    for r, s_ in enumerate(series, 1):
        fig.update_yaxes(title_text=f"{s_[1]} ({unit})", rangemode="tozero", row=r, col=1)
    fig.update_yaxes(title_text="req/s", row=rows, col=1)
    slo, given = _slo(diag)
    x = tb.x(centers_s)
    for r, (key, label, pct) in enumerate(series, 1):
        for q, vals in sorted(pct.items()):
            fig.add_trace(go.Scatter(x=x, y=vals * scale, mode="lines", name=f"P{q}", legendgroup=f"p{q}", showlegend=r == 1,
                                     line={"color": PCT_COLOR[q], "width": 1.6 if q != 99 else 2.0}, connectgaps=False,
                                     hovertemplate=f"{label} P{q} %{{y:.3~g}} {unit}<extra></extra>"), row=r, col=1)
        top = max([float(np.nanmax(v)) for v in pct.values() if np.isfinite(v).any()] or [0.0])
        for q in (50, 90, 99):
            name = f"{key}_p{q}_s"
            if name in slo:
                _slo_line(fig, slo[name], scale, top * scale, f"{'SLO' if name in given else 'SLO (default)'} P{q}", "s", row=r)
    rate = counts_all / width
    fig.add_trace(go.Bar(x=x, y=rate, name="requests/s", marker={"color": "#9ca3af"}, showlegend=False,
                         hovertemplate="%{y:.3~g} req/s"), row=rows, col=1)
    _incident_bands(fig, diag, tb)
    _time_axes(fig, tb)
    _base_layout(fig, 170 * len(series) + 170, hovermode="x unified", bargap=0.05)
    w = whole(prep, diag)
    cap = " · ".join(f"{n} {fmt(w.value(n), 's')}" for n in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "itl_p99_s")
                     if math.isfinite(w.value(n)))
    cap = (f"Percentiles per {fmt(width, 's') if width < 1 else duration_text(width)} bucket; whole capture: {cap}. "
           "Dashed: SLO lines. Shaded: incidents.") if cap else "Shaded: incidents."
    return Chart("latency", title, fig, cap, notes)


def _slo_line(fig: go.Figure, value: float, scale: float, data_max: float, label: str, unit: str,
              row: int | None = None, secondary_y: bool | None = None) -> None:
    """A dashed SLO line; when the data stays far below it the axis keeps the data's scale and
    a note at the top says where the SLO is instead (a line at 10x the data flattens it)."""
    y = value * scale
    where = {"row": row, "col": 1} if row else {}
    if secondary_y is not None:
        where.update(row=row or 1, col=1)
        where["secondary_y"] = secondary_y
    text = f"{label} {fmt(value, unit)}"
    if data_max > 0 and y > 1.6 * data_max:
        fig.add_hline(y=data_max * 1.12, line={"width": 0}, annotation_text=f"{text} (above the chart)",
                      annotation_position="top right", annotation_font={"size": 10, "color": SLO_COLOR}, **where)
        return
    fig.add_hline(y=y, line={"color": SLO_COLOR, "dash": "dash", "width": 1.2}, annotation_text=text,
                  annotation_position="top right", annotation_font={"size": 10, "color": SLO_COLOR}, **where)


def _itl_percentiles(prep: Prepared, start_s: float, width: float, nb: int) -> dict[int, np.ndarray] | None:
    """ITL percentiles per bucket: of every token gap when the capture kept the lists (each gap
    at its request's arrival), else of the per-request P50s and P99s (as the ITL signals)."""
    t = prep.t
    if prep.itl is not None:
        offsets, values, order = prep.itl
        lengths = np.diff(offsets)
        owner_t = np.repeat(prep.cap.requests.num("arrival_s"), lengths)
        vals = values[offsets[0]:offsets[-1]]
        if len(vals) > 4_000_000:  # keep the cost bounded: an even subsample of the gaps
            step = len(vals) // 4_000_000 + 1
            vals, owner_t = vals[::step], owner_t[::step]
        if len(vals) >= MIN_FOR_PERCENTILE:
            _, p = bucket_percentiles(owner_t, vals, start_s, width, nb)
            return {50: p[0], 90: p[1], 99: p[2]}
    out = {}
    for q, col in ((50, "itl_p50_s"), (99, "itl_p99_s")):
        v = prep.col[col]
        if np.isfinite(v).sum() >= MIN_FOR_PERCENTILE:
            out[q] = bucket_percentiles(t, v, start_s, width, nb, qs=(q,))[1][0]
    return out or None


def ttft_prompt_chart(diag: Diagnosis, prep: Prepared, max_points: int = MAX_POINTS) -> Chart:
    """TTFT against prompt length: a stratified sample as WebGL points, the fitted line, and
    the median TTFT per prompt-length bin."""
    title = "TTFT vs prompt length"
    p, ttft = prep.col["prompt_tokens"], prep.col["ttft_s"]
    m = np.isfinite(p) & np.isfinite(ttft)
    if m.sum() < 8:
        missing = "prompt lengths" if not np.isfinite(p).any() else "TTFT"
        return Chart("ttft-prompt", title, None, notes=[f"no {missing} in this capture"])
    if np.ptp(p[m]) == 0:
        return Chart("ttft-prompt", title, None,
                     notes=[f"every prompt has the same length ({p[m][0]:,.0f} tokens), so TTFT cannot vary with it"])
    fig, scale, unit, drawn = _scatter_with_median(p, ttft, m, max_points, COLORS[0], "%{x:,.0f} tokens")
    slope, corr, _ = fit(p, ttft)
    cap = f"{int(m.sum()):,} requests" + (f" ({drawn:,} drawn, stratified by prompt length)" if drawn < m.sum() else "")
    if math.isfinite(slope):
        intercept = float(np.mean(ttft[m]) - slope * np.mean(p[m]))
        x0, x1 = float(np.min(p[m])), float(np.max(p[m]))
        fig.add_trace(go.Scatter(x=[x0, x1], y=[(intercept + slope * x0) * scale, (intercept + slope * x1) * scale],
                                 mode="lines", name=f"fit: {slope * 1e6:+,.1f} ms per 1k tokens",
                                 line={"color": SEVERITY_COLOR["critical"], "dash": "dash", "width": 2}))
        cap += f"; least-squares slope {slope * 1e6:+,.1f} ms per 1k prompt tokens, rank correlation {corr:.2f}"
    fig.update_xaxes(title_text="prompt tokens")
    fig.update_yaxes(title_text=f"TTFT ({unit})", rangemode="tozero")
    _base_layout(fig, 420, hovermode="closest")
    return Chart("ttft-prompt", title, fig, cap + ".")


def _scatter_with_median(x: np.ndarray, y: np.ndarray, m: np.ndarray, max_points: int, color: str,
                         x_hover: str) -> tuple[go.Figure, float, str, int]:
    """A downsampled WebGL scatter of latency ``y`` against ``x`` with its binned median line;
    returns the figure, the latency scale and unit it used, and how many points it drew."""
    idx = stratified_sample(x, y, max_points)
    scale, unit = _lat_unit(y[m])
    fig = go.Figure()
    fig.add_trace(go.Scattergl(x=_f32(x[idx]), y=_f32(y[idx] * scale), mode="markers", name="requests",
                               marker={"size": 4, "color": color, "opacity": 0.35},
                               hovertemplate=f"{x_hover} → %{{y:.3~g}} {unit}<extra></extra>"))
    xb, med = _binned_median(x[m], y[m])
    fig.add_trace(go.Scatter(x=xb, y=med * scale, mode="lines+markers", name="median per bin",
                             line={"color": "#111827", "width": 1.5}, marker={"size": 5},
                             hovertemplate=f"median %{{y:.3~g}} {unit}<extra></extra>"))
    return fig, scale, unit, len(idx)


def _binned_median(x: np.ndarray, y: np.ndarray, bins: int | None = None, min_n: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """Median of y in quantile bins of x (at the bin's median x); about 40 points a bin for
    small samples, 30 bins at most."""
    bins = bins or int(np.clip(len(x) // 40, 4, 30))
    edges = np.unique(np.quantile(x, np.linspace(0, 1, bins + 1)))
    if len(edges) < 2:
        return np.array([np.median(x)]), np.array([np.median(y)])
    b = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, len(edges) - 2)
    nb = len(edges) - 1
    _, py = bucket_percentiles(b.astype(float), y, 0.0, 1.0, nb, qs=(50,), min_n=min_n)
    _, px = bucket_percentiles(b.astype(float), x, 0.0, 1.0, nb, qs=(50,), min_n=min_n)
    ok = np.isfinite(py[0]) & np.isfinite(px[0])
    return px[0][ok], py[0][ok]


def turns_chart(diag: Diagnosis, prep: Prepared) -> Chart:
    """Per conversation turn: median and P90 TTFT and median TPOT (top), median prompt
    tokens, the context the KV cache must hold (bottom)."""
    title = "Latency and context vs conversation turn"
    turn = prep.col["turn"]
    if np.isfinite(turn).sum() < 6 or np.nanmax(turn) < 2:
        return Chart("turns", title, None, notes=["no conversation turns in this capture"])
    # buckets for the turn numbers present, not 0..max: one request with turn=1e8 must not
    # allocate arrays of 1e8 buckets
    finite = np.isfinite(turn)
    present, index = np.unique(np.floor(turn[finite]), return_inverse=True)
    slot = np.full(len(turn), np.nan)
    slot[finite] = index
    nb = len(present)
    counts = np.bincount(index, minlength=nb)
    keep = counts >= 3
    xs = present[keep].astype(np.int64)
    _, pp = bucket_percentiles(slot, prep.col["prompt_tokens"], 0.0, 1.0, nb, qs=(50,), min_n=3)
    ctx = pp[0][keep]
    lat = []
    for col, label, qs in (("ttft_s", "TTFT", (50, 90)), ("tpot_s", "TPOT", (50,))):
        v = prep.col[col]
        if np.isfinite(v).sum() >= 6:
            _, p = bucket_percentiles(slot, v, 0.0, 1.0, nb, qs=qs, min_n=3)
            lat += [(label, q, p[i][keep]) for i, q in enumerate(qs)]
    has_ctx = bool(np.isfinite(ctx).any())
    if not lat and not has_ctx:
        return Chart("turns", title, None, notes=["no latencies or prompt lengths per turn in this capture"])
    rows = (1 if lat else 0) + (1 if has_ctx else 0)
    fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        row_heights=[0.65, 0.35] if rows == 2 else [1.0])
    scale, unit = _lat_unit(*[x[2] for x in lat]) if lat else (1000.0, "ms")
    for label, q, vals in lat:
        color = {("TTFT", 50): COLORS[0], ("TTFT", 90): "#7c3aed", ("TPOT", 50): COLORS[2]}[(label, q)]
        fig.add_trace(go.Scatter(x=xs, y=vals * scale, mode="lines+markers", name=f"{label} P{q}",
                                 line={"color": color, "width": 2, "dash": "dot" if q == 90 else "solid"},
                                 hovertemplate=f"%{{y:.3~g}} {unit}"), row=1, col=1)
    if lat:
        fig.update_yaxes(title_text=f"latency ({unit})", rangemode="tozero", row=1, col=1)
    if has_ctx:
        fig.add_trace(go.Bar(x=xs, y=ctx, name="median prompt tokens", marker={"color": "#94a3b8"},
                             hovertemplate="%{y:,.0f} tokens"), row=rows, col=1)
        fig.update_yaxes(title_text="prompt tokens", rangemode="tozero", row=rows, col=1)
    fig.update_xaxes(dtick=1 if len(xs) <= 30 else None)
    fig.update_xaxes(title_text="conversation turn", row=rows, col=1)
    _base_layout(fig, 420, hovermode="x unified", bargap=0.3)
    w = whole(prep, diag)
    parts = [f"{n.replace('_', ' ')} {fmt(w.value(n), u)}" for n, u in
             (("ttft_growth_per_turn_frac", "fraction/turn"), ("tpot_growth_per_turn_frac", "fraction/turn"),
              ("context_tokens_per_turn", "tokens/turn")) if math.isfinite(w.value(n))]
    cap = f"Turns with at least 3 requests ({int(keep.sum())} turns, {int(np.isfinite(turn).sum()):,} requests)."
    if parts:
        cap += " Fitted: " + " · ".join(parts) + "."
    return Chart("turns", title, fig, cap)


EVENT_STYLE = {
    "oom": ("x", SEVERITY_COLOR["critical"], "OOM"),
    "server-restart": ("triangle-down", "#7c3aed", "restart"),
    "server-down": ("triangle-down", "#111827", "server down"),
    "server-up": ("triangle-up", "#059669", "server up"),
    "preemption": ("diamond", SEVERITY_COLOR["warning"], "preemption"),
    "error-burst": ("star", SEVERITY_COLOR["critical"], "error burst"),
    "config": ("square", "#4b5563", "config"),
}


def memory_chart(diag: Diagnosis, prep: Prepared) -> Chart:
    """KV cache usage (engine) and GPU memory (NVML) over time against their capacity, the
    server's resident memory, preemptions and events (OOM, restarts) as markers."""
    title = "KV cache and GPU memory over time"
    cap_ = prep.cap
    tb = timebase(diag)
    notes: list[str] = []
    rows: list[str] = []
    kv = cap_.engine.get("kv_usage_frac")
    et = cap_.engine.time_s
    if kv is not None and np.isfinite(kv).any():
        rows.append("kv")
    else:
        notes.append("no KV-cache usage from the engine in this capture")
    gpu = prep.gpu  # NVML samples, else DCGM figures from the engine scrape
    gt, used, total = gpu.num("time_s"), gpu.num("mem_used_bytes"), gpu.num("mem_total_bytes")
    if len(gt) and np.isfinite(used).any():
        rows.append("gpu")
    else:
        notes.append("no GPU samples in this capture" if not len(gt) else "GPU samples carry no memory use")
    rss = cap_.host.num("server_rss_bytes")
    if len(rss) and np.isfinite(rss).any():
        rows.append("host")
    events = [e for e in prep.events if e.get("kind") in EVENT_STYLE and e.get("kind") != "config"]
    pre = cap_.engine.get("preemptions_total")
    if not rows:
        notes = ["no KV-cache, GPU or host memory samples in this capture"]
        return Chart("memory", title, None, notes=notes)
    titles = {"kv": "KV cache used (%)", "gpu": "GPU memory (GiB)", "host": "server RSS (GiB)"}
    fig = make_subplots(rows=len(rows), cols=1, shared_xaxes=True, vertical_spacing=0.06)
    for r, kind in enumerate(rows, 1):
        fig.update_yaxes(title_text=titles[kind], row=r, col=1)
    tops: list[float] = []  # where each row's event markers sit: its top edge
    for r, kind in enumerate(rows, 1):
        if kind == "kv":
            t, v = _downsample_series(et, kv)
            fig.add_trace(go.Scatter(x=tb.x(t), y=v * 100, mode="lines", name="KV usage", line={"color": COLORS[0], "width": 1.6},
                                     hovertemplate="%{y:.1f}%"), row=r, col=1)
            fig.add_hline(y=100, line={"color": SLO_COLOR, "dash": "dash", "width": 1.2}, row=r, col=1,
                          annotation_text="capacity", annotation_position="bottom right",
                          annotation_font={"size": 10, "color": SLO_COLOR})
            fig.update_yaxes(range=[0, 112], row=r, col=1)
            tops.append(106.0)
            if pre is not None and np.isfinite(pre).sum() >= 2:
                ok = np.isfinite(pre)
                d = np.diff(pre[ok])
                inc = np.where(d >= 0, d, pre[ok][1:])
                hit = inc > 0
                if hit.any():
                    pt = et[ok][1:][hit]
                    py = np.interp(pt, et[np.isfinite(kv)], kv[np.isfinite(kv)]) * 100
                    n = inc[hit]
                    if len(pt) > MAX_SERIES_POINTS:
                        sel = np.argsort(n)[-MAX_SERIES_POINTS:]
                        pt, py, n = pt[sel], py[sel], n[sel]
                    fig.add_trace(go.Scatter(x=tb.x(pt), y=py, mode="markers", name="preemptions",
                                             marker={"symbol": "diamond", "color": SEVERITY_COLOR["warning"],
                                                     "size": np.clip(5 + 2 * np.sqrt(n), 6, 16),
                                                     "line": {"width": 0.5, "color": "#fff"}},
                                             customdata=n, hovertemplate="%{customdata:.0f} preempted"), row=r, col=1)
        elif kind == "gpu":
            gi = gpu.num("gpu_index")
            gpus = sorted({int(g) for g in gi[np.isfinite(gi)]}) or [None]
            for k, g in enumerate(gpus):
                sel = np.isfinite(gi) & (gi == g) if g is not None else np.ones(len(gt), bool)
                t, v = _downsample_series(gt[sel], used[sel])
                label = f"GPU {g} used" if g is not None else "GPU used"
                fig.add_trace(go.Scatter(x=tb.x(t), y=v / 2**30, mode="lines", name=label,
                                         line={"color": COLORS[(k + 2) % len(COLORS)], "width": 1.6},
                                         hovertemplate="%{y:.2f} GiB"), row=r, col=1)
            tot = total[np.isfinite(total)]
            if len(tot):
                fig.add_hline(y=float(tot.max()) / 2**30, line={"color": SLO_COLOR, "dash": "dash", "width": 1.2}, row=r, col=1,
                              annotation_text=f"capacity {tot.max() / 2**30:.0f} GiB", annotation_position="bottom right",
                              annotation_font={"size": 10, "color": SLO_COLOR})
                fig.update_yaxes(range=[0, float(tot.max()) / 2**30 * 1.12], row=r, col=1)
                tops.append(float(tot.max()) / 2**30 * 1.06)
            else:
                tops.append(float(np.nanmax(used)) / 2**30 * 1.04)
        else:
            ht = cap_.host.num("time_s")
            t, v = _downsample_series(ht, rss)
            fig.add_trace(go.Scatter(x=tb.x(t), y=v / 2**30, mode="lines", name="server RSS",
                                     line={"color": COLORS[4], "width": 1.6}, hovertemplate="%{y:.2f} GiB"), row=r, col=1)
            fig.update_yaxes(rangemode="tozero", row=r, col=1)
            tops.append(float(np.nanmax(rss)) / 2**30 * 1.04)
    for kind, evs in _events_by_kind(events).items():
        symbol, color, label = EVENT_STYLE[kind]
        ts = tb.x(np.array([e.get("time_s", np.nan) for e in evs], dtype=float))
        text = [_esc(_event_text(e)) for e in evs]
        for r in range(1, len(rows) + 1):  # a marker on every row's top edge, one legend entry
            fig.add_trace(go.Scatter(x=ts, y=[tops[r - 1]] * len(ts), mode="markers", name=label,
                                     legendgroup=f"ev-{kind}", showlegend=r == 1,
                                     marker={"symbol": symbol, "color": color, "size": 11, "line": {"width": 1, "color": "#fff"}},
                                     text=text, hovertemplate="%{text}<extra>" + label + "</extra>"), row=r, col=1)
    _incident_bands(fig, diag, tb)
    _time_axes(fig, tb)
    _base_layout(fig, 230 * len(rows) + 80, hovermode="x unified")
    w = whole(prep, diag)
    parts = [f"{n.replace('_', ' ')} {fmt(w.value(n), u)}" for n, u in
             (("kv_usage_max_frac", "fraction"), ("preemptions_per_min", "1/min"), ("gpu_mem_used_max_frac", "fraction"),
              ("gpu_mem_growth_mib_per_h", "MiB/h"), ("oom_events", "count"), ("server_restarts", "count"))
             if math.isfinite(w.value(n)) and (w.value(n) != 0 or n == "kv_usage_max_frac")]
    cap = ("Whole capture: " + " · ".join(parts) + ". " if parts else "") + "Dashed: capacity. Markers: events. Shaded: incidents."
    return Chart("memory", title, fig, cap, [n for n in notes if "GPU" in n] if "kv" in rows or "gpu" in rows else notes)


def _events_by_kind(events: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        out.setdefault(e["kind"], []).append(e)
    return out


def _event_text(e: dict[str, Any]) -> str:
    detail = e.get("detail") or {}
    msg = detail.get("message") or detail.get("error") or detail.get("reason") or ""
    return f"{e.get('kind')}" + (f": {str(msg)[:160]}" if msg else "")


def bandwidth_chart(diag: Diagnosis, prep: Prepared) -> Chart:
    """Memory-bandwidth utilisation against TPOT, one point per time bucket (mean utilisation
    over the GPUs' samples, TPOT P50 and P90 of the requests that arrived in it)."""
    title = "Memory bandwidth vs TPOT"
    g = prep.gpu
    if not len(g):
        return Chart("bandwidth", title, None, notes=["no GPU samples in this capture"])
    bw, src = g.num("dram_bw_util_frac"), "DRAM bandwidth utilisation (GPM)"
    if not np.isfinite(bw).any():
        bw, src = g.num("mem_util_frac"), "memory utilisation (NVML)"
    if not np.isfinite(bw).any():
        return Chart("bandwidth", title, None, notes=["GPU samples carry no memory-bandwidth utilisation"])
    tpot = prep.col["tpot_s"]
    if np.isfinite(tpot).sum() < MIN_FOR_PERCENTILE:
        return Chart("bandwidth", title, None, notes=["no TPOT in this capture"])
    gt = g.num("time_s")
    span = max(diag.end_s - diag.start_s, 1e-9)
    width = bucket_width(span, int(np.isfinite(prep.t).sum()))
    nb = int(span // width) + 1
    m = np.isfinite(gt) & np.isfinite(bw)
    bb = np.clip(((gt[m] - diag.start_s) // width).astype(np.int64), 0, nb - 1)
    n_bw = np.bincount(bb, minlength=nb)[:nb]
    bw_mean = np.bincount(bb, weights=bw[m], minlength=nb)[:nb] / np.where(n_bw > 0, n_bw, np.nan)
    _, p = bucket_percentiles(prep.t, tpot, diag.start_s, width, nb, qs=(50, 90))
    ok = np.isfinite(bw_mean) & np.isfinite(p[0])
    if ok.sum() < 2:
        return Chart("bandwidth", title, None, notes=["GPU samples and requests do not overlap in time"])
    scale, unit = _lat_unit(p[1][ok])
    centers = diag.start_s + (np.arange(nb) + 0.5) * width
    when = [diag.time_label(c) for c in centers[ok]]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=bw_mean[ok] * 100, y=p[1][ok] * scale, mode="markers", name="TPOT P90",
                             marker={"symbol": "circle-open", "size": 7, "color": "#7c3aed"}, text=when,
                             hovertemplate=f"%{{text}}<br>bandwidth %{{x:.0f}}%<br>TPOT P90 %{{y:.3~g}} {unit}<extra></extra>"))
    fig.add_trace(go.Scatter(x=bw_mean[ok] * 100, y=p[0][ok] * scale, mode="markers", name="TPOT P50",
                             marker={"size": 8, "color": np.arange(int(ok.sum())),
                                     "colorscale": "Viridis", "showscale": True,
                                     "colorbar": {"title": {"text": "time →"}, "showticklabels": False, "thickness": 10}},
                             text=when, hovertemplate=f"%{{text}}<br>bandwidth %{{x:.0f}}%<br>TPOT P50 %{{y:.3~g}} {unit}<extra></extra>"))
    fig.add_vline(x=70, line={"color": SLO_COLOR, "dash": "dot", "width": 1}, annotation_text="70%: saturated",
                  annotation_position="top left", annotation_font={"size": 10, "color": SLO_COLOR})
    fig.update_xaxes(title_text=f"{src} (%)", range=[0, 105])
    fig.update_yaxes(title_text=f"TPOT ({unit})", rangemode="tozero")
    _base_layout(fig, 400, hovermode="closest")
    w = whole(prep, diag)
    cap = (f"One point per {duration_text(width)} bucket ({int(ok.sum())} buckets); colour runs with time. "
           f"Whole capture: bandwidth P50 {fmt(w.value('mem_bw_util_p50'), 'fraction')}, "
           f"P90 {fmt(w.value('mem_bw_util_p90'), 'fraction')}.")
    return Chart("bandwidth", title, fig, cap)


def concurrency_chart(diag: Diagnosis, prep: Prepared, max_points: int = MAX_POINTS) -> Chart:
    """TPOT against the mean number of requests in flight while each request decoded."""
    title = "Concurrency vs TPOT"
    c, tpot = prep.col["decode_concurrency"], prep.col["tpot_s"]
    m = np.isfinite(c) & np.isfinite(tpot)
    if m.sum() < 8:
        why = "no TPOT in this capture" if not np.isfinite(tpot).any() else "no request finish times (concurrency unknown) in this capture"
        return Chart("concurrency", title, None, notes=[why])
    fig, scale, unit, drawn = _scatter_with_median(c, tpot, m, max_points, COLORS[2], "%{x:.1f} in flight")
    w = whole(prep, diag)
    mx = w.value("max_concurrency_configured")
    if math.isfinite(mx):
        fig.add_vline(x=mx, line={"color": SLO_COLOR, "dash": "dash", "width": 1.2}, annotation_text=f"configured max {mx:.0f}",
                      annotation_position="top left", annotation_font={"size": 10, "color": SLO_COLOR})
    fig.update_xaxes(title_text="requests in flight while decoding (mean)", rangemode="tozero")
    fig.update_yaxes(title_text=f"TPOT ({unit})", rangemode="tozero")
    _base_layout(fig, 400, hovermode="closest")
    parts = [f"{n.replace('_', ' ')} {fmt(w.value(n), u)}" for n, u in
             (("tpot_concurrency_corr", "rank corr"), ("tpot_high_over_low_concurrency", "ratio"), ("concurrency_max", "requests"))
             if math.isfinite(w.value(n))]
    cap = f"{int(m.sum()):,} requests" + (f" ({drawn:,} drawn)" if drawn < m.sum() else "")
    return Chart("concurrency", title, fig, cap + (": " + " · ".join(parts) if parts else "") + ".")


def prompt_length_chart(diag: Diagnosis, prep: Prepared) -> Chart:
    """Histogram of prompt lengths (failed requests stacked on top), P50/P95/P99 and the
    context limit as vertical lines."""
    title = "Prompt-length distribution"
    p = prep.col["prompt_tokens"]
    m = np.isfinite(p)
    if m.sum() < 5:
        return Chart("prompt-lengths", title, None, notes=["no prompt lengths in this capture"])
    w = whole(prep, diag)
    limit = w.value("context_limit_tokens")
    hi = float(np.max(p[m]))
    edges = np.histogram_bin_edges(p[m], bins=min(80, max(10, int(np.sqrt(m.sum())))), range=(0.0, max(hi, 1.0)))
    ok = m & ~prep.is_error
    bad = m & prep.is_error
    n_ok, _ = np.histogram(p[ok], edges)
    n_bad, _ = np.histogram(p[bad], edges)
    centers = (edges[:-1] + edges[1:]) / 2
    widths = np.diff(edges)
    fig = go.Figure()
    fig.add_trace(go.Bar(x=centers, y=n_ok, width=widths, name="ok", marker={"color": COLORS[0]},
                         customdata=np.stack([edges[:-1], edges[1:]], axis=1),
                         hovertemplate="%{customdata[0]:,.0f}–%{customdata[1]:,.0f} tokens: %{y:,} ok<extra></extra>"))
    if n_bad.sum():
        fig.add_trace(go.Bar(x=centers, y=n_bad, width=widths, name="failed", marker={"color": SEVERITY_COLOR["critical"]},
                             customdata=np.stack([edges[:-1], edges[1:]], axis=1),
                             hovertemplate="%{customdata[0]:,.0f}–%{customdata[1]:,.0f} tokens: %{y:,} failed<extra></extra>"))
    qv = {q: float(np.percentile(p[m], q)) for q in (50, 95, 99)}
    lines = [(v, f"P{q} {v:,.0f}", "#111827", "dot") for q, v in qv.items()]
    if math.isfinite(limit):
        lines.append((limit, f"context limit {limit:,.0f}", SLO_COLOR, "dash"))
    x_max = max(hi, limit if math.isfinite(limit) else 0) * 1.04
    for k, (v, text, color, dash) in enumerate(lines):  # labels stepped down so close lines stay readable
        right = v > 0.8 * x_max
        fig.add_vline(x=v, line={"color": color, "dash": dash, "width": 1.2 if dash == "dot" else 2})
        fig.add_annotation(x=v, xref="x", y=1.0 - 0.08 * k, yref="paper", text=text, showarrow=False,
                           xanchor="right" if right else "left", xshift=-3 if right else 3,
                           font={"size": 10, "color": color}, bgcolor="rgba(255,255,255,0.8)")
    fig.update_xaxes(title_text="prompt tokens", range=[0, x_max])
    fig.update_yaxes(title_text="requests")
    _base_layout(fig, 380, barmode="stack", bargap=0.02, hovermode="closest")
    cap = (f"{int(m.sum()):,} prompts: P50 {qv[50]:,.0f} · P95 {qv[95]:,.0f} · P99 {qv[99]:,.0f} tokens, "
           f"P99/P50 {qv[99] / max(qv[50], 1):.1f}x"
           + (f"; context limit {limit:,.0f} tokens" if math.isfinite(limit) else "; context limit unknown (not in the capture's config)")
           + (f"; {int(bad.sum()):,} failed requests stacked in red" if bad.sum() else "") + ".")
    return Chart("prompt-lengths", title, fig, cap)


def prefix_cache_chart(diag: Diagnosis, prep: Prepared) -> Chart:
    """Prefix-cache hit rate achieved (what the server served from cache) against achievable
    (what an ideal prefix cache could, from the prompts' block hashes): whole capture and per
    time bucket."""
    title = "Prefix-cache hit rate: achieved vs achievable"
    w = whole(prep, diag)
    achieved, achievable = w.value("prefix_hit_rate_achieved"), w.value("prefix_hit_rate_achievable")
    if not math.isfinite(achieved) and not math.isfinite(achievable):
        return Chart("prefix-cache", title, None,
                     notes=["no prefix-cache data (cached prompt tokens, engine hit counters or prompt block hashes) in this capture"])
    fig = make_subplots(rows=1, cols=2, column_widths=[0.22, 0.78], horizontal_spacing=0.1)
    names = ["achieved", "achievable"]
    vals = [achieved, achievable]
    fig.add_trace(go.Bar(x=names, y=[v * 100 if math.isfinite(v) else None for v in vals], showlegend=False,
                         marker={"color": [COLORS[0], COLORS[2]]}, text=[fmt(v, "fraction") for v in vals],
                         textposition="outside", hovertemplate="%{x}: %{y:.1f}%<extra></extra>"), row=1, col=1)
    notes = []
    tb = timebase(diag)
    span = max(diag.end_s - diag.start_s, 1e-9)
    width = bucket_width(span, int(np.isfinite(prep.t).sum()))
    nb = int(span // width) + 1
    t = prep.t
    prompt = prep.col["prompt_tokens"]
    centers = tb.x(diag.start_s + (np.arange(nb) + 0.5) * width)
    drew = False
    for name, col, color in (("achieved", "cached_prompt_tokens", COLORS[0]), ("achievable", "achievable_cached_tokens", COLORS[2])):
        v = prep.column(col)
        m = np.isfinite(t) & np.isfinite(v) & np.isfinite(prompt)
        if m.sum() < 5:
            continue
        b = np.clip(((t[m] - diag.start_s) // width).astype(np.int64), 0, nb - 1)
        num = np.bincount(b, weights=v[m], minlength=nb)[:nb]
        den = np.bincount(b, weights=prompt[m], minlength=nb)[:nb]
        rate = np.where(den > 0, num / np.where(den > 0, den, 1), np.nan) * 100
        fig.add_trace(go.Scatter(x=centers, y=rate, mode="lines+markers", name=name, line={"color": color, "width": 2},
                                 marker={"size": 4}, hovertemplate=f"{name} %{{y:.1f}}%<extra></extra>"), row=1, col=2)
        drew = True
    if not drew:
        notes.append("per-request prefix data absent: over-time view not drawn")
    fig.update_yaxes(title_text="share of prompt tokens (%)", range=[0, 110], row=1, col=1)
    fig.update_yaxes(range=[0, 105], row=1, col=2)
    fig.update_xaxes(title_text="whole capture", row=1, col=1)
    fig.update_xaxes(tb.axis(), row=1, col=2)
    _base_layout(fig, 380, hovermode="x unified")
    gap = w.value("prefix_hit_gap")
    if math.isfinite(achieved):
        cap = f"Achieved: {fmt(achieved, 'fraction')} of prompt tokens served from the prefix cache"
    else:
        cap = "Achieved: unknown (no cached prompt tokens per request and no engine prefix-cache counters)"
    if math.isfinite(achievable):
        cap += f"; achievable: an ideal prefix cache could serve {fmt(achievable, 'fraction')}"
    else:
        cap += "; achievable: unknown (no prompt block hashes in this capture)"
    cap += (f" (gap {fmt(gap, 'fraction')})" if math.isfinite(gap) else "") + "."
    return Chart("prefix-cache", title, fig, cap, notes)


def errors_chart(diag: Diagnosis, prep: Prepared, top: int = 8) -> Chart:
    """Failed requests per time bucket by status, the error rate with its SLO line, and the
    most common error messages as a table."""
    title = "Errors over time"
    err = prep.is_error
    if not len(err) or not err.any():
        return Chart("errors", title, None, notes=["no failed requests in this capture"])
    req = prep.cap.requests
    order = prep._order
    codes, labels = req.codes("status")
    status = np.array(list(labels) + [""], dtype=object)[codes[order]]
    t = prep.t
    tb = timebase(diag)
    span = max(diag.end_s - diag.start_s, 1e-9)
    width = bucket_width(span, int(np.isfinite(t).sum()))
    nb = int(span // width) + 1
    ft = np.isfinite(t)
    b = np.clip(((t[ft] - diag.start_s) // width).astype(np.int64), 0, nb - 1)
    total = np.bincount(b, minlength=nb)[:nb]
    x = tb.x(diag.start_s + (np.arange(nb) + 0.5) * width)
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    kinds = sorted({s for s in status[err] if s}, key=lambda s: (s != "error", s)) or ["error"]
    palette = {"error": SEVERITY_COLOR["critical"], "rejected": SEVERITY_COLOR["warning"], "cancelled": "#6b7280"}
    for k, s in enumerate(kinds):
        sel = (status[ft] == s) & err[ft] if s else err[ft]
        n = np.bincount(b[sel], minlength=nb)[:nb]
        fig.add_trace(go.Bar(x=x, y=n, name=_esc(s or "failed"), marker={"color": palette.get(s, COLORS[(k + 3) % len(COLORS)])},
                             hovertemplate="%{y:,} " + _esc(s or "failed") + "<extra></extra>"), secondary_y=False)
    nerr = np.bincount(b[err[ft]], minlength=nb)[:nb]
    rate = np.where(total >= 5, nerr / np.maximum(total, 1), np.nan) * 100
    fig.add_trace(go.Scatter(x=x, y=rate, mode="lines", name="error rate", line={"color": "#111827", "width": 1.8},
                             hovertemplate="%{y:.2f}%<extra>error rate</extra>"), secondary_y=True)
    slo, given = _slo(diag)
    if "error_rate" in slo:
        rate_max = float(np.nanmax(rate)) if np.isfinite(rate).any() else 0.0
        _slo_line(fig, slo["error_rate"], 100.0, rate_max, "SLO" if "error_rate" in given else "SLO (default)", "fraction",
                  secondary_y=True)
    _incident_bands(fig, diag, tb)
    fig.update_xaxes(tb.axis())
    fig.update_yaxes(title_text="failed requests", secondary_y=False)
    fig.update_yaxes(title_text="error rate (%)", rangemode="tozero", showgrid=False, tickmode="auto", tickformat=".2~f",
                     secondary_y=True)
    _base_layout(fig, 360, barmode="stack", hovermode="x unified", bargap=0.1)
    # most common messages: counted on dictionary codes, so 1M requests cost one bincount
    ecodes, elabels = req.codes("error")
    ecodes = ecodes[order][err]
    counts = np.bincount(ecodes[ecodes >= 0], minlength=len(elabels)) if len(elabels) else np.array([], dtype=np.int64)
    rows = sorted(((elabels[i], int(c)) for i, c in enumerate(counts) if c), key=lambda r: -r[1])
    missing = int((ecodes < 0).sum())
    table_rows = [(msg, n, f"{n / max(int(err.sum()), 1):.0%}") for msg, n in rows[:top]]
    if missing:
        table_rows.append(("(no message)", missing, f"{missing / max(int(err.sum()), 1):.0%}"))
    w = whole(prep, diag)
    cap = (f"{int(err.sum()):,} of {len(err):,} requests failed ({fmt(w.value('error_rate'), 'fraction')}); worst minute "
           f"{fmt(w.value('error_rate_max_1m'), 'fraction')}. Bars: failed requests per {duration_text(width)}; line: error rate.")
    return Chart("errors", title, fig, cap, table=(("error message", "requests", "share"), table_rows))


BUILDERS = {
    "latency": latency_chart,
    "ttft-prompt": ttft_prompt_chart,
    "turns": turns_chart,
    "memory": memory_chart,
    "bandwidth": bandwidth_chart,
    "concurrency": concurrency_chart,
    "prompt-lengths": prompt_length_chart,
    "prefix-cache": prefix_cache_chart,
    "errors": errors_chart,
}


def build_charts(diag: Diagnosis, prep: Prepared | None = None) -> dict[str, Chart]:
    """Every chart, in BUILDERS order, present or with a note saying why not."""
    prep = prep or diag.prepared or Prepared(diag.capture, diag.options.slo)
    return {key: fn(diag, prep) for key, fn in BUILDERS.items()}


def charts_for(incident, available: dict[str, Chart]) -> list[str]:
    """Chart ids that support an incident's findings, best first: the top cause's charts (its
    rule's ``charts:``, else its rule's symptom's), then the other causes', then the incident's
    symptom's."""
    out: list[str] = []
    for c in incident.causes:
        for key in c.rule.charts or SYMPTOM_CHARTS.get(c.rule.symptom, ()):
            if key in available and key not in out:
                out.append(key)
    for key in SYMPTOM_CHARTS.get(incident.symptom, ()):
        if key in available and key not in out:
            out.append(key)
    return out


def placement(diag: Diagnosis, charts: dict[str, Chart]) -> tuple[dict[int, list[str]], dict[int, list[str]], list[str]]:
    """Where each chart goes: ``(shown, referenced, rest)``. A chart is drawn once, in the
    first (most severe) incident it supports; later incidents it supports link to it; charts
    no incident needs go to the closing "more views" section."""
    shown: dict[int, list[str]] = {}
    referenced: dict[int, list[str]] = {}
    placed: set[str] = set()
    for n, inc in enumerate(diag.incidents, 1):
        for key in charts_for(inc, charts):
            if key in placed:
                referenced.setdefault(n, []).append(key)
            else:
                shown.setdefault(n, []).append(key)
                placed.add(key)
    rest = [k for k in charts if k not in placed]
    return shown, referenced, rest


def key_numbers(diag: Diagnosis, prep: Prepared) -> list[tuple[str, str, bool]]:
    """The numbers at the top of the page: (label, value, over its SLO)."""
    w = whole(prep, diag)
    slo, _ = _slo(diag)
    out = [("requests", f"{len(diag.capture.requests):,}", False)]
    for name, label, unit in (("ttft_p50_s", "TTFT P50", "s"), ("ttft_p99_s", "TTFT P99", "s"), ("tpot_p50_s", "TPOT P50", "s"),
                              ("tpot_p99_s", "TPOT P99", "s"), ("itl_p99_s", "ITL P99", "s"), ("error_rate", "error rate", "fraction"),
                              ("output_tokens_per_s", "output tokens/s", "tokens/s")):
        v = w.value(name)
        if math.isfinite(v):
            text = fmt(v, unit) if unit != "tokens/s" else f"{v:,.0f}"
            out.append((label, text, name in slo and v > slo[name]))
    return out


def error_messages(diag: Diagnosis) -> Counter:
    """Error message → count (for callers that want them without the chart)."""
    req = diag.capture.requests
    codes, labels = req.codes("error")
    return Counter({labels[i]: int(c) for i, c in enumerate(np.bincount(codes[codes >= 0], minlength=len(labels))) if c})
