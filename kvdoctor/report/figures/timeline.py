"""Charts over time: latency percentiles per bucket with the request rate, and failed requests
with the error rate and the most common messages."""
from __future__ import annotations

import math

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ...diagnosis import Diagnosis
from ...signals import Prepared
from ...units import duration_text, fmt
from .chart import Chart, incident_bands, slo_line, slo_to_draw, time_axes, time_buckets, timebase, whole
from .reduce import MIN_FOR_PERCENTILE, bucket_index, bucket_percentiles
from .style import COLORS, PCT_COLOR, SEVERITY_COLOR, base_layout, esc, lat_unit

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
    width, nb, centers_s = time_buckets(diag, prep)
    counts_all = np.bincount(bucket_index(t[finite_t], diag.start_s, width, nb), minlength=nb)[:nb]
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
    scale, unit = lat_unit(*[p for s in series for p in s[2].values()])
    rows = len(series) + 1
    fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=0.035,
                        row_heights=[1.0] * len(series) + [0.45])
    for r, s_ in enumerate(series, 1):
        fig.update_yaxes(title_text=f"{s_[1]} ({unit})", rangemode="tozero", row=r, col=1)
    fig.update_yaxes(title_text="req/s", row=rows, col=1)
    slo, given = slo_to_draw(diag)
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
                slo_line(fig, slo[name], scale, top * scale, f"{'SLO' if name in given else 'SLO (default)'} P{q}", "s", row=r)
    rate = counts_all / width
    fig.add_trace(go.Bar(x=x, y=rate, name="requests/s", marker={"color": "#9ca3af"}, showlegend=False,
                         hovertemplate="%{y:.3~g} req/s"), row=rows, col=1)
    incident_bands(fig, diag, tb)
    time_axes(fig, tb)
    base_layout(fig, 170 * len(series) + 170, hovermode="x unified", bargap=0.05)
    w = whole(prep, diag)
    cap = " · ".join(f"{n} {fmt(w.value(n), 's')}" for n in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "itl_p99_s")
                     if math.isfinite(w.value(n)))
    cap = (f"Percentiles per {fmt(width, 's') if width < 1 else duration_text(width)} bucket; whole capture: {cap}. "
           "Dashed: SLO lines. Shaded: incidents.") if cap else "Shaded: incidents."
    return Chart("latency", title, fig, cap, notes)


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
    width, nb, centers_s = time_buckets(diag, prep)
    ft = np.isfinite(t)
    b = bucket_index(t[ft], diag.start_s, width, nb)
    total = np.bincount(b, minlength=nb)[:nb]
    x = tb.x(centers_s)
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    kinds = sorted({s for s in status[err] if s}, key=lambda s: (s != "error", s)) or ["error"]
    palette = {"error": SEVERITY_COLOR["critical"], "rejected": SEVERITY_COLOR["warning"], "cancelled": "#6b7280"}
    for k, s in enumerate(kinds):
        sel = (status[ft] == s) & err[ft] if s else err[ft]
        n = np.bincount(b[sel], minlength=nb)[:nb]
        fig.add_trace(go.Bar(x=x, y=n, name=esc(s or "failed"), marker={"color": palette.get(s, COLORS[(k + 3) % len(COLORS)])},
                             hovertemplate="%{y:,} " + esc(s or "failed") + "<extra></extra>"), secondary_y=False)
    nerr = np.bincount(b[err[ft]], minlength=nb)[:nb]
    rate = np.where(total >= 5, nerr / np.maximum(total, 1), np.nan) * 100
    fig.add_trace(go.Scatter(x=x, y=rate, mode="lines", name="error rate", line={"color": "#111827", "width": 1.8},
                             hovertemplate="%{y:.2f}%<extra>error rate</extra>"), secondary_y=True)
    slo, given = slo_to_draw(diag)
    if "error_rate" in slo:
        rate_max = float(np.nanmax(rate)) if np.isfinite(rate).any() else 0.0
        slo_line(fig, slo["error_rate"], 100.0, rate_max, "SLO" if "error_rate" in given else "SLO (default)", "fraction",
                  secondary_y=True)
    incident_bands(fig, diag, tb)
    fig.update_xaxes(tb.axis())
    fig.update_yaxes(title_text="failed requests", secondary_y=False)
    fig.update_yaxes(title_text="error rate (%)", rangemode="tozero", showgrid=False, tickmode="auto", tickformat=".2~f",
                     secondary_y=True)
    base_layout(fig, 360, barmode="stack", hovermode="x unified", bargap=0.1)
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
