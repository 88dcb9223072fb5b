"""The memory chart: KV cache, GPU and host memory over time against capacity, with
preemptions and events (OOM, restarts) as markers."""
from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ...diagnosis import Diagnosis
from ...signals import Prepared
from .chart import Chart, incident_bands, readings, time_axes, timebase, whole
from .reduce import MAX_SERIES_POINTS, downsample_series
from .style import COLORS, SEVERITY_COLOR, SLO_COLOR, base_layout, esc

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
            t, v = downsample_series(et, kv)
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
                t, v = downsample_series(gt[sel], used[sel])
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
            t, v = downsample_series(ht, rss)
            fig.add_trace(go.Scatter(x=tb.x(t), y=v / 2**30, mode="lines", name="server RSS",
                                     line={"color": COLORS[4], "width": 1.6}, hovertemplate="%{y:.2f} GiB"), row=r, col=1)
            fig.update_yaxes(rangemode="tozero", row=r, col=1)
            tops.append(float(np.nanmax(rss)) / 2**30 * 1.04)
    for kind, evs in _events_by_kind(events).items():
        symbol, color, label = EVENT_STYLE[kind]
        ts = tb.x(np.array([e.get("time_s", np.nan) for e in evs], dtype=float))
        text = [esc(_event_text(e)) for e in evs]
        for r in range(1, len(rows) + 1):  # a marker on every row's top edge, one legend entry
            fig.add_trace(go.Scatter(x=ts, y=[tops[r - 1]] * len(ts), mode="markers", name=label,
                                     legendgroup=f"ev-{kind}", showlegend=r == 1,
                                     marker={"symbol": symbol, "color": color, "size": 11, "line": {"width": 1, "color": "#fff"}},
                                     text=text, hovertemplate="%{text}<extra>" + label + "</extra>"), row=r, col=1)
    incident_bands(fig, diag, tb)
    time_axes(fig, tb)
    base_layout(fig, 230 * len(rows) + 80, hovermode="x unified")
    w = whole(prep, diag)
    parts = readings(w, (("kv_usage_max_frac", "fraction"),)) + readings(
        w, (("preemptions_per_min", "1/min"), ("gpu_mem_used_max_frac", "fraction"), ("gpu_mem_growth_mib_per_h", "MiB/h"),
            ("oom_events", "count"), ("server_restarts", "count")), keep_zero=False)
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
