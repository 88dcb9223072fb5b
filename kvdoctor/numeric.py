"""Numbers for machines, one place for every module (core and test harness alike, no numpy
needed): where a percentile falls between two ranks, and a value made safe for JSON."""
from __future__ import annotations

import math
import numbers
from typing import Any, Sequence


def percentile_rank(n: int, q: float) -> tuple[int, int, float]:
    """For ``n`` sorted values, the two ranks numpy's default (linear) percentile ``q`` lies
    between and how far along: value = v[lo] + (v[hi] - v[lo]) * frac."""
    pos = (n - 1) * q / 100.0
    lo = int(pos)
    return lo, min(lo + 1, n - 1), pos - lo


def percentile_sorted(sorted_xs: Sequence[float], q: float) -> float | None:
    """numpy's linear percentile of an already sorted sequence; None when it is empty."""
    if not sorted_xs:
        return None
    lo, hi, frac = percentile_rank(len(sorted_xs), q)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * frac


def json_number(v: Any, digits: int = 6) -> Any:
    """A value for JSON output: NaN and infinities (not measured, no finite answer) become null,
    floats are rounded to ``digits``, numpy scalars become Python numbers; anything else
    (None, bool, text) passes as it is."""
    if v is None or isinstance(v, bool) or not isinstance(v, numbers.Real):
        return v
    if isinstance(v, numbers.Integral):
        return int(v)
    v = float(v)
    return None if math.isnan(v) or math.isinf(v) else round(v, digits)
