"""Every chart the report can draw, by id, in page order."""
from __future__ import annotations

from ...diagnosis import Diagnosis
from ...signals import Prepared
from .chart import Chart
from .memory import memory_chart
from .scatter import bandwidth_chart, concurrency_chart, ttft_prompt_chart
from .timeline import errors_chart, latency_chart
from .workload import prefix_cache_chart, prompt_length_chart, turns_chart

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
    prep = prep or diag.prepared or Prepared(diag.capture, diag.options.targets, diag.options.stated)
    return {key: fn(diag, prep) for key, fn in BUILDERS.items()}
