"""Charts of what the workload asks for: prompt lengths, conversation turns, prefix reuse."""
from __future__ import annotations

import math

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ...diagnosis import Diagnosis
from ...signals import Prepared
from ...units import fmt
from .chart import Chart, readings, time_buckets, timebase, whole
from .reduce import bucket_index, bucket_percentiles
from .style import COLORS, SEVERITY_COLOR, SLO_COLOR, base_layout, lat_unit

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
    base_layout(fig, 380, barmode="stack", bargap=0.02, hovermode="closest")
    cap = (f"{int(m.sum()):,} prompts: P50 {qv[50]:,.0f} · P95 {qv[95]:,.0f} · P99 {qv[99]:,.0f} tokens, "
           f"P99/P50 {qv[99] / max(qv[50], 1):.1f}x"
           + (f"; context limit {limit:,.0f} tokens" if math.isfinite(limit) else "; context limit unknown (not in the capture's config)")
           + (f"; {int(bad.sum()):,} failed requests stacked in red" if bad.sum() else "") + ".")
    return Chart("prompt-lengths", title, fig, cap)


def turns_chart(diag: Diagnosis, prep: Prepared) -> Chart:
    """Per conversation turn: median and P90 TTFT and median TPOT (top), median prompt
    tokens, the context the KV cache must hold (bottom)."""
    title = "Latency and context vs conversation turn"
    turn = prep.column("turn")
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
    scale, unit = lat_unit(*[x[2] for x in lat]) if lat else (1000.0, "ms")
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
    base_layout(fig, 420, hovermode="x unified", bargap=0.3)
    w = whole(prep, diag)
    parts = readings(w, (("ttft_growth_per_turn_frac", "fraction/turn"), ("tpot_growth_per_turn_frac", "fraction/turn"),
                         ("context_tokens_per_turn", "tokens/turn")))
    cap = f"Turns with at least 3 requests ({int(keep.sum())} turns, {int(np.isfinite(turn).sum()):,} requests)."
    if parts:
        cap += " Fitted: " + " · ".join(parts) + "."
    return Chart("turns", title, fig, cap)


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
    width, nb, centers_s = time_buckets(diag, prep)
    t = prep.t
    prompt = prep.col["prompt_tokens"]
    centers = tb.x(centers_s)
    drew = False
    for name, col, color in (("achieved", "cached_prompt_tokens", COLORS[0]), ("achievable", "achievable_cached_tokens", COLORS[2])):
        v = prep.column(col)
        m = np.isfinite(t) & np.isfinite(v) & np.isfinite(prompt)
        if m.sum() < 5:
            continue
        b = bucket_index(t[m], diag.start_s, width, nb)
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
    base_layout(fig, 380, hovermode="x unified")
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
