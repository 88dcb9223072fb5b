"""How every figure looks: colours, the small plotly template, the latency unit, and escaping
of capture or rule text that ends up inside a figure (plotly renders a subset of HTML in SVG
text)."""
from __future__ import annotations

import html
from typing import Any

import numpy as np
import plotly.graph_objects as go

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


def lat_unit(*arrays: np.ndarray) -> tuple[float, str]:
    """Scale and label for latencies: ms unless the values run to seconds."""
    vals = np.concatenate([np.ravel(a) for a in arrays]) if arrays else np.array([])
    vals = vals[np.isfinite(vals)]
    if len(vals) and np.percentile(vals, 95) >= 2.0:
        return 1.0, "s"
    return 1000.0, "ms"


def esc(s: Any) -> str:
    return html.escape(str(s), quote=True)


def _template() -> str:
    """TEMPLATE registered once under a name: a figure then copies the validated template
    instead of validating the dict again (~70 ms a figure)."""
    import plotly.io as pio

    if "kvdoctor" not in pio.templates:
        pio.templates["kvdoctor"] = go.layout.Template(TEMPLATE)
    return "kvdoctor"


def base_layout(fig: go.Figure, height: int, **kw: Any) -> go.Figure:
    fig.update_layout(template=_template(), height=height, **kw)
    return fig
