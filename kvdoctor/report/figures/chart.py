"""What every chart builder shares: the :class:`Chart` it returns, the capture's time axis
with incidents shaded, the SLO lines, and the whole-capture window its numbers come from."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import plotly.graph_objects as go

from ...diagnosis import Diagnosis
from ...signals import Prepared
from ...units import fmt
from .reduce import bucket_width
from ...objectives import DEFAULT_WORKLOAD, WORKLOADS
from .style import SEVERITY_COLOR, SEVERITY_FILL, SLO_COLOR, esc

#: the default objectives (the chat workload's, kvdoctor/objectives.py): the Grafana dashboards in
#: dashboards/ draw them as thresholds; the report draws the objectives its diagnosis judged
DEFAULT_SLO: dict[str, float] = dict(WORKLOADS[DEFAULT_WORKLOAD])


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


def time_buckets(diag: Diagnosis, prep: Prepared) -> tuple[float, int, np.ndarray]:
    """The buckets every chart over time uses (so they line up): width, count and centres on
    the capture clock."""
    span = max(diag.end_s - diag.start_s, 1e-9)
    width = bucket_width(span, int(np.isfinite(prep.t).sum()))
    nb = int(span // width) + 1
    return width, nb, diag.start_s + (np.arange(nb) + 0.5) * width


def incident_bands(fig: go.Figure, diag: Diagnosis, tb: Timebase) -> None:
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
        fig.add_annotation(x=x0, xref="x", y=1.0, yref="paper", yshift=-14 * k, text=f"#{n} {esc(inc.symptom)}",
                           showarrow=False, xanchor="left", yanchor="top", xshift=2, bgcolor="rgba(255,255,255,0.85)",
                           font={"size": 11, "color": SEVERITY_COLOR.get(inc.severity, "#2563eb")})


def time_axes(fig: go.Figure, tb: Timebase) -> None:
    """Every x axis of a stacked time chart gets the same type (plotly refuses to link axes of
    different types); only the bottom one carries the title."""
    axis = tb.axis()
    fig.update_xaxes(type=axis.get("type", "linear"))
    names = sorted((k for k in fig.layout.to_plotly_json() if k.startswith("xaxis")), key=lambda k: int(k[5:] or 1))
    fig.layout[names[-1]].title = axis["title"]


def slo_to_draw(diag: Diagnosis) -> tuple[dict[str, float], set[str]]:
    """The objectives to draw (those the diagnosis judged), and which of them the user gave (the
    rest are the workload's defaults)."""
    objs = diag.options.objectives or ()
    objs = [o for o in objs if o.route is None]  # a route's objective is not a line over every request
    return {o.signal: o.target for o in objs}, {o.signal for o in objs if o.stated}


def whole(prep: Prepared, diag: Diagnosis):
    """The whole-capture window, one per Prepared (Prepared.window keeps it), so charts share its
    memoised signals with the diagnosis."""
    return prep.window(diag.start_s, diag.end_s)


def readings(w, names_units: tuple[tuple[str, str], ...], keep_zero: bool = True) -> list[str]:
    """'signal name value' for each signal the window measured (and, unless ``keep_zero``, is
    not 0), in order: the numbers a caption quotes."""
    return [f"{n.replace('_', ' ')} {fmt(w.value(n), u)}" for n, u in names_units
            if math.isfinite(w.value(n)) and (keep_zero or w.value(n) != 0)]


def slo_line(fig: go.Figure, value: float, scale: float, data_max: float, label: str, unit: str,
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
