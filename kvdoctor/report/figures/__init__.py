"""Report figures: pure functions from a diagnosis (and the capture it read) to plotly figures.

No HTML and no I/O here; :mod:`kvdoctor.report.html` assembles the page. Every builder returns
a :class:`Chart`: an id, a title, a caption with the numbers the chart shows, the figure (None
when the capture lacks the data, with a one-line note saying what is missing); :func:`placement`
puts each beside the incidents whose rules name it (a rule's ``charts:``).

Scale: nothing here sends raw per-request arrays to the page. Latencies over time are
percentiles per time bucket (computed with numpy), histograms are binned here, and scatters
are stratified samples of at most ``max_points`` points drawn as WebGL (``Scattergl``), so a
1,000,000-request capture makes a page of a few MB that renders in about a second.

Any text that comes from a capture or a rule file and ends up inside a figure (hover text,
labels) is HTML-escaped (:func:`esc`), because plotly renders a subset of HTML in SVG text.

Modules, each importing only those above it: style (colours, template, escaping), reduce
(bucketing, sampling), chart (the Chart record, time axis, SLO lines), the chart families
(timeline, memory, scatter, workload), catalog (every chart by id), placement, numbers.
"""
from __future__ import annotations

from ...signals import Prepared
from .catalog import BUILDERS, build_charts
from .chart import DEFAULT_SLO, Chart, Timebase, readings, slo_line, slo_to_draw, time_buckets, timebase, whole
from .memory import memory_chart
from .numbers import error_messages
from .placement import SYMPTOM_CHARTS, charts_for, placement
from .reduce import (MAX_BUCKETS, MAX_POINTS, MAX_SERIES_POINTS, MIN_FOR_PERCENTILE, MIN_PER_BUCKET, bucket_index,
                     bucket_percentiles, bucket_width, downsample_series, stratified_sample)
from .scatter import bandwidth_chart, concurrency_chart, ttft_prompt_chart
from .style import COLORS, PCT_COLOR, SEVERITY_COLOR, SEVERITY_FILL, SLO_COLOR, TEMPLATE, base_layout, esc, lat_unit
from .timeline import errors_chart, latency_chart
from .workload import prefix_cache_chart, prompt_length_chart, turns_chart

__all__ = [
    "BUILDERS", "COLORS", "DEFAULT_SLO", "MAX_BUCKETS", "MAX_POINTS", "MAX_SERIES_POINTS", "MIN_FOR_PERCENTILE",
    "MIN_PER_BUCKET", "PCT_COLOR", "SEVERITY_COLOR", "SEVERITY_FILL", "SLO_COLOR", "SYMPTOM_CHARTS", "TEMPLATE", "Chart",
    "Prepared", "Timebase", "bandwidth_chart", "base_layout", "bucket_index", "bucket_percentiles", "bucket_width",
    "build_charts", "charts_for", "concurrency_chart", "downsample_series", "error_messages", "errors_chart", "esc",
    "lat_unit", "latency_chart", "memory_chart", "placement", "prefix_cache_chart", "prompt_length_chart",
    "readings", "slo_line", "slo_to_draw", "stratified_sample", "time_buckets", "timebase", "ttft_prompt_chart",
    "turns_chart", "whole",
]
