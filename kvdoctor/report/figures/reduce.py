"""Reductions that keep a page small whatever the capture's size: round time buckets,
percentiles per bucket, stratified samples of scatters, series downsampled to their peaks,
binned medians. Pure numpy; no figures."""
from __future__ import annotations

import math

import numpy as np

#: at most this many points in one scatter; the rest is summarised by the median line
MAX_POINTS = 20_000
#: time buckets per chart at most, and the requests a bucket should hold on average
MAX_BUCKETS = 200
MIN_PER_BUCKET = 20
#: a percentile is drawn only for buckets with at least this many values
MIN_FOR_PERCENTILE = 5
#: engine, GPU and host samples drawn per series at most (bucketed by max beyond that)
MAX_SERIES_POINTS = 2_000
NICE_WIDTHS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)


def bucket_width(span_s: float, n: int) -> float:
    """A round bucket width: at most MAX_BUCKETS buckets, about MIN_PER_BUCKET requests each."""
    want = max(span_s / MAX_BUCKETS, span_s * MIN_PER_BUCKET / max(n, 1), 1e-9)
    for w in NICE_WIDTHS_S:
        if w >= want:
            return float(w)
    return float(math.ceil(want / 86400) * 86400)


def bucket_index(t: np.ndarray, start_s: float, width_s: float, n_buckets: int) -> np.ndarray:
    """The bucket of each value of ``t`` (finite), those outside clamped to the first or last."""
    return np.clip(((t - start_s) // width_s).astype(np.int64), 0, max(n_buckets - 1, 0))


def bucket_percentiles(t: np.ndarray, v: np.ndarray, start_s: float, width_s: float, n_buckets: int,
                       qs: tuple[float, ...] = (50, 90, 99), min_n: int = MIN_FOR_PERCENTILE) -> tuple[np.ndarray, np.ndarray]:
    """Per-bucket counts and percentiles (linear interpolation, as numpy.percentile) of ``v`` by
    the bucket of ``t``; NaN where a bucket holds fewer than ``min_n`` values. One sort for all."""
    m = np.isfinite(t) & np.isfinite(v)
    b = bucket_index(t[m], start_s, width_s, n_buckets)
    vals = v[m]
    counts = np.bincount(b, minlength=n_buckets)[:n_buckets]
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    out = np.full((len(qs), n_buckets), np.nan)
    if not len(vals):
        return counts, out
    # sort by (bucket, value) with one float sort: bucket * stride + value, stride > value range
    # (3x faster than lexsort on 1M values; the round trip costs ~1e-12 of the value range)
    lo_v = float(vals.min())
    stride = (float(vals.max()) - lo_v) * 1.5 + 1.0
    key = np.sort(b * stride + (vals - lo_v))
    vals = key - np.repeat(np.arange(len(counts)) * stride, counts) + lo_v
    ok = counts >= max(min_n, 1)
    if not ok.any():
        return counts, out
    s, c = starts[ok], counts[ok]
    for i, q in enumerate(qs):
        pos = s + (c - 1) * (q / 100.0)
        lo = np.floor(pos).astype(np.int64)
        hi = np.minimum(lo + 1, s + c - 1)
        frac = pos - lo
        out[i, ok] = vals[lo] + (vals[hi] - vals[lo]) * frac
    return counts, out


def stratified_sample(x: np.ndarray, y: np.ndarray, max_points: int = MAX_POINTS, n_strata: int = 50,
                      keep_top: int = 200, seed: int = 0) -> np.ndarray:
    """Indices of at most ``max_points`` finite (x, y) pairs: an equal share from each of
    ``n_strata`` equal-width bins of x (sparse regions such as rare long prompts keep all their
    points, dense ones are thinned), a sparse bin's unused share passed on to the others, plus
    the ``keep_top`` largest y (the slowest requests stay visible)."""
    idx = np.flatnonzero(np.isfinite(x) & np.isfinite(y))
    if len(idx) <= max_points:
        return idx
    xs, ys = x[idx], y[idx]
    top = idx[np.argpartition(ys, len(ys) - keep_top)[-keep_top:]] if keep_top else idx[:0]
    budget = max_points - len(top)
    lo_x, hi_x = float(xs.min()), float(xs.max())
    width = (hi_x - lo_x) / n_strata or 1.0  # equal-width strata along the drawn (linear) axis
    stratum = bucket_index(xs, lo_x, width, n_strata)
    counts = np.bincount(stratum, minlength=n_strata)
    # water-filling: the largest per-stratum quota q with sum(min(count, q)) <= budget
    lo, hi = 0, int(counts.max())
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if np.minimum(counts, mid).sum() <= budget:
            lo = mid
        else:
            hi = mid - 1
    quota = np.minimum(counts, lo)
    # each stratum keeps each of its points with probability quota/count (O(n), no sort); the
    # few points over budget that chance adds are dropped at random
    rng = np.random.default_rng(seed)
    keep_p = quota / np.maximum(counts, 1)
    chosen = np.flatnonzero(rng.random(len(xs)) < keep_p[stratum])
    if len(chosen) > budget:
        chosen = np.sort(rng.choice(chosen, budget, replace=False))
    return np.unique(np.concatenate([idx[chosen], top]))


def f32(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float32)


def downsample_series(t: np.ndarray, v: np.ndarray, max_points: int = MAX_SERIES_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """At most ``max_points`` samples of a time series: the max of each time bucket beyond that
    (memory and usage problems show at their peaks)."""
    m = np.isfinite(t) & np.isfinite(v)
    t, v = t[m], v[m]
    if len(t) <= max_points:
        order = np.argsort(t, kind="stable")
        return t[order], v[order]
    lo, hi = t.min(), t.max()
    width = (hi - lo) / max_points or 1.0
    b = bucket_index(t, lo, width, max_points)
    out = np.full(max_points, -np.inf)
    np.maximum.at(out, b, v)
    has = np.isfinite(out)
    centers = lo + (np.arange(max_points) + 0.5) * width
    return centers[has], out[has]


def binned_median(x: np.ndarray, y: np.ndarray, bins: int | None = None, min_n: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """Median of y in quantile bins of x (at the bin's median x); about 40 points a bin for
    small samples, 30 bins at most."""
    bins = bins or int(np.clip(len(x) // 40, 4, 30))
    edges = np.unique(np.quantile(x, np.linspace(0, 1, bins + 1)))
    if len(edges) < 2:
        return np.array([np.median(x)]), np.array([np.median(y)])
    b = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, len(edges) - 2)
    nb = len(edges) - 1
    _, py = bucket_percentiles(b.astype(float), y, 0.0, 1.0, nb, qs=(50,), min_n=min_n)
    _, px = bucket_percentiles(b.astype(float), x, 0.0, 1.0, nb, qs=(50,), min_n=min_n)
    ok = np.isfinite(py[0]) & np.isfinite(px[0])
    return px[0][ok], py[0][ok]
