"""One registry of named, unit-tagged signals.

A signal is a function of a :class:`~kvdoctor.signals.window.Window` returning one float, or
NaN when the window lacks the data (too few samples, source absent). Rules name signals; the
registry is what makes a misspelt name a load-time error instead of a silent never-fire.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..numeric import percentile_rank
from .quantiles import median, order_stats, percentiles


@dataclass(frozen=True)
class Signal:
    name: str
    unit: str
    doc: str
    fn: Callable[["Window"], float]  # noqa: F821 (forward ref, avoids an import cycle)


REGISTRY: dict[str, Signal] = {}


def signal(name: str, unit: str, doc: str | None = None):
    """Register a signal; the docstring of the function is its documentation."""

    def deco(fn):
        if name in REGISTRY:
            raise ValueError(f"signal {name!r} registered twice")
        REGISTRY[name] = Signal(name, unit, (doc or fn.__doc__ or "").strip(), fn)
        return fn

    return deco


def get(name: str) -> Signal:
    return REGISTRY[name]


def percentile(a: np.ndarray, q: float, min_n: int = 1) -> float:
    """numpy's linear-interpolation percentile of the non-NaN values, by one partition (signals
    call this tens of thousands of times on short arrays, where np.percentile's overhead rules)."""
    a = a[~np.isnan(a)]
    n = len(a)
    if n < max(min_n, 1):
        return float("nan")
    lo, hi, frac = percentile_rank(n, q)
    v_lo, v_hi = order_stats(a, (lo, hi)) if hi > lo else order_stats(a, (lo,)) * 2
    return float(v_lo + (v_hi - v_lo) * frac)


def ratio(num: float, den: float) -> float:
    if np.isnan(num) or np.isnan(den) or den <= 0:
        return float("nan")
    return float(num / den)


#: above this many pairs, fit() uses an even subsample: a rank correlation's standard error at
#: 2,048 pairs is ~0.022, far below any rule threshold, and the cost stops growing with traffic
FIT_MAX_POINTS = 2048

#: a fit of one request quantity on another (tokens, requests in flight) needs x to vary by at
#: least this share of its typical size: prompts of 21,073 and 21,173 tokens (0.5% apart)
#: cannot say what 1,000 more tokens cost; extrapolating a slope two hundred times past the
#: data gives numbers like -4,162 ms per 1k tokens. (Not for time axes: their level is an epoch.)
FIT_MIN_X_SPREAD_FRAC = 0.1


def fit(x: np.ndarray, y: np.ndarray, min_n: int = 8,
        min_spread_frac: float = 0.0) -> tuple[float, float, int]:
    """Least-squares slope of y on x and the rank (Spearman) correlation, over finite pairs.

    Rank correlation so that a few huge outliers cannot manufacture or hide a trend. Unknown
    (NaN) with fewer than ``min_n`` pairs or when x spans less than ``min_spread_frac`` of its
    median magnitude (a constant x is no trend: slope and correlation 0).
    """
    m = np.isfinite(x) & np.isfinite(y)
    n = int(np.count_nonzero(m))
    if n < min_n:
        return float("nan"), float("nan"), n
    x, y = x[m], y[m]
    spread = float(x.max() - x.min())
    if spread > 0 and min_spread_frac > 0:  # the level matters only to a spread that is not 0
        level = median(np.abs(x)) or float(np.mean(np.abs(x)))
        if spread < min_spread_frac * level:
            return float("nan"), float("nan"), n
    if n > FIT_MAX_POINTS:
        idx = np.linspace(0, n - 1, FIT_MAX_POINTS).astype(np.int64)
        x, y = x[idx], y[idx]
    if x.max() == x.min() or y.max() == y.min():
        return 0.0, 0.0, n
    xm = x - x.mean()
    slope = float((xm * (y - y.mean())).sum() / (xm * xm).sum())
    corr = corrcoef(ranks(x), ranks(y))
    return slope, corr, n


def corrcoef(x: np.ndarray, y: np.ndarray) -> float:
    """``float(np.corrcoef(x, y)[0, 1])`` by numpy's own steps (cov's centring and product,
    corrcoef's scaling and clip), bit for bit, without its argument handling (~50 us a call,
    as long as the work itself on a fit's 2,048 pairs)."""
    X = np.concatenate((x[None, :], y[None, :]), axis=0).astype(np.float64, copy=False)
    X -= X.mean(axis=1)[:, None]
    c = np.dot(X, X.T.conj())
    c *= np.true_divide(1, X.shape[1] - 1)
    stddev = np.sqrt(np.diag(c).real)
    c /= stddev[:, None]
    c /= stddev[None, :]
    np.clip(c.real, -1, 1, out=c.real)
    return float(c[0, 1])


def split_medians(k: np.ndarray, v: np.ndarray, lo_q: float = 25, hi_q: float = 75,
                  min_n: int = 8) -> tuple[float, float]:
    """(median of v where k is at or above its hi_q percentile, median where k is at or below
    its lo_q percentile), over finite pairs; NaNs with fewer than min_n pairs or flat k."""
    m = np.isfinite(k) & np.isfinite(v)
    if np.count_nonzero(m) < min_n:
        return float("nan"), float("nan")
    k, v = k[m], v[m]
    lo, hi = percentiles(k, (lo_q, hi_q))
    if hi <= lo:
        return float("nan"), float("nan")
    return median(v[k >= hi]), median(v[k <= lo])


