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


def binom_sf(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p): how likely ``k`` or more of ``n`` requests land over an
    objective's target by chance when each does with probability ``p`` (the share it allows).

    Exact (a sum of log-space terms) where n*p is small, which is where objectives are judged on
    few requests; the normal approximation with continuity correction where n*p and n*(1-p) are
    both at least 10 (its error there is well under the 0.05 it is compared with). Not worth
    scipy (~40 MB, 0.3 s to import) for one tail."""
    if k <= 0:
        return 1.0
    if k > n or p <= 0:
        return 0.0
    if p >= 1:
        return 1.0
    if n * p >= 10 and n * (1 - p) >= 10:
        z = (k - 0.5 - n * p) / math.sqrt(n * p * (1 - p))
        return 0.5 * math.erfc(z / math.sqrt(2))
    lp, lq = math.log(p), math.log1p(-p)
    lgn = math.lgamma(n + 1)
    total = 0.0
    for x in range(k, min(n, k + 400) + 1):  # terms fall geometrically past the mean: 400 is plenty
        term = math.exp(lgn - math.lgamma(x + 1) - math.lgamma(n - x + 1) + x * lp + (n - x) * lq)
        total += term
        if term < 1e-16 * total:
            break
    return min(1.0, total)
