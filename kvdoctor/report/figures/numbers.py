"""Numbers for the page around the charts: the key numbers at the top, error messages."""
from __future__ import annotations

import math
from collections import Counter

import numpy as np

from ...diagnosis import Diagnosis
from ...signals import Prepared
from ...units import fmt
from .chart import slo_to_draw, whole


def key_numbers(diag: Diagnosis, prep: Prepared) -> list[tuple[str, str, bool]]:
    """The numbers at the top of the page: (label, value, over its SLO)."""
    w = whole(prep, diag)
    slo, _ = slo_to_draw(diag)
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
