"""Charts of TTFT or TPOT against what drives it: prompt length, requests in flight, memory
bandwidth."""
from __future__ import annotations

import math

import numpy as np
import plotly.graph_objects as go

from ...diagnosis import Diagnosis
from ...signals import Prepared
from ...signals.registry import FIT_MIN_X_SPREAD_FRAC, fit
from ...units import duration_text, fmt
from .chart import Chart, readings, time_buckets, whole
from .reduce import MAX_POINTS, MIN_FOR_PERCENTILE, binned_median, bucket_index, bucket_percentiles, f32, stratified_sample
from .style import COLORS, SEVERITY_COLOR, SLO_COLOR, base_layout, lat_unit

def scatter_with_median(x: np.ndarray, y: np.ndarray, m: np.ndarray, max_points: int, color: str,
                         x_hover: str) -> tuple[go.Figure, float, str, int]:
    """A downsampled WebGL scatter of latency ``y`` against ``x`` with its binned median line;
    returns the figure, the latency scale and unit it used, and how many points it drew."""
    idx = stratified_sample(x, y, max_points)
    scale, unit = lat_unit(y[m])
    fig = go.Figure()
    fig.add_trace(go.Scattergl(x=f32(x[idx]), y=f32(y[idx] * scale), mode="markers", name="requests",
                               marker={"size": 4, "color": color, "opacity": 0.35},
                               hovertemplate=f"{x_hover} → %{{y:.3~g}} {unit}<extra></extra>"))
    xb, med = binned_median(x[m], y[m])
    fig.add_trace(go.Scatter(x=xb, y=med * scale, mode="lines+markers", name="median per bin",
                             line={"color": "#111827", "width": 1.5}, marker={"size": 5},
                             hovertemplate=f"median %{{y:.3~g}} {unit}<extra></extra>"))
    return fig, scale, unit, len(idx)


#: a fit is drawn only where the rank correlation is clear of chance: |rho| * sqrt(n - 1) >= 3
#: (Spearman's rho is ~normal with sd 1/sqrt(n - 1) under no relation; 3 is ~1 in 700)
FIT_MIN_Z = 3.0


def fit_supported(corr: float, n: int) -> bool:
    """Whether a fitted slope says anything: the x range wide enough to fit (fit() gave a number)
    and a rank correlation that chance would rarely give over ``n`` pairs."""
    return math.isfinite(corr) and n > 1 and abs(corr) * math.sqrt(n - 1) >= FIT_MIN_Z


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
    fig, scale, unit, drawn = scatter_with_median(p, ttft, m, max_points, COLORS[0], "%{x:,.0f} tokens")
    slope, corr, n = fit(p, ttft, min_spread_frac=FIT_MIN_X_SPREAD_FRAC)
    cap = f"{int(m.sum()):,} requests" + (f" ({drawn:,} drawn, stratified by prompt length)" if drawn < m.sum() else "")
    lo, hi = float(np.min(p[m])), float(np.max(p[m]))
    if not fit_supported(corr, n):  # a slope through no relation (or a narrow range) means nothing
        cap += (f"; no relation between prompt length and TTFT here (prompts of {lo:,.0f}-{hi:,.0f} tokens"
                + (f", rank correlation {corr:.2f}" if math.isfinite(corr) else ", too narrow a range to fit") + ")")
    elif math.isfinite(slope):
        intercept = float(np.mean(ttft[m]) - slope * np.mean(p[m]))
        x0, x1 = float(np.min(p[m])), float(np.max(p[m]))
        fig.add_trace(go.Scatter(x=[x0, x1], y=[(intercept + slope * x0) * scale, (intercept + slope * x1) * scale],
                                 mode="lines", name=f"fit: {slope * 1e6:+,.1f} ms per 1k tokens",
                                 line={"color": SEVERITY_COLOR["critical"], "dash": "dash", "width": 2}))
        cap += f"; least-squares slope {slope * 1e6:+,.1f} ms per 1k prompt tokens, rank correlation {corr:.2f}"
    fig.update_xaxes(title_text="prompt tokens")
    fig.update_yaxes(title_text=f"TTFT ({unit})", rangemode="tozero")
    base_layout(fig, 420, hovermode="closest")
    return Chart("ttft-prompt", title, fig, cap + ".")


def concurrency_chart(diag: Diagnosis, prep: Prepared, max_points: int = MAX_POINTS) -> Chart:
    """TPOT against the mean number of requests in flight while each request decoded."""
    title = "Concurrency vs TPOT"
    c, tpot = prep.col["decode_concurrency"], prep.col["tpot_s"]
    m = np.isfinite(c) & np.isfinite(tpot)
    if m.sum() < 8:
        why = "no TPOT in this capture" if not np.isfinite(tpot).any() else "no request finish times (concurrency unknown) in this capture"
        return Chart("concurrency", title, None, notes=[why])
    fig, scale, unit, drawn = scatter_with_median(c, tpot, m, max_points, COLORS[2], "%{x:.1f} in flight")
    w = whole(prep, diag)
    mx = w.value("max_concurrency_configured")
    if math.isfinite(mx):
        fig.add_vline(x=mx, line={"color": SLO_COLOR, "dash": "dash", "width": 1.2}, annotation_text=f"configured max {mx:.0f}",
                      annotation_position="top left", annotation_font={"size": 10, "color": SLO_COLOR})
    fig.update_xaxes(title_text="requests in flight while decoding (mean)", rangemode="tozero")
    fig.update_yaxes(title_text=f"TPOT ({unit})", rangemode="tozero")
    base_layout(fig, 400, hovermode="closest")
    parts = readings(w, (("tpot_concurrency_corr", "rank corr"), ("tpot_high_over_low_concurrency", "ratio"),
                         ("concurrency_max", "requests")))
    cap = f"{int(m.sum()):,} requests" + (f" ({drawn:,} drawn)" if drawn < m.sum() else "")
    return Chart("concurrency", title, fig, cap + (": " + " · ".join(parts) if parts else "") + ".")


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
    width, nb, centers = time_buckets(diag, prep)
    m = np.isfinite(gt) & np.isfinite(bw)
    bb = bucket_index(gt[m], diag.start_s, width, nb)
    n_bw = np.bincount(bb, minlength=nb)[:nb]
    bw_mean = np.bincount(bb, weights=bw[m], minlength=nb)[:nb] / np.where(n_bw > 0, n_bw, np.nan)
    _, p = bucket_percentiles(prep.t, tpot, diag.start_s, width, nb, qs=(50, 90))
    ok = np.isfinite(bw_mean) & np.isfinite(p[0])
    if ok.sum() < 2:
        return Chart("bandwidth", title, None, notes=["GPU samples and requests do not overlap in time"])
    scale, unit = lat_unit(p[1][ok])
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
    base_layout(fig, 400, hovermode="closest")
    w = whole(prep, diag)
    cap = (f"One point per {duration_text(width)} bucket ({int(ok.sum())} buckets); colour runs with time. "
           f"Whole capture: bandwidth P50 {fmt(w.value('mem_bw_util_p50'), 'fraction')}, "
           f"P90 {fmt(w.value('mem_bw_util_p90'), 'fraction')}.")
    return Chart("bandwidth", title, fig, cap)
