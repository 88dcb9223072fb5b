"""Statistics for comparing two captures, in numpy only: intervals of a difference (from two
bootstraps, see :mod:`.bootstrap`, or two proportions), the Holm correction over a family of
tests, the two-sample Kolmogorov-Smirnov test and a Poisson rate-ratio test.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: confidence level of every displayed interval
LEVEL = 0.95
#: family-wise error rate of the better/worse decisions (Holm over the headline signals)
FAMILY_ALPHA = 0.05


@dataclass(frozen=True)
class Interval:
    """A difference after - before and its relative size, each with a 95% interval, and the
    two-sided p-value of "no difference" (NaN when there is no interval)."""

    diff: float
    diff_lo: float
    diff_hi: float
    rel: float
    rel_lo: float
    rel_hi: float
    p: float = float("nan")

    @property
    def excludes_zero(self) -> bool:
        return bool(np.isfinite(self.diff_lo) and np.isfinite(self.diff_hi) and (self.diff_lo > 0 or self.diff_hi < 0))


def _rel(after: np.ndarray, before: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(before != 0, after / before - 1.0, np.where(after == before, 0.0, np.sign(after - before) * np.inf))


def interval(est_before: float, est_after: float, reps_before: np.ndarray | None, reps_after: np.ndarray | None) -> Interval:
    """Percentile interval of the difference of two independent bootstraps (NaN bounds when a
    side has no replicates)."""
    a = (1 - LEVEL) / 2 * 100
    diff = est_after - est_before
    rel = float(_rel(np.array(est_after), np.array(est_before)))
    if reps_before is None or reps_after is None:
        return Interval(diff, np.nan, np.nan, rel, np.nan, np.nan)
    ok = np.isfinite(reps_before) & np.isfinite(reps_after)
    if ok.sum() < 0.9 * len(reps_before):
        return Interval(diff, np.nan, np.nan, rel, np.nan, np.nan)
    d = reps_after[ok] - reps_before[ok]
    r = _rel(reps_after[ok], reps_before[ok])
    r = r[np.isfinite(r)]
    dlo, dhi = np.percentile(d, [a, 100 - a])
    rlo, rhi = np.percentile(r, [a, 100 - a]) if len(r) >= 0.9 * ok.sum() else (np.nan, np.nan)
    return Interval(diff, float(dlo), float(dhi), rel, float(rlo), float(rhi), boot_p(d))


def boot_p(d: np.ndarray) -> float:
    """Two-sided bootstrap p-value of a zero difference: twice the smaller share of replicates
    on either side of 0, with the +1 of a Monte Carlo p-value (never 0; 2,000 resamples give at
    least 0.001). The percentile interval at level 1 - a excludes 0 exactly when this is < a
    (up to the +1), so the p-value and the displayed interval tell the same story."""
    d = d[np.isfinite(d)]
    if not len(d):
        return float("nan")
    tail = min(int((d <= 0).sum()), int((d >= 0).sum()))
    return min(1.0, 2 * (tail + 1) / (len(d) + 1))


def proportion_interval(k1: int, n1: int, k2: int, n2: int) -> Interval:
    """p2 - p1 with Newcombe's hybrid score interval (Wilson intervals of each proportion
    combined), which behaves at 0 errors where the Wald interval does not. Its p-value is the
    interval inverted: the smallest a at which the (1 - a) interval excludes 0."""
    iv = _newcombe(k1, n1, k2, n2, 1.959963984540054)
    if not math.isfinite(iv.diff) or iv.diff == 0:
        return Interval(iv.diff, iv.diff_lo, iv.diff_hi, iv.rel, iv.rel_lo, iv.rel_hi, 1.0 if iv.diff == 0 else math.nan)
    lo_a, hi_a = 1e-12, 1.0  # excludes 0 at level 1 - hi_a (wide), holds 0 at 1 - lo_a
    if not _newcombe(k1, n1, k2, n2, _z(hi_a - 1e-9)).excludes_zero:
        p = 1.0
    else:
        for _ in range(60):  # bisection on a: the interval narrows monotonically as a grows
            mid = math.sqrt(lo_a * hi_a)
            if _newcombe(k1, n1, k2, n2, _z(mid)).excludes_zero:
                hi_a = mid
            else:
                lo_a = mid
        p = hi_a
    return Interval(iv.diff, iv.diff_lo, iv.diff_hi, iv.rel, iv.rel_lo, iv.rel_hi, p)


def _z(a: float) -> float:
    """The two-sided normal quantile z with P(|Z| > z) = a (bisection on erfc; numpy only)."""
    lo, hi = 0.0, 40.0
    for _ in range(80):
        mid = (lo + hi) / 2
        if math.erfc(mid / math.sqrt(2)) > a:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _newcombe(k1: int, n1: int, k2: int, n2: int, z: float) -> Interval:
    if n1 == 0 or n2 == 0:
        return Interval(np.nan, np.nan, np.nan, np.nan, np.nan, np.nan)

    def wilson(k, n):
        p = k / n
        c = p + z * z / (2 * n)
        h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
        d = 1 + z * z / n
        return (c - h) / d, (c + h) / d

    p1, p2 = k1 / n1, k2 / n2
    l1, u1 = wilson(k1, n1)
    l2, u2 = wilson(k2, n2)
    d = p2 - p1
    lo = d - math.sqrt((p2 - l2) ** 2 + (u1 - p1) ** 2)
    hi = d + math.sqrt((u2 - p2) ** 2 + (p1 - l1) ** 2)
    rel = float(_rel(np.array(p2), np.array(p1)))
    return Interval(d, lo, hi, rel, np.nan, np.nan)


def holm(p_values: list[float], alpha: float = FAMILY_ALPHA) -> tuple[list[bool], list[float]]:
    """Holm-Bonferroni step-down over a family of tests: which null hypotheses are rejected with
    a family-wise error rate of at most ``alpha`` (under any dependence between the tests), and
    the Holm-adjusted p-values. NaN p-values are not tests: never rejected, not counted in k."""
    tested = [i for i, p in enumerate(p_values) if math.isfinite(p)]
    k = len(tested)
    reject = [False] * len(p_values)
    adjusted = [math.nan] * len(p_values)
    running = 0.0
    for rank, i in enumerate(sorted(tested, key=lambda i: p_values[i])):
        running = max(running, min(1.0, (k - rank) * p_values[i]))  # adjusted p-values never decrease
        adjusted[i] = running
        reject[i] = running <= alpha
    return reject, adjusted


def ks_2samp(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Two-sample Kolmogorov-Smirnov statistic D and its asymptotic p-value (Stephens'
    small-sample correction). NaN when a side is empty."""
    a = np.sort(a[np.isfinite(a)])
    b = np.sort(b[np.isfinite(b)])
    if len(a) == 0 or len(b) == 0:
        return float("nan"), float("nan")
    grid = np.concatenate([a, b])
    cdf_a = np.searchsorted(a, grid, side="right") / len(a)
    cdf_b = np.searchsorted(b, grid, side="right") / len(b)
    d = float(np.max(np.abs(cdf_a - cdf_b)))
    ne = len(a) * len(b) / (len(a) + len(b))
    lam = (math.sqrt(ne) + 0.12 + 0.11 / math.sqrt(ne)) * d
    return d, kolmogorov_sf(lam)


def kolmogorov_sf(lam: float) -> float:
    """P(K > lam) of the Kolmogorov distribution."""
    if lam < 0.2:
        return 1.0
    k = np.arange(1, 101)
    p = 2 * np.sum((-1.0) ** (k - 1) * np.exp(-2 * k * k * lam * lam))
    return float(min(max(p, 0.0), 1.0))


def rate_ratio_p(n1: int, t1: float, n2: int, t2: float) -> tuple[float, float]:
    """Ratio of two Poisson rates (n2/t2)/(n1/t1) and a two-sided p-value (normal test on the log)."""
    if n1 <= 0 or n2 <= 0 or t1 <= 0 or t2 <= 0:
        return float("nan"), float("nan")
    ratio = (n2 / t2) / (n1 / t1)
    z = abs(math.log(ratio)) / math.sqrt(1 / n1 + 1 / n2)
    return ratio, math.erfc(z / math.sqrt(2))