def ranks(a: np.ndarray) -> np.ndarray:
    """Average ranks (ties share the mean of their positions), as Spearman needs: one sort,
    tie groups read off the sorted values."""
    order = np.argsort(a)  # tie order is irrelevant: tie groups get their mean rank
    s = a[order]
    starts = np.empty(len(s), dtype=bool)
    starts[:1] = True
    np.not_equal(s[1:], s[:-1], out=starts[1:])
    first = np.flatnonzero(starts)
    counts = np.diff(np.append(first, len(s)))
    avg = first + (counts - 1) / 2.0 + 1.0
    out = np.empty(len(a))
    out[order] = np.repeat(avg, counts)
    return out


#: trend_z over more requests than this keeps whole strata, evenly, up to about this many: the
#: test stays calibrated (each stratum keeps all its pairs) and 16k requests already find a
#: 2%-a-turn drift under 10% noise at z > 20; the cost stops growing with the capture
TREND_MAX_POINTS = 16_384


def _tie_sums(group: np.ndarray, a: np.ndarray, n_groups: int) -> tuple[np.ndarray, ...]:
    """Per group: sums over tie runs (t equal values) of t(t-1)(2t+5), t(t-1)(t-2), t(t-1).
    ``group``, ``a``: sorted by group, then a."""
    new_run = np.ones(len(a), dtype=bool)
    new_run[1:] = (group[1:] != group[:-1]) | (a[1:] != a[:-1])
    first = np.flatnonzero(new_run)
    t = np.diff(np.append(first, len(a))).astype(float)
    g = group[first]
    return tuple(np.bincount(g, weights=w, minlength=n_groups)
                 for w in (t * (t - 1) * (2 * t + 5), t * (t - 1) * (t - 2), t * (t - 1)))


def trend_z(stratum: np.ndarray, x: np.ndarray, y: np.ndarray, max_per_stratum: int = FIT_MAX_POINTS,
            max_points: int = TREND_MAX_POINTS, rows: np.ndarray | None = None) -> float:
    """(``stratum``: integer codes.) Whether y rises with x consistently within each stratum (Mann-Kendall's test stratified,
    as Hirsch & Slack's seasonal test): S = over every pair in one stratum, +1 where y moves with x,
    -1 against it; z = S over its standard deviation when x and y are unrelated (Kendall's variance
    with ties), continuity-corrected. Comparing only within a stratum (a conversation) keeps what
    differs between strata (their prompts, when they ran) out of the trend; z grows with the
    evidence (about the square root of the pairs), so 3 says a chance ordering is ~1 in 1,000 at any
    sample size. NaN when no stratum has two x and two y that differ. Past ``max_points`` requests
    every k-th stratum is kept; a stratum past ``max_per_stratum`` is evenly subsampled (the cost
    is quadratic in a stratum's size). ``rows``: only these requests (a mask), where given.

    Which strata stay is decided per stratum, so a million requests are gathered once, not
    filtered again at each step."""
    m = np.isfinite(x) & np.isfinite(y)
    if rows is not None:
        m &= rows
    sel = np.flatnonzero(m)
    if len(sel) < 2:
        return float("nan")
    code = stratum[sel].astype(np.int64)
    code -= code.min()
    sizes = np.bincount(code)
    several = sizes >= 2  # a stratum of one request has no pair
    n_pairs_rows = int(sizes[several].sum())
    if n_pairs_rows < 2:
        return float("nan")
    # strata numbered 0, 1, ... in the order of their codes (np.unique's inverse, without its sort)
    group_of = np.cumsum(several) - 1
    keep = several
    if n_pairs_rows > max_points and group_of[-1] > 0:
        keep = several & (group_of % -(-n_pairs_rows // max_points) == 0)
    kept = keep[code]
    sel, code = sel[kept], code[kept]
    group, x, y = group_of[code], x[sel], y[sel]
    order = np.lexsort((x, group))
    group, x, y = group[order], x[order], y[order]
    n = np.bincount(group)
    if (n > max_per_stratum).any():
        starts = np.concatenate(([0], np.cumsum(n)[:-1]))
        keep = np.concatenate([s + (np.linspace(0, c - 1, max_per_stratum).astype(np.int64) if c > max_per_stratum
                                    else np.arange(c)) for s, c in zip(starts, n)])
        x, y, group = x[keep], y[keep], group[keep]
        n = np.minimum(n, max_per_stratum)
    starts = np.concatenate(([0], np.cumsum(n)[:-1]))
    pos = np.arange(len(x)) - np.repeat(starts, n)  # place within its stratum
    partners = np.repeat(n, n) - 1 - pos  # pairs (i, j > i) within the stratum
    i = np.repeat(np.arange(len(x)), partners)
    j = i + 1 + (np.arange(len(i)) - np.repeat(np.cumsum(partners) - partners, partners))
    s = float((np.sign(x[j] - x[i]) * np.sign(y[j] - y[i])).sum())
    nf = n.astype(float)
    by_y = np.lexsort((y, group))
    (x1, x2, x3), (y1, y2, y3) = _tie_sums(group, x, len(n)), _tie_sums(group[by_y], y[by_y], len(n))
    with np.errstate(divide="ignore", invalid="ignore"):
        var = ((nf * (nf - 1) * (2 * nf + 5) - x1 - y1) / 18
               + np.where(nf > 2, x2 * y2 / (9 * nf * (nf - 1) * (nf - 2)), 0.0)
               + np.where(nf > 1, x3 * y3 / (2 * nf * (nf - 1)), 0.0))
    var = float(var[nf > 1].sum())
    if var < 0.5:  # 0 up to rounding: one pair that differs in both already gives 1
        return float("nan")
    return float((s - np.sign(s)) / np.sqrt(var))
